"""Plugin discovery from entry points, the allow-list, validation at load, and platform selection."""

from __future__ import annotations

import difflib
import inspect
import os
import sys
from dataclasses import dataclass, field, replace
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Any, Iterable, Literal, Mapping

import pluggy

from fd_core import hookspecs
from fd_core.detection import Detection
from fd_core.errors import PlatformError, PluginError
from fd_core.markers import PROJECT
from fd_core.models import Architecture, ModelRegistry

Kind = Literal["platform", "model", "extension"]
GROUPS: dict[str, Kind] = {"fd.platforms": "platform", "fd.models": "model", "fd.plugins": "extension"}
DISTRIBUTION = "fd-backends"
DEFAULT_PLATFORM = "cpu"
HOOK_NAMES: tuple[str, ...] = tuple(n for n in vars(hookspecs) if n.startswith(f"{PROJECT}_"))


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
    active: bool = False
    status: str = ""

    @property
    def builtin(self) -> bool:
        return _normalise(self.distribution) == DISTRIBUTION

    @property
    def hooks(self) -> list[str]:
        if self.module is None:
            return []
        return sorted(n for n in HOOK_NAMES if _impl_function(self.module, n) is not None)

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
            "error": self.load_error or self.detect_error,
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

    @property
    def detection(self) -> Detection:
        record = self.record(self.platform)
        if record.detection is not None:
            return record.detection
        return Detection(detected=False, reason=record.detect_error or "not detected")

    def record(self, name: str, kind: Kind = "platform") -> PluginRecord:
        for r in self.records:
            if r.name == name and r.kind == kind:
                return r
        raise KeyError(name)


def _normalise(name: str | None) -> str | None:
    return None if name is None else name.lower().replace("_", "-")


def _impl_function(module: object, hook: str) -> Any:
    fn = getattr(module, hook, None)
    return fn if callable(fn) and hasattr(fn, f"{PROJECT}_impl") else None


def _nearest(name: str, choices: Iterable[str]) -> str:
    """Suggest the closest name; hook names are verb-first, so a matching first word counts most."""
    choices = list(choices)

    def first_word(text: str) -> str:
        return text.removeprefix(f"{PROJECT}_").split("_", 1)[0]

    def score(choice: str) -> tuple[bool, float]:
        return first_word(choice) == first_word(name), difflib.SequenceMatcher(None, name, choice).ratio()

    best = max(choices, key=score, default=None)
    if best is not None and (score(best)[0] or score(best)[1] >= 0.5):
        return f"did you mean {best!r}?"
    return f"valid names: {', '.join(sorted(choices))}"


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
    except pluggy.PluginValidationError as exc:
        # pluggy's message spans lines: "Plugin .. for hook ..", the definition, then the reason.
        lines = str(exc).splitlines()
        hook = next((ln.split("for hook ")[-1].strip("'") for ln in lines if "for hook " in ln), "?")
        reason = lines[-1][0].lower() + lines[-1][1:] if lines else "invalid"
        fix = "; make it a generator that yields exactly once" if "generator" in reason else ""
        raise PluginError(f"plugin {name!r}: hook {hook!r}: {reason}{fix}") from None
    except ValueError as exc:
        raise PluginError(f"plugin {name!r}: {exc}") from None


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
    seen: set[tuple[str, str]] = set()
    for group, kind in GROUPS.items():
        for ep in entry_points(group=group):
            # A distribution visible twice on sys.path yields its entry points twice.
            if (group, ep.name) in seen:
                continue
            seen.add((group, ep.name))
            found.append((kind, ep))
    return found


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
        except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's, reported below
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


def _detect(record: PluginRecord) -> None:
    fn = _impl_function(record.module, "fd_platform_detect")
    if fn is None:
        record.detect_error = "implements no fd_platform_detect; add one so it can be selected"
        return
    try:
        answer = fn()
    except Exception as exc:  # noqa: BLE001 - a detection that raises is reported, never fatal
        record.detect_error = f"fd_platform_detect raised {type(exc).__name__}: {exc}"
        print(f"fd: warning: platform {record.name!r}: {record.detect_error}", file=sys.stderr)
        return
    if not isinstance(answer, Detection):
        record.detect_error = f"fd_platform_detect returned {type(answer).__name__}, expected fd_core.Detection"
        return
    problem = answer.problem()
    if problem is not None:
        record.detect_error = f"fd_platform_detect returned a Detection with {problem}; fix the plugin"
        return
    record.detection = answer


def select_platform(records: list[PluginRecord], env: Mapping[str, str]) -> tuple[str, str]:
    """Pick the platform: FD_PLATFORM if set, else the highest-priority detection, else cpu."""
    platforms = [r for r in records if r.kind == "platform" and r.allowed]
    installed = ", ".join(sorted(r.name for r in platforms)) or "none"
    forced = env.get("FD_PLATFORM", "").strip()
    if forced:
        chosen = next((r for r in platforms if r.name == forced), None)
        if chosen is None:
            raise PlatformError(f"FD_PLATFORM={forced!r} names no installed platform; installed: {installed}")
        if chosen.module is None:
            raise PlatformError(f"FD_PLATFORM={forced!r}: that plugin failed to load ({chosen.load_error}); fix or reinstall it")
        return forced, f"forced by FD_PLATFORM={forced}"
    usable = [r for r in platforms if r.detection is not None and r.detection.detected]
    if not usable:
        if any(r.name == DEFAULT_PLATFORM and r.module is not None for r in platforms):
            return DEFAULT_PLATFORM, "no platform detected its hardware; using the default"
        raise PlatformError(f"no platform detected and the default {DEFAULT_PLATFORM!r} is not loaded; installed: {installed}")
    top = max(r.detection.priority for r in usable)  # type: ignore[union-attr]
    best = [r for r in usable if r.detection.priority == top]  # type: ignore[union-attr]
    if len(best) > 1:
        names = " and ".join(sorted(r.name for r in best))
        raise PlatformError(f"platforms {names} both detected their hardware at priority {top}; set FD_PLATFORM to one of them")
    return best[0].name, f"detected with the highest priority ({top}): {best[0].detection.reason}"  # type: ignore[union-attr]


def _register_models(pm: pluggy.PluginManager, registry: ModelRegistry) -> None:
    for impl in pm.hook.fd_register_models.get_hookimpls():
        owner = impl.plugin_name
        has_clear = _impl_function(impl.plugin, "fd_clear_graphs") is not None

        def register(arch: Architecture, _owner: str = owner, _has_clear: bool = has_clear) -> None:
            if not isinstance(arch, Architecture):
                raise PluginError(f"plugin {_owner!r}: fd_register_models passed {type(arch).__name__} to register(); pass fd_core.Architecture")
            registry.add(replace(arch, package=_owner), has_clear_hook=_has_clear)

        impl.function(*[{"register": register}[a] for a in impl.argnames])


def load_plugins(env: Mapping[str, str] | None = None, extra: Iterable[tuple[Kind, str, object]] = ()) -> PluginSet:
    """Discover, validate and register plugins, select the platform, and fill the architecture registry."""
    env = os.environ if env is None else env
    records = discover(env, extra)
    for record in records:
        if record.module is not None:
            validate_module(record.name, record.module)
    for record in records:
        if record.kind == "platform" and record.module is not None:
            _detect(record)
    platform, why = select_platform(records, env)
    pm = new_plugin_manager()
    for record in records:
        if record.module is None:
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
        raise PluginError(str(exc)) from None
    registry = ModelRegistry()
    _register_models(pm, registry)
    return PluginSet(records=records, platform=platform, selection=why, pm=pm, registry=registry)
