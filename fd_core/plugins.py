"""Plugin discovery from entry points, the allow-list, validation at load, and platform selection."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
from dataclasses import dataclass, field, replace
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, TextIO, TypeVar

import pluggy

from fd_core import hookspecs
from fd_core.detection import Detection
from fd_core.errors import PlatformError, PluginError
from fd_core.kernels import KernelTable, check_kernel
from fd_core.markers import PROJECT
from fd_core.models import Architecture, ModelRegistry

Kind = Literal["platform", "model", "extension"]
GROUPS: dict[str, Kind] = {"fd.platforms": "platform", "fd.models": "model", "fd.plugins": "extension"}
DISTRIBUTION = "fd-backends"
HOOK_NAMES: tuple[str, ...] = tuple(n for n in vars(hookspecs) if n.startswith(f"{PROJECT}_"))
# Seconds a plugin's hook may take when called at selection (detection, votes) before fd gives up on it.
HOOK_TIMEOUT_ENV = "FD_HOOK_TIMEOUT"
DEFAULT_HOOK_TIMEOUT = 60.0
# The longest wait fd accepts (FD_HOOK_TIMEOUT, --rank-timeout, --stall-timeout): a week. Python's own
# waits overflow near 1e10 s, and a wait of more than a week is a typo.
MAX_TIMEOUT_S = 7 * 24 * 3600
T = TypeVar("T")


# The stdout fd's own output goes to while plugin_prints_to_stderr is in effect, and whether it is
# (the real stdout is None when the process was started with file descriptor 1 closed).
_fd_stdout: TextIO | None = None
_redirected = False


def fd_stdout() -> TextIO:
    """Where fd writes its own output (--json, the generated text, reports): the real stdout, even while
    plugin_prints_to_stderr sends what everything else prints to stderr."""
    return _fd_stdout if _redirected and _fd_stdout is not None else sys.stdout


def fd_stdout_closed() -> bool:
    """Whether the process has no stdout to write fd's output to (started with it closed)."""
    return (_fd_stdout if _redirected else sys.stdout) is None


@contextlib.contextmanager
def plugin_prints_to_stderr() -> Iterator[TextIO]:
    """While fd runs one of its commands, what a plugin prints (at import, from a hook, a kernel, a
    thread) goes to stderr, so that `--json` and the text on stdout are fd's alone; fd writes its own
    output to fd_stdout(), which this yields. Ranks forked meanwhile inherit the arrangement."""
    global _fd_stdout, _redirected
    if _redirected:  # already in effect (a rank forked from a command)
        yield fd_stdout()
        return
    _fd_stdout, sys.stdout, _redirected = sys.stdout, sys.stderr, True
    try:
        yield fd_stdout()
    finally:
        sys.stdout, _fd_stdout, _redirected = _fd_stdout, None, False


@dataclass
class PluginRecord:
    """One discovered plugin: where it came from, whether it loaded, what it implements, what it said."""

    name: str
    kind: Kind
    value: str
    distribution: str | None = None
    version: str | None = None
    module: ModuleType | None = None
    allowed: bool = True
    load_error: str | None = None
    detection: Detection | None = None
    detect_error: str | None = None
    # Validation or registration failed: the plugin is listed, never registered, and `fd run` refuses to start.
    error: str | None = None
    active: bool = False
    status: str = ""

    @property
    def builtin(self) -> bool:
        return _normalise(self.distribution) == DISTRIBUTION

    @property
    def hooks(self) -> list[str]:
        if self.module is None:
            return []
        return sorted(n for n in HOOK_NAMES if impl_function(self.module, n) is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "module": self.value,
            "distribution": self.distribution,
            "version": self.version,
            "builtin": self.builtin,
            "allowed": self.allowed,
            "hooks": self.hooks,
            "detection": self.detection.to_dict() if self.detection else None,
            "error": self.load_error or self.error or self.detect_error,
            "active": self.active,
            "status": self.status,
        }


