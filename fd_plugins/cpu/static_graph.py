"""Graph capture on the cpu platform: a Paddle static graph (paddle.jit.to_static) per batch size."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

# Where a function's traced programs are kept: on the object the function belongs to, so they live
# exactly as long as the model does.
_CACHE_ATTR = "_fd_static_programs"


def _trace(fn: Callable[..., Any], specs: list[Any]) -> Callable[..., Any]:
    """paddle.jit.to_static(fn), reusing the program already traced for this function and input specs.

    Paddle keeps every traced program alive (about 1.5 MiB per trace of the tiny decode step, never
    freed), so re-tracing on each capture after a weight reload grows memory without bound. A program
    reads the parameters when it runs, so a reused one sees reloaded weights.
    """
    import paddle

    owner = getattr(fn, "__self__", fn)
    key = (getattr(fn, "__func__", fn), tuple((tuple(s.shape), str(s.dtype)) for s in specs))
    cache = vars(owner).setdefault(_CACHE_ATTR, {}) if hasattr(owner, "__dict__") else {}
    if key not in cache:
        cache[key] = paddle.jit.to_static(fn, input_spec=specs, full_graph=True)
    return cache[key]


def forget_traces(fn: Callable[..., Any]) -> None:
    """Drop the programs traced for `fn`'s owner, so that the next capture traces again (a benchmark
    that rewires a model between captures needs each wiring's own program)."""
    owner = getattr(fn, "__self__", fn)
    if hasattr(owner, "__dict__"):
        vars(owner).pop(_CACHE_ATTR, None)


class StaticGraphBackend:
    """Traces a function into a static program once per key, then replays the program."""

    mode = "static"

    def __init__(self) -> None:
        self._programs: dict[Hashable, Callable[..., Any]] = {}

    def capture(self, key: Hashable, fn: Callable[..., Any], inputs: Sequence[Any]) -> None:
        from paddle.static import InputSpec

        specs = [InputSpec(shape=list(t.shape), dtype=t.dtype) for t in inputs]
        program = _trace(fn, specs)
        # Trace now so that capture time is paid here, not by the first decode step.
        program(*inputs)
        self._programs[key] = program

    def replay(self, key: Hashable, inputs: Sequence[Any]) -> Any:
        return self._programs[key](*inputs)

    def has(self, key: Hashable) -> bool:
        return key in self._programs

    def clear(self) -> None:
        self._programs.clear()
