"""The Backend: hot-path ops bound once at build time, the graph decision, cleanup and graph clear."""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any, Callable, Mapping

from fd_core.config import ModelConfig, ParallelConfig
from fd_core.detection import Detection
from fd_core.errors import PlatformError, PluginError
from fd_core.graphs import CastVote, GraphBackend, GraphDecision, GraphVote
from fd_core.plugins import PluginSet, load_plugins

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
    if argnames == ("tensor", "group") and isinstance(fn, types.FunctionType) and fn.__code__.co_argcount == 2 and not fn.__defaults__:
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


class Backend:
    """The active platform's ops for one rank; build it with `load_backend()`."""

    all_reduce: AllReduce

    def __init__(self, plugins: PluginSet, parallel: ParallelConfig | None = None) -> None:
        self.plugins = plugins
        self.parallel = parallel or ParallelConfig()
        self.platform: str = plugins.platform
        self.detection: Detection = plugins.detection
        self.all_reduce, self.all_reduce_binding = self._bind_all_reduce()

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
            # pluggy's own call path, with what HookCaller.__call__ redoes on every call (argument
            # checks, copying the implementation list) done once here: wrappers still see every call.
            hookexec, name, frozen = self.plugins.pm._hookexec, caller.name, tuple(impls)

            def through_hook(tensor: Any) -> Any:
                return hookexec(name, frozen, {"tensor": tensor, "group": group}, True)

            return through_hook, f"hook call (wrapped by {', '.join(wrappers)})"
        # pluggy calls the last of get_hookimpls() first.
        ordered = list(reversed(impls))
        if not ordered:
            raise PluginError(f"platform {self.platform!r} implements no fd_all_reduce; tp={self.parallel.tp_size} needs one")
        bound = [_bind(i.function, tuple(i.argnames), group) for i in ordered]
        names = [i.plugin_name for i in ordered]
        if len(bound) == 1:
            return bound[0], f"direct: {names[0]}.{ordered[0].function.__name__}"
        return _chain(bound, names), f"first result of {', '.join(names)}"

    def clean_memory_fragments(self, state_dict: Mapping[str, Any] | None = None) -> None:
        """Run every implementation: the platform's and any model package's."""
        self.hook.fd_clean_memory_fragments(state_dict=state_dict)

    def graph_decision(
        self, model_config: ModelConfig, parallel_config: ParallelConfig | None = None, requested: str = "auto"
    ) -> GraphDecision:
        """Ask every plugin; any veto wins (an advisory no-gain vote too, unless `requested` is "on"); every answer is kept."""
        parallel_config = parallel_config or self.parallel
        mode = self.graph_mode
        votes: list[CastVote] = []
        registry = self.plugins.registry
        if model_config.architecture in registry:
            arch = registry.get(model_config.architecture)
            if not arch.graph_capable:
                votes.append(CastVote(arch.package, False, f"{arch.name} is registered as not graph-capable"))
        args = {"model_config": model_config, "parallel_config": parallel_config, "graph_mode": mode or ""}
        for impl in reversed(self.hook.fd_graph_eligibility.get_hookimpls()):
            name = impl.plugin_name
            try:
                answer = impl.function(*[args[a] for a in impl.argnames])
            except Exception as exc:  # noqa: BLE001 - a voter that raises vetoes, with its error as reason
                votes.append(CastVote(name, False, f"fd_graph_eligibility raised {type(exc).__name__}: {exc}"))
                continue
            if answer is None:
                continue
            if not isinstance(answer, GraphVote):
                raise PluginError(f"plugin {name!r}: fd_graph_eligibility returned {type(answer).__name__}; return fd_core.GraphVote or None")
            if not answer.allow and not answer.reason.strip():
                raise PluginError(f"plugin {name!r}: fd_graph_eligibility vetoed without a reason; return GraphVote.veto('why')")
            votes.append(CastVote(name, answer.allow, answer.reason, answer.advisory and not answer.allow))
        decision = GraphDecision(allowed=False, mode=mode, votes=tuple(votes), requested=requested)
        allowed = requested != "off" and mode is not None and not decision.vetoes
        return dataclasses.replace(decision, allowed=allowed)

    @property
    def graph_mode(self) -> str | None:
        """The kind of graph the platform captures (its graph backend's `mode`), None if none."""
        backend = self.hook.fd_graph_backend(parallel_config=self.parallel)
        return getattr(backend, "mode", None) if backend is not None else None

    def graph_backend(self) -> GraphBackend:
        """A new capture / replay / clear object from the platform."""
        backend = self.hook.fd_graph_backend(parallel_config=self.parallel)
        if backend is None:
            raise PlatformError(f"platform {self.platform!r} returned no graph backend; use --graph off")
        return backend

    def clear_graphs(self, model: Any) -> None:
        """Drop the model's captured graphs through its package's fd_clear_graphs hook."""
        handled = self.hook.fd_clear_graphs(model=model)
        if not handled:
            raise PluginError(
                f"no fd_clear_graphs implementation handled {type(model).__name__}; "
                f"its model package must implement fd_clear_graphs(model) and return True"
            )

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
            raise PlatformError(f"--tp {tp} is more than platform {self.platform!r} serves here ({limit}); use --tp {limit} or fewer")

    def describe(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "selection": self.plugins.selection,
            "detection": self.detection.to_dict(),
            "tp": self.parallel.tp_size,
            "graph_mode": self.graph_mode,
            "all_reduce": self.all_reduce_binding,
            "architectures": [a.name for a in self.plugins.registry],
        }


def load_backend(
    parallel: ParallelConfig | None = None,
    env: Mapping[str, str] | None = None,
    plugins: PluginSet | None = None,
) -> Backend:
    """Discover plugins, select the platform and bind its ops for this rank."""
    return Backend(plugins or load_plugins(os.environ if env is None else env), parallel)