@dataclass
class PluginSet:
    """Everything loaded, the selected platform, the hook manager and the architecture registry."""

    records: list[PluginRecord]
    platform: str
    selection: str
    pm: pluggy.PluginManager
    registry: ModelRegistry = field(default_factory=ModelRegistry)
    # Subcommands plugins add to `fd`: name -> (help, run, plugin).
    commands: dict[str, tuple[str, Callable[[list[str]], int], str]] = field(default_factory=dict)
    # What makes this set unusable for a run (a plugin that failed validation or registration, a
    # platform name claimed twice); `fd plugins` lists them, everything else raises the first.
    problems: list[str] = field(default_factory=list)
    # The kernels the active platform and the extensions registered for fd's named ops.
    kernels: KernelTable = field(default_factory=KernelTable)

    def require_usable(self) -> None:
        """Raise the first problem as a PluginError (a run must not start with a broken plugin)."""
        if self.problems:
            more = f" (and {len(self.problems) - 1} more problem(s); see fd plugins)" if len(self.problems) > 1 else ""
            raise PluginError(self.problems[0] + more)

    @property
    def detection(self) -> Detection:
        record = self.record(self.platform)
        if record.detection is not None:
            return record.detection
        return Detection(detected=False, reason=record.detect_error or "not detected")

    def record(self, name: str, kind: Kind = "platform") -> PluginRecord:
        """The plugin of that kind and name; when two distributions claim the name, the one in use."""
        matches = [r for r in self.records if r.name == name and r.kind == kind]
        if not matches:
            raise KeyError(name)
        return next((r for r in matches if r.active), next((r for r in matches if r.error is None), matches[0]))


def _normalise(name: str | None) -> str | None:
    return None if name is None else name.lower().replace("_", "-")


_PARSER = pluggy.PluginManager(PROJECT)


def impl_function(module: object, hook: str) -> Any:
    """`module`'s implementation of `hook` if it is marked with @hookimpl (pluggy's own parsing), else None."""
    fn = getattr(module, hook, None)
    return fn if callable(fn) and _PARSER.parse_hookimpl_opts(module, hook) is not None else None


