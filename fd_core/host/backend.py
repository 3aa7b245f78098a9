"""The Backend: hot-path ops bound once at build time, the graph decision, cleanup and graph clear."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import types
from typing import Any, Callable, Iterator, Mapping

from fd_core.config import ModelConfig, ParallelConfig
from fd_core.detection import Detection
from fd_core.error_lines import error_line
from fd_core.errors import ConfigError, NumericsError, PlatformError, PluginError, RequestRefused, in_terms, setting
from fd_core.graphs import CastVote, GraphBackend, GraphDecision, GraphVote
from fd_core.host.kernel_table import KernelTable, Ops
from fd_core.host.loading import PluginSet, load_plugins
from fd_core.host.registration import caller_for
from fd_core.host.selection import call_bounded, hook_timeout
from fd_core.lifecycle import RANK_END_TIMEOUT_S, EndReason, RankContext

AllReduce = Callable[[Any], Any]


def _identity(tensor: Any) -> Any:
    """All-reduce over one rank."""
    return tensor


def _bind(fn: Callable[..., Any], argnames: tuple[str, ...], group: Any) -> AllReduce:
    """A one-argument callable for `fn(tensor, group)` that adds no Python frame where it can."""
    if argnames == ("tensor",):
        return fn
    if argnames == ("group", "tensor"):
        return types.MethodType(fn, group)
    if (
        argnames == ("tensor", "group")
        and isinstance(fn, types.FunctionType)
        and fn.__code__.co_argcount == 2
        and not fn.__defaults__
    ):
        # The same code object with `group` as its default: calling it costs exactly a direct call.
        bound = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, (group,), fn.__closure__)
        bound.__kwdefaults__ = fn.__kwdefaults__
        bound.__qualname__ = fn.__qualname__
        bound.__doc__ = fn.__doc__
        bound.__module__ = fn.__module__
        return bound
    values = {"group": group}

    def call(tensor: Any) -> Any:
        return fn(*[tensor if a == "tensor" else values[a] for a in argnames])

    return call


def _chain(fns: list[AllReduce], names: list[str]) -> AllReduce:
    """First result wins, as pluggy's firstresult: an implementation returns None to pass."""

    def all_reduce(tensor: Any) -> Any:
        for fn in fns:
            result = fn(tensor)
            if result is not None:
                return result
        raise PluginError(
            f"fd_all_reduce: every implementation ({', '.join(names)}) passed on a tensor of shape "
            f"{list(tensor.shape)}; the platform's implementation must always return a result"
        )

    return all_reduce


def _checked_vote(plugin: str, answer: Any) -> CastVote:
    """A plugin's vote, type-checked: a third party's answer is verified where it is used."""
    if not isinstance(answer, GraphVote):
        raise PluginError(
            f"plugin {plugin!r}: fd_graph_eligibility returned {type(answer).__name__}; "
            f"return fd_core.GraphVote or None"
        )
    if (
        not isinstance(answer.allow, bool)
        or not isinstance(answer.reason, str)
        or not isinstance(answer.advisory, bool)
    ):
        raise PluginError(
            f"plugin {plugin!r}: fd_graph_eligibility returned GraphVote(allow={answer.allow!r}, "
            f"reason={answer.reason!r}, advisory={answer.advisory!r}); allow and advisory must be True or False and "
            f"reason a string"
        )
    if not answer.allow and not answer.reason.strip():
        raise PluginError(
            f"plugin {plugin!r}: fd_graph_eligibility vetoed without a reason; return GraphVote.veto('why')"
        )
    return CastVote(plugin, answer.allow, answer.reason, answer.advisory and not answer.allow)


