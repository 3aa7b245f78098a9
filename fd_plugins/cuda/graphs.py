"""CUDA graph capture through paddle.device.cuda.graphs.CUDAGraph, one graph per key (batch size)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence


@dataclass
class _Captured:
    graph: Any
    static_inputs: list[Any]
    outputs: Any


class CudaGraphBackend:
    """Captures with the given inputs as its buffers; replay copies inputs that are other tensors in and
    returns the static outputs."""

    mode = "cuda_graph"

    def __init__(self) -> None:
        self._graphs: dict[Hashable, _Captured] = {}

    def capture(self, key: Hashable, fn: Callable[..., Any], inputs: Sequence[Any]) -> None:
        from paddle.device.cuda.graphs import CUDAGraph

        # The tensors given at capture are the graph's buffers, by reference, not copies: a decode
        # step writes its KV cache in place, and the caller passes the same cache tensors again.
        static_inputs = list(inputs)
        # One eager run first, so lazily created kernels and workspaces are not captured half-made.
        fn(*static_inputs)
        graph = CUDAGraph()
        graph.capture_begin()
        try:
            outputs = fn(*static_inputs)
        finally:
            graph.capture_end()
        self._graphs[key] = _Captured(graph, static_inputs, outputs)

    def replay(self, key: Hashable, inputs: Sequence[Any]) -> Any:
        import paddle

        captured = self._graphs[key]
        # One input for each captured buffer: a count that differs is an error, not a buffer left stale.
        for static, new in zip(captured.static_inputs, inputs, strict=True):
            if new is not static:
                paddle.assign(new, output=static)
        captured.graph.replay()
        return captured.outputs

    def has(self, key: Hashable) -> bool:
        return key in self._graphs

    def clear(self) -> None:
        for captured in self._graphs.values():
            captured.graph.reset()
        self._graphs.clear()