def _distance(a: str, b: str) -> int:
    """Levenshtein edit distance."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def _nearest(name: str, choices: Iterable[str]) -> str:
    """Suggest the closest valid name: edit distance (the shared `fd_` prefix aside), and names being
    verb-first, the same leading word counts in a candidate's favour (`fd_clear_grpah_opt_backend`
    means `fd_clear_graphs`, not `fd_graph_backend`)."""
    choices = sorted(choices)
    bare = name.removeprefix(f"{PROJECT}_")

    def cost(choice: str) -> float:
        other = choice.removeprefix(f"{PROJECT}_")
        same_verb = bare.split("_", 1)[0] == other.split("_", 1)[0]
        same_words = sorted(bare.split("_")) == sorted(other.split("_"))  # fd_detect_platform
        return _distance(bare, other) / max(len(bare), len(other), 1) - (0.3 if same_verb else 0.0) - (0.6 if same_words else 0.0)

    best = min(choices, key=cost, default=None)
    if best is not None and cost(best) <= 0.5:
        return f"did you mean {best!r}?"
    return f"valid names: {', '.join(choices)}"


def _hookspec_args(hook: str) -> tuple[str, ...]:
    return tuple(inspect.signature(getattr(hookspecs, hook)).parameters)


def arg_names(fn: Any) -> tuple[str, ...]:
    """The arguments pluggy passes to an implementation: positional ones without a default."""
    params = inspect.signature(fn).parameters.values()
    return tuple(
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    )


def validate_module(name: str, module: object) -> None:
    """Fail loudly on a hook that matches no spec, an unknown argument, or a missing @hookimpl."""
    for attr, value in vars(module).items() if hasattr(module, "__dict__") else ():
        if not callable(value):
            continue
        marked = hasattr(value, f"{PROJECT}_impl")
        if marked and attr not in HOOK_NAMES:
            raise PluginError(f"plugin {name!r}: hook {attr!r} matches no hookspec; {_nearest(attr, HOOK_NAMES)}")
        if not marked and attr in HOOK_NAMES and getattr(value, "__module__", None) == getattr(module, "__name__", None):
            raise PluginError(f"plugin {name!r}: function {attr!r} is named like a hook but lacks @hookimpl; decorate it with fd_core.hookimpl")
        if marked:
            opts: Mapping[str, Any] = _PARSER.parse_hookimpl_opts(module, attr) or {}
            if (opts.get("wrapper") or opts.get("hookwrapper")) and not inspect.isgeneratorfunction(value):
                raise PluginError(
                    f"plugin {name!r}: hook {attr!r}: declared as wrapper=True or hookwrapper=True but function is not a "
                    f"generator function; make it a generator that yields exactly once"
                )
            spec_args = _hookspec_args(attr)
            impl_args = arg_names(value)
            for arg in impl_args:
                if arg not in spec_args:
                    raise PluginError(
                        f"plugin {name!r}: hook {attr!r} takes argument {arg!r}, which the hookspec "
                        f"{attr}({', '.join(spec_args)}) does not provide; {_nearest(arg, spec_args)}"
                    )


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _register(pm: pluggy.PluginManager, name: str, module: object) -> None:
    try:
        pm.register(module, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        # validate_module has already checked what fd can name precisely; this is pluggy's own verdict.
        raise PluginError(f"plugin {name!r}: pluggy refused it: {' '.join(str(exc).split())}") from None


def _allow_list(env: Mapping[str, str]) -> set[str] | None:
    raw = env.get("FD_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def _allowed(record: PluginRecord, allow: set[str] | None) -> bool:
    if allow is None or record.builtin:
        return True
    return record.name in allow or _normalise(record.distribution) in {_normalise(a) for a in allow}


def _entry_points() -> list[tuple[Kind, EntryPoint]]:
    found: list[tuple[Kind, EntryPoint]] = []
    seen: set[tuple[str | None, str, str]] = set()
    for group, kind in GROUPS.items():
        for ep in entry_points(group=group):
            # One distribution visible twice on sys.path yields its entry points twice: keep one. Two
            # distributions declaring the same name are both kept, and the clash is reported.
            key = (_normalise(ep.dist.name) if ep.dist else None, group, ep.name)
            if key in seen:
                continue
            seen.add(key)
            found.append((kind, ep))
    return found


def _clashes(records: list[PluginRecord]) -> list[str]:
    """A message per plugin name that a second distribution also claims in the same group, blaming the newcomer."""
    problems = []
    by_name: dict[tuple[Kind, str], list[PluginRecord]] = {}
    for record in records:
        if record.allowed:
            by_name.setdefault((record.kind, record.name), []).append(record)
    for (kind, name), claimants in by_name.items():
        if len(claimants) < 2:
            continue
        # The built-in (or else the first found) keeps the name; every other claimant is the newcomer.
        keeper = next((r for r in claimants if r.builtin), claimants[0])
        for newcomer in claimants:
            if newcomer is keeper:
                continue
            newcomer.error = (
                f"distribution {newcomer.distribution!r} declares {kind} plugin {name!r}, which "
                f"{keeper.distribution or 'another plugin'} already provides; uninstall it, or leave it out with FD_PLUGINS"
            )
            problems.append(newcomer.error)
    return problems


def discover(env: Mapping[str, str] | None = None, extra: Iterable[tuple[Kind, str, object]] = ()) -> list[PluginRecord]:
    """Find and import every plugin; a plugin that fails to import is recorded and warned about, not skipped."""
    env = os.environ if env is None else env
    allow = _allow_list(env)
    records: list[PluginRecord] = []
    for kind, ep in _entry_points():
        dist = ep.dist
        record = PluginRecord(
            name=ep.name,
            kind=kind,
            value=ep.value,
            distribution=dist.name if dist else None,
            version=dist.version if dist else None,
        )
        if not _allowed(record, allow):
            record.allowed = False
            record.status = f"left out: not in FD_PLUGINS (add {record.name} to it to load this plugin)"
            records.append(record)
            continue
        try:
            record.module = ep.load()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - any import failure is the plugin's (sys.exit too), reported below
            record.load_error = f"import failed: {type(exc).__name__}: {exc}"
            record.status = "not loaded"
            print(f"fd: warning: plugin {record.name!r} ({record.value}) failed to import: {type(exc).__name__}: {exc}", file=sys.stderr)
        records.append(record)
    for kind, name, module in extra:
        records.append(PluginRecord(name=name, kind=kind, value=getattr(module, "__name__", repr(module)), module=module))  # type: ignore[arg-type]
    if allow:
        known = {r.name for r in records} | {_normalise(r.distribution) for r in records if r.distribution}
        missing = sorted(a for a in allow if a not in known and _normalise(a) not in known)
        if missing:
            installed = ", ".join(sorted(r.name for r in records if not r.builtin)) or "none"
            raise PluginError(f"FD_PLUGINS names {', '.join(missing)}, which is not installed; installed third-party plugins: {installed}")
    return records


def hook_timeout(env: Mapping[str, str] | None = None) -> float:
    """The time limit for a plugin's hook at selection: FD_HOOK_TIMEOUT seconds, else the default."""
    raw = (os.environ if env is None else env).get(HOOK_TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_HOOK_TIMEOUT
    except ValueError:
        raise PluginError(f"{HOOK_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise PluginError(f"{HOOK_TIMEOUT_ENV}={raw!r} must be a positive, finite number of seconds")
    if value > MAX_TIMEOUT_S:
        raise PluginError(f"{HOOK_TIMEOUT_ENV}={raw!r} is more than a week; give at most {MAX_TIMEOUT_S} seconds")
    return value


def call_bounded(fn: Callable[[], T], timeout: float, what: str) -> T:
    """fn() in a daemon thread; a PluginError naming `what` if it has not returned within `timeout` seconds.

    A plugin's code cannot be interrupted from outside; its thread is left behind and dies with the process.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"fd-hook {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise PluginError(
            f"{what} did not return within {timeout:g} s; fix or uninstall the plugin (FD_PLUGINS can leave it out, {HOOK_TIMEOUT_ENV} raises the limit)"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def _detect(record: PluginRecord, timeout: float) -> None:
    fn = impl_function(record.module, "fd_platform_detect")
    if fn is None:
        record.detect_error = "implements no fd_platform_detect; add one so it can be selected"
        return
    try:
        answer = call_bounded(fn, timeout, f"platform {record.name!r}: fd_platform_detect")
    except PluginError as exc:  # it never returned: not detected, and said so
        record.detect_error = str(exc).split(": ", 1)[1]
        print(f"fd: warning: {exc}", file=sys.stderr)
        return
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a detection that raises (or calls sys.exit) is reported, never fatal
        record.detect_error = f"fd_platform_detect raised {type(exc).__name__}: {exc}"
        print(f"fd: warning: platform {record.name!r}: {record.detect_error}", file=sys.stderr)
        return
    if answer is None:  # the spec allows it: "not my hardware, nothing to say"
        record.detection = Detection(detected=False, reason="fd_platform_detect returned None")
        return
    if not isinstance(answer, Detection):
        record.detect_error = f"fd_platform_detect returned {type(answer).__name__}, expected fd_core.Detection or None"
        print(f"fd: warning: platform {record.name!r}: {record.detect_error}", file=sys.stderr)
        return
    problem = answer.problem()
    if problem is not None:
        record.detect_error = f"fd_platform_detect returned a Detection with {problem}; fix the plugin"
        print(f"fd: warning: platform {record.name!r}: {record.detect_error}", file=sys.stderr)
        return
    record.detection = answer


def select_platform(records: list[PluginRecord], env: Mapping[str, str]) -> tuple[str, str]:
    """Pick the platform: FD_PLATFORM if set, else the highest-priority detection; none detected is an error."""
    platforms = [r for r in records if r.kind == "platform" and r.allowed and r.error is None]
    installed = ", ".join(sorted(r.name for r in platforms)) or "none"
    forced = env.get("FD_PLATFORM", "").strip()
    if forced:
        chosen = next((r for r in platforms if r.name == forced), None)
        if chosen is None:
            left_out = next((r for r in records if r.kind == "platform" and r.name == forced and not r.allowed), None)
            if left_out is not None:
                raise PlatformError(
                    f"FD_PLATFORM={forced!r} names a platform that FD_PLUGINS leaves out; add {forced} to FD_PLUGINS or unset one of them"
                )
            raise PlatformError(f"FD_PLATFORM={forced!r} names no installed platform; installed: {installed}")
        if chosen.module is None:
            raise PlatformError(f"FD_PLATFORM={forced!r}: that plugin failed to load ({chosen.load_error}); fix or reinstall it")
        if chosen.detection is not None and not chosen.detection.detected:
            # Forcing is allowed (fd explain, the suite's contract checks), but the listing must not read as "ready".
            return forced, f"forced by FD_PLATFORM={forced}; its hardware is not detected here: {chosen.detection.reason}"
        return forced, f"forced by FD_PLATFORM={forced}"
    usable = [r for r in platforms if r.detection is not None and r.detection.detected]
    if not usable:
        raise PlatformError(f"no platform detected its hardware; installed: {installed}; set FD_PLATFORM to one of them")
    top = max(r.detection.priority for r in usable)  # type: ignore[union-attr]
    best = [r for r in usable if r.detection.priority == top]  # type: ignore[union-attr]
    if len(best) > 1:
        names = " and ".join(sorted(r.name for r in best))
        raise PlatformError(f"platforms {names} both detected their hardware at priority {top}; set FD_PLATFORM to one of them")
    return best[0].name, f"detected with the highest priority ({top}): {best[0].detection.reason}"  # type: ignore[union-attr]


def caller_for(pm: pluggy.PluginManager, hook: str, plugin_name: str) -> Any:
    """A hook caller that runs `plugin_name`'s implementation of `hook` with every wrapper around it (pluggy's own API)."""
    others = [i.plugin for i in getattr(pm.hook, hook).get_hookimpls()
              if i.plugin_name != plugin_name and not (i.wrapper or i.hookwrapper)]
    return pm.subset_hook_caller(hook, remove_plugins=others)


def _call_each(
    pm: pluggy.PluginManager,
    hook: str,
    records: list[PluginRecord],
    register_for: Callable[[str], Callable[..., None]],
    undo: Callable[[str], None],
    builtins_first: bool = False,
) -> list[str]:
    """Call `hook` plugin by plugin, through pluggy with every wrapper around each, passing
    `register=register_for(plugin)`. A plugin that fails is undone (`undo(plugin)`) and marked on its
    record, and its message returned: a failure is that plugin's, never fatal here."""
    by_name = {r.name: r for r in records if r.module is not None}
    impls = [i for i in reversed(getattr(pm.hook, hook).get_hookimpls()) if not (i.wrapper or i.hookwrapper)]
    if builtins_first:  # so that a name clash blames the newcomer
        impls.sort(key=lambda i: not (i.plugin_name in by_name and by_name[i.plugin_name].builtin))
    problems = []
    for impl in impls:
        owner = impl.plugin_name
        try:
            caller_for(pm, hook, owner)(register=register_for(owner))
        except PluginError as exc:
            message = str(exc)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the plugin's own error (sys.exit included)
            message = f"plugin {owner!r}: {hook} raised {type(exc).__name__}: {exc}"
        else:
            continue
        problems.append(message)
        undo(owner)
        if owner in by_name:
            by_name[owner].error = message
    return problems


def _register_models(pm: pluggy.PluginManager, registry: ModelRegistry, records: list[PluginRecord]) -> list[str]:
    """Each model package's fd_register_models; a package that fails is marked and its architectures removed."""
    builtin = {r.name for r in records if r.module is not None and r.builtin}

    def register_for(owner: str) -> Callable[[Architecture], None]:
        has_clear = impl_function(pm.get_plugin(owner), "fd_clear_graphs") is not None

        def register(arch: Architecture) -> None:
            if not isinstance(arch, Architecture):
                raise PluginError(f"plugin {owner!r}: fd_register_models passed {type(arch).__name__} to register(); pass fd_core.Architecture")
            registry.add(replace(arch, package=owner), has_clear_hook=has_clear, builtin=owner in builtin)

        return register

    return _call_each(pm, "fd_register_models", records, register_for, registry.remove_package, builtins_first=True)


# Subcommands of `fd` itself; a plugin may not take these names.
CORE_COMMANDS = ("plugins", "explain", "run", "serve", "save-random", "check", "help")


def _register_commands(pm: pluggy.PluginManager, records: list[PluginRecord]) -> tuple[dict[str, Any], list[str]]:
    """Each plugin's fd_register_commands; a clash with a core or another plugin's command is that plugin's error."""
    commands: dict[str, tuple[str, Callable[[list[str]], int], str]] = {}

    def register_for(owner: str) -> Callable[..., None]:
        def register(name: str, help: str, run: Callable[[list[str]], int]) -> None:  # noqa: A002 - argparse's word
            if not (isinstance(name, str) and name.replace("-", "").isalnum() and callable(run)):
                raise PluginError(f"plugin {owner!r}: fd_register_commands passed name={name!r}, run={run!r}; pass a word and a callable")
            taken = "fd itself" if name in CORE_COMMANDS else commands[name][2] if name in commands else None
            if taken is not None:
                raise PluginError(f"plugin {owner!r} adds command {name!r}, which {taken!r} already provides; rename it in {owner!r}")
            commands[name] = (str(help), run, owner)

        return register

    def undo(owner: str) -> None:
        for name in [n for n, c in commands.items() if c[2] == owner]:
            del commands[name]

    return commands, _call_each(pm, "fd_register_commands", records, register_for, undo)


def _register_kernels(pm: pluggy.PluginManager, records: list[PluginRecord]) -> tuple[KernelTable, list[str]]:
    """The active platform's and each extension's fd_register_kernels; a model package may not provide kernels."""
    table = KernelTable()
    kinds = {r.name: r.kind for r in records if r.module is not None and r.active}

    def register_for(owner: str) -> Callable[..., None]:
        kind = kinds.get(owner, "extension")

        def register(op: str, fn: Callable[..., Any], capturable: bool = True) -> None:
            if kind == "model":
                raise PluginError(f"plugin {owner!r}: a model package may not register kernels; put them in a platform or an fd.plugins extension")
            table.add(check_kernel(owner, op, fn, capturable), from_platform=kind == "platform")

        return register

    return table, _call_each(pm, "fd_register_kernels", records, register_for, table.remove_plugin)


def load_plugins(
    env: Mapping[str, str] | None = None, extra: Iterable[tuple[Kind, str, object]] = (), *, strict: bool = True,
    planned: str | None = None,
) -> PluginSet:
    """Discover, validate and register plugins, select the platform, and fill the architecture registry.

    With `strict` (every caller but `fd plugins`), a plugin that fails validation or registration,
    or a name two distributions claim, raises a PluginError naming it; without, it is recorded on
    its record and in `problems`, left out, and the listing goes on. `planned` (a rank's call) is the
    platform the planning process selected: only its detection runs again, so that a detection that
    hangs costs its time limit once, in the planning process, not again in every rank.
    """
    env = os.environ if env is None else env
    timeout = hook_timeout(env)
    records = discover(env, extra)
    problems = _clashes(records)
    for record in records:
        if record.module is not None and record.error is None:
            try:
                validate_module(record.name, record.module)
            except PluginError as exc:
                record.error = str(exc)
                problems.append(record.error)
    if strict and problems:
        raise PluginError(problems[0])
    for record in records:
        if record.kind == "platform" and record.module is not None and record.error is None:
            if planned is not None and record.name != planned:
                record.detect_error = f"not asked: the run was planned on {planned!r}"
                continue
            _detect(record, timeout)
    platform, why = select_platform(records, env)
    pm = new_plugin_manager()
    for record in records:
        if record.module is None:
            continue
        if record.error is not None:
            record.status = f"failed: {record.error}"
            continue
        if record.kind == "platform":
            record.active = record.name == platform
            if record.active:
                record.status = f"active: {why}"
            elif record.detect_error:
                record.status = f"not active: {record.detect_error}"
            elif record.detection and record.detection.detected:
                record.status = f"not active: detected, but {platform!r} was chosen ({why})"
            else:
                record.status = f"not active: not detected: {record.detection.reason if record.detection else ''}"
            if not record.active:
                continue
        else:
            record.active = True
            record.status = "active"
        _register(pm, record.name, record.module)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(" ".join(str(exc).split())) from None
    registry = ModelRegistry()
    problems += _register_models(pm, registry, records)
    commands, command_problems = _register_commands(pm, records)
    problems += command_problems
    kernels, kernel_problems = _register_kernels(pm, records)
    problems += kernel_problems
    for record in records:
        if record.error is not None and record.active:
            record.active, record.status = False, f"failed: {record.error}"
    plugins = PluginSet(records=records, platform=platform, selection=why, pm=pm, registry=registry, problems=problems, commands=commands,
                        kernels=kernels)
    if strict:
        plugins.require_usable()
    return plugins