class Backend:
    """The active platform's ops for one rank; build it with `load_backend()`."""

    all_reduce: AllReduce

    def __init__(
        self, plugins: PluginSet, parallel: ParallelConfig | None = None, kernels: KernelTable | None = None
    ) -> None:
        """`kernels` replaces the plugins' kernel table (an empty KernelTable: every op native, the reference the suite
        compares with)."""
        self.plugins = plugins
        self.parallel = parallel or ParallelConfig()
        self.platform: str = plugins.platform
        self.detection: Detection = plugins.detection
        self.all_reduce, self.all_reduce_binding = self._bind_all_reduce()
        self.kernels: KernelTable = plugins.kernels if kernels is None else kernels
        self._ops: Ops | None = None
        self._step_callers: list[tuple[str, Any]] | None = None
        # The plugins whose fd_rank_start ran in the current rank (rank_end ends them).
        self._started: list[str] = []

    @property
    def ops(self) -> Ops:
        """Every named op resolved to its kernel, once (on first use: the native ops import paddle, which
        checks before a run must not); a layer that fetched `backend.ops.rms_norm` calls the kernel directly."""
        if self._ops is None:
            from fd_core import native_ops

            self._ops = Ops(self.kernels, native_ops)
        return self._ops

    @property
    def hook(self) -> Any:
        return self.plugins.pm.hook

    def _bind_all_reduce(self) -> tuple[AllReduce, str]:
        if self.parallel.tp_size == 1:
            return _identity, "identity (one rank)"
        caller = self.hook.fd_all_reduce
        impls = caller.get_hookimpls()
        wrappers = [i.plugin_name for i in impls if i.hookwrapper or i.wrapper]
        group = self.parallel.group
        if wrappers:
            # The full hook call, so that every wrapper sees every call; resolved once, public API only.
            def through_hook(tensor: Any) -> Any:
                return caller(tensor=tensor, group=group)

            return through_hook, f"hook call (wrapped by {', '.join(wrappers)})"
        # pluggy calls the last of get_hookimpls() first.
        ordered = list(reversed(impls))
        if not ordered:
            raise PluginError(
                f"platform {self.platform!r} implements no fd_all_reduce; tp={self.parallel.tp_size} needs one"
            )
        bound = [_bind(i.function, tuple(i.argnames), group) for i in ordered]
        names = [i.plugin_name for i in ordered]
        if len(bound) == 1:
            return bound[0], f"direct: {names[0]}.{ordered[0].function.__name__}"
        return _chain(bound, names), f"first result of {', '.join(names)}"

    def clean_memory_fragments(
        self, state_dict: Mapping[str, Any] | None = None, after_each: Callable[[str], None] | None = None,
    ) -> None:
        """Run every implementation (the platform's and any model package's), each through pluggy; one that raises is
        named.

        `after_each(plugin)` runs after each implementation (the runtime's guard that the weights are unchanged, so
        that its error names the plugin whose hook changed them)."""
        for impl in reversed(self.hook.fd_clean_memory_fragments.get_hookimpls()):
            if impl.wrapper or impl.hookwrapper:
                continue
            try:
                caller_for(self.plugins.pm, "fd_clean_memory_fragments", impl.plugin_name)(state_dict=state_dict)
            except Exception as exc:  # noqa: BLE001 - a third party's error, named for whoever must fix it
                raise PluginError(
                    f"plugin {impl.plugin_name!r}: fd_clean_memory_fragments raised {type(exc).__name__}: {exc}; "
                    f"fix or uninstall the plugin"
                ) from exc
            if after_each is not None:
                after_each(impl.plugin_name)

    # -- a rank's lifecycle (contract 1.2) ----------------------------------------------------
    def rank_start(self, rank: RankContext) -> None:
        """Every plugin's fd_rank_start, on the calling thread (a device binding may be the thread's own); one that
        raises stops the rank, named (rank_end then ends the plugins started so far, that one included)."""
        self._started = []
        for name, caller in self._callers("fd_rank_start"):
            self._started.append(name)
            try:
                caller(rank=rank)
            except Exception as exc:  # noqa: BLE001 - a third party's error, named for whoever must fix it
                raise PluginError(
                    f"plugin {name!r}: fd_rank_start raised {error_line(exc)} on rank {rank.rank}; fix or uninstall "
                    f"the plugin"
                ) from exc
        # Bound once: before_step runs before every prefill and decode step.
        self._step_callers = self._callers("fd_before_step")

    def before_step(self, rank: RankContext, rows: int | None) -> None:
        """Every plugin's fd_before_step for the coming prefill (`rows` None) or decode step, on the computing
        thread."""
        callers = self._step_callers
        if callers is None:
            callers = self._step_callers = self._callers("fd_before_step")
        for name, caller in callers:
            try:
                caller(rank=rank, rows=rows)
            except Exception as exc:  # noqa: BLE001 - named, as rank_start
                raise PluginError(
                    f"plugin {name!r}: fd_before_step raised {error_line(exc)}; fix or uninstall the plugin"
                ) from exc

    def rank_end(self, rank: RankContext, reason: EndReason, timeout: float = RANK_END_TIMEOUT_S) -> list[str]:
        """fd_rank_end of every plugin rank_start started, in the reverse order, each on a helper thread and bounded by
        `timeout` seconds: the rank ends whatever they do. What went wrong (a plugin that raised or did not return)
        comes back as one line each, and is printed to stderr; it never replaces the error that ended the rank."""
        started, self._started = self._started, []
        callers = dict(self._callers("fd_rank_end"))
        problems = []
        for name in reversed(started):
            caller = callers.get(name)
            if caller is None:
                continue
            try:
                call_bounded(functools.partial(caller, rank=rank, reason=reason), timeout,
                             f"plugin {name!r}: fd_rank_end")
            except PluginError:  # call_bounded's time limit
                problems.append(f"plugin {name!r}: fd_rank_end did not return within {timeout:g} s, and the rank ended "
                                f"without it; fix the plugin")
            except BaseException as exc:  # noqa: BLE001 - reported; the rank ends either way (SystemExit included)
                problems.append(f"plugin {name!r}: fd_rank_end raised {error_line(exc)}; fix the plugin")
        for problem in problems:
            print(f"fd: warning: rank {rank.rank}: {problem}", file=sys.stderr, flush=True)
        return problems

    def _callers(self, hook: str) -> list[tuple[str, Any]]:
        """(plugin, a caller of its implementation of `hook` with every wrapper around it), in pluggy's call order."""
        return [(impl.plugin_name, caller_for(self.plugins.pm, hook, impl.plugin_name))
                for impl in reversed(getattr(self.hook, hook).get_hookimpls())
                if not (impl.wrapper or impl.hookwrapper)]

    def check_collective(self) -> None:
        """At tp > 1, all-reduce tensors whose exact sums are known and compare, before any weight is loaded.

        Three float32 shapes: a small one, a 3-D activation [batch, tokens, hidden] and one of 4 MiB + 4 bytes
        (above the size where a platform commonly switches algorithm). Each rank contributes
        (rank + 1) * (1 + k / 256): exact in float32 but not in a 16-bit dtype, distinct per rank, so a
        platform that drops, repeats or offsets a rank's part, narrows it on the wire, returns another
        dtype or shape, or returns non-finite numbers is caught here rather than turning into
        plausible-looking tokens.
        """
        if self.parallel.tp_size == 1:
            return
        import numpy as np
        import paddle

        world, rank = self.parallel.tp_size, self.parallel.tp_rank
        for shape in ((8,), (2, 3, 64), ((4 << 20) // 4 + 1,)):
            count = int(np.prod(shape))
            base = (1 + (np.arange(count) % 255) / 256).astype(np.float32).reshape(shape)
            expected = base * np.float32(world * (world + 1) // 2)
            what = f"float32{list(shape)}"
            try:
                result = self.all_reduce(paddle.to_tensor(base * np.float32(rank + 1)))
            except Exception as exc:  # noqa: BLE001 - the platform's own failure, named
                raise PluginError(
                    f"platform {self.platform!r}: fd_all_reduce failed on a known {what} tensor: "
                    f"{type(exc).__name__}: {exc}; run fd check {self.platform}"
                ) from exc
            where = (
                f"platform {self.platform!r}: the all-reduce ({self.all_reduce_binding}) of a known {what} tensor "
                f"on rank {rank} of {world}"
            )
            dtype = str(getattr(result, "dtype", type(result).__name__)).replace("paddle.", "")
            got_shape = list(getattr(result, "shape", []))
            if dtype != "float32" or got_shape != list(shape):
                raise NumericsError(
                    f"{where} returned {dtype}{got_shape}, expected {what}; run fd check {self.platform}"
                )
            got = np.asarray(result.numpy(), dtype=np.float64).reshape(shape)
            wrong = got != expected
            if wrong.any():
                first = tuple(int(i) for i in np.argwhere(wrong)[0])
                error = np.where(np.isnan(got), np.inf, np.abs(got - expected))
                raise NumericsError(
                    f"{where} returned a wrong sum at {int(wrong.sum())} of {wrong.size} elements: "
                    f"first at index {list(first)}, {got[first]:.9g} where {float(expected[first]):.9g} is exact; "
                    f"largest error {float(error.max()):.3g}; it does not sum, run fd check {self.platform}"
                )

    def graph_decision(
        self, model_config: ModelConfig, parallel_config: ParallelConfig | None = None, requested: str = "auto"
    ) -> GraphDecision:
        """Ask every plugin to vote (none under `requested` "off"); any veto wins (an advisory no-gain vote too, unless
        `requested` is "on"); every answer is kept."""
        parallel_config = parallel_config or self.parallel
        mode = self.graph_mode
        votes: list[CastVote] = []
        if requested == "off":
            # No plugin votes: a report of votes that could not change anything would read as if they had.
            return GraphDecision(allowed=False, mode=mode, votes=(), requested=requested)
        self.check_graph_request(requested)
        votes += [
            CastVote(plugin, False, f"its kernel for {op} is registered as not capturable")
            for op, plugin in self.kernels.uncapturable().items()
        ]
        registry = self.plugins.registry
        if model_config.architecture in registry:
            arch = registry.get(model_config.architecture)
            if not arch.graph_capable:
                votes.append(CastVote(arch.package, False, f"{arch.name} is registered as not graph-capable"))
        args = {"model_config": model_config, "parallel_config": parallel_config, "graph_mode": mode or ""}
        for name, answers in self._ask_each("fd_graph_eligibility", args):
            if isinstance(answers, BaseException):  # a voter that raises vetoes, with its error as reason
                votes.append(CastVote(name, False, f"fd_graph_eligibility raised {type(answers).__name__}: {answers}"))
                continue
            for answer in answers:  # one per voter; more only if a wrapper added votes
                votes.append(_checked_vote(name, answer))
        decision = GraphDecision(allowed=False, mode=mode, votes=tuple(votes), requested=requested)
        allowed = mode is not None and not decision.vetoes
        return dataclasses.replace(decision, allowed=allowed)

    def _ask_each(self, hook: str, args: Mapping[str, Any]) -> Iterator[tuple[str, list[Any] | Exception]]:
        """Each plugin's implementation of `hook`, one at a time through pluggy with every wrapper around it and
        bounded in time: (plugin, its answers, or the exception it raised). A timeout is a PluginError, raised."""
        timeout = hook_timeout()
        for impl in reversed(getattr(self.hook, hook).get_hookimpls()):
            if impl.wrapper or impl.hookwrapper:
                continue
            name = impl.plugin_name
            caller = caller_for(self.plugins.pm, hook, name)
            result: list[Any] | Exception
            try:
                result = call_bounded(functools.partial(caller, **args), timeout, f"plugin {name!r}: {hook}")
            except PluginError:
                raise
            except Exception as exc:  # noqa: BLE001 - the plugin's own error; the caller decides what it means
                result = exc
            yield name, result

    def check_graph_request(self, requested: str) -> None:
        """`--graph on` with a kernel that cannot be captured is refused (auto turns graphs off with a vote instead)."""
        uncapturable = self.kernels.uncapturable()
        if requested == "on" and uncapturable:
            op, plugin = next(iter(uncapturable.items()))
            raise ConfigError(
                f"{setting('graph', 'on')}: plugin {plugin!r} registered its kernel for {op} as not capturable; "
                f"use {in_terms('--graph auto or off', repr('auto') + ' or ' + repr('off'))}"
            )

    @functools.cached_property
    def _graph_object(self) -> Any:
        """What the platform's fd_graph_backend returned, asked once per Backend: one graph backend per run."""
        return self.hook.fd_graph_backend(parallel_config=self.parallel)

    @property
    def graph_mode(self) -> str | None:
        """The kind of graph the platform captures (its graph backend's `mode`), None if none."""
        backend = self._graph_object
        return getattr(backend, "mode", None) if backend is not None else None

    def graph_backend(self) -> GraphBackend:
        """The platform's capture / replay / clear object (checked: a third party's object), the same one each call."""
        backend = self._graph_object
        if backend is None:
            raise PlatformError(f"platform {self.platform!r} returned no graph backend; use {setting('graph', 'off')}")
        missing = [m for m in ("capture", "replay", "has", "clear") if not callable(getattr(backend, m, None))]
        if missing or not isinstance(getattr(backend, "mode", None), str):
            what = f"lacks {', '.join(missing)}()" if missing else "has no string `mode`"
            raise PluginError(
                f"platform {self.platform!r}: fd_graph_backend returned {type(backend).__name__}, which {what}; "
                f"fix the plugin or use {setting('graph', 'off')}"
            )
        return backend

    def clear_graphs(self, model: Any) -> None:
        """Drop the model's captured graphs through its package's fd_clear_graphs hook."""
        handled = self.hook.fd_clear_graphs(model=model)
        if not handled:
            raise PluginError(
                f"no fd_clear_graphs implementation handled {type(model).__name__}; "
                f"its model package must implement fd_clear_graphs(model) and return True"
            )

    def check_request(
        self,
        request: Any,
        model_config: ModelConfig,
        parallel_config: ParallelConfig | None = None,
        stream: bool = False,
    ) -> None:
        """Ask every plugin's fd_check_request (each through pluggy, time-bounded); the first reason refuses the
        request.

        A refusal is a RequestRefused naming the plugin; an answer other than a reason or None, a blank
        reason, or a gate that raises is that plugin's PluginError.
        """
        args = {
            "request": request,
            "model_config": model_config,
            "parallel_config": parallel_config or self.parallel,
            "stream": stream,
        }
        for name, answers in self._ask_each("fd_check_request", args):
            if isinstance(answers, BaseException):  # a third party's error, named for whoever must fix it
                raise PluginError(
                    f"plugin {name!r}: fd_check_request raised {type(answers).__name__}: {answers}; "
                    f"fix or uninstall the plugin"
                ) from answers
            for answer in answers:
                if not isinstance(answer, str):
                    raise PluginError(
                        f"plugin {name!r}: fd_check_request returned {type(answer).__name__} {answer!r:.60}; "
                        f"return a reason (str) to refuse the request, or None to accept it"
                    )
                if not answer.strip():
                    raise PluginError(
                        f"plugin {name!r}: fd_check_request refused with an empty reason; return the reason as a string"
                    )
                raise RequestRefused(f"{name} refuses this request: {' '.join(answer.split())}")

    def require_hardware(self) -> None:
        """Raise unless the selected platform detected its hardware (a forced platform may not have)."""
        if not self.detection.detected:
            raise PlatformError(
                f"platform {self.platform!r} is selected but its hardware is not here "
                f"({self.detection.reason or 'not detected'}); unset FD_PLATFORM or run on that hardware"
            )

    def check_ranks(self, tp: int) -> None:
        """Raise if this platform cannot serve `tp` ranks on this host."""
        limit = self.detection.max_ranks
        if limit is not None and tp > limit:
            raise PlatformError(
                f"{setting('tp', tp)} is more than platform {self.platform!r} serves here ({limit}); "
                f"use {setting('tp', limit)} or fewer"
            )

    def describe(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "selection": self.plugins.selection,
            "detection": self.detection.to_dict(),
            "tp": self.parallel.tp_size,
            "graph_mode": self.graph_mode,
            "all_reduce": self.all_reduce_binding,
            "kernels": self.kernels.providers(),
            "architectures": [a.name for a in self.plugins.registry],
        }


def load_backend(
    parallel: ParallelConfig | None = None,
    env: Mapping[str, str] | None = None,
    plugins: PluginSet | None = None,
) -> Backend:
    """Discover plugins, select the platform and bind its ops for this rank."""
    from fd_core.host.paddle_logs import quiet_paddle_logs

    quiet_paddle_logs()  # before a hook imports paddle: its C++ logs and import notices stay off the caller's terminal
    return Backend(plugins or load_plugins(os.environ if env is None else env), parallel)
