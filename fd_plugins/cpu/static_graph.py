"""Graph capture on the cpu platform: a Paddle static graph (paddle.jit.to_static) per batch size."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence


class StaticGraphBackend:
    """Traces a function into a static program once per key, then replays the program."""

    mode = "static"

    def __init__(self) -> None:
        self._programs: dict[Hashable, Callable[..., Any]] = {}

    def capture(self, key: Hashable, fn: Callable[..., Any], inputs: Sequence[Any]) -> None:
        import paddle
        from paddle.static import InputSpec

        specs = [InputSpec(shape=list(t.shape), dtype=t.dtype) for t in inputs]
        program = paddle.jit.to_static(fn, input_spec=specs, full_graph=True)
        # Trace now so that capture time is paid here, not by the first decode step.
        program(*inputs)
        self._programs[key] = program

    def replay(self, key: Hashable, inputs: Sequence[Any]) -> Any:
        return self._programs[key](*inputs)

    def has(self, key: Hashable) -> bool:
        return key in self._programs

    def clear(self) -> None:
        self._programs.clear()
