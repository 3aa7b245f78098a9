"""Work the conformance suite runs on every rank of a real multi-process group (spawned, not mocked)."""

from __future__ import annotations

import os
from typing import Any, Sequence

# (shape, dtype) pairs; a zero-size tensor is part of the contract.
Case = tuple[tuple[int, ...], str]


def rank_value(shape: tuple[int, ...], dtype: str, rank: int) -> Any:
    """The numpy input rank `rank` contributes: distinct per rank and per element, exact in every dtype."""
    import numpy as np

    count = int(np.prod(shape)) if shape else 1
    base = (np.arange(count) % 7 + 1).reshape(shape)
    return (base * (rank + 1) + rank).astype("float32" if dtype == "bfloat16" else dtype)


def expected_sum(shape: tuple[int, ...], dtype: str, world: int) -> Any:
    import numpy as np

    total = sum(rank_value(shape, dtype, r).astype("float64") for r in range(world))
    return np.asarray(total, dtype="float64").reshape(shape)


def _to_numpy(tensor: Any) -> Any:
    import paddle

    if tensor.dtype == paddle.bfloat16:
        tensor = tensor.astype("float32")
    return tensor.numpy().astype("float64")


def all_reduce_on_rank(platform: str, cases: Sequence[Case], with_graph: bool) -> dict[str, Any]:
    """On one rank: all-reduce every case through the Backend, and once inside a captured graph."""
    os.environ["FD_PLATFORM"] = platform
    from fd_core.backend import load_backend
    from fd_core.config import ModelConfig, ParallelConfig
    from fd_core.runtime.distributed import init_rank

    rank, world = init_rank()
    import paddle

    backend = load_backend(ParallelConfig(tp_size=world, tp_rank=rank))
    results: list[dict[str, Any]] = []
    for shape, dtype in cases:
        tensor = paddle.to_tensor(rank_value(shape, dtype, rank)).astype(dtype)  # type: ignore[arg-type]
        try:
            out = backend.all_reduce(tensor)
        except Exception as exc:  # noqa: BLE001 - reported per case to the test
            results.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        if out is None:
            results.append({"error": "fd_all_reduce returned None"})
            continue
        results.append(
            {
                "value": _to_numpy(out).tolist(),
                "shape": list(out.shape),
                "dtype": str(out.dtype).replace("paddle.", ""),
                "same_object": out is tensor,
                "input_after": _to_numpy(tensor).tolist(),
            }
        )
    graph: dict[str, Any] | None = None
    if with_graph:
        decision = backend.graph_decision(ModelConfig(architecture="conformance_probe"), requested="on")
        graph = {"allowed": decision.allowed, "summary": decision.summary()}
        if decision.allowed:
            weight = paddle.full([4, 4], float(rank + 1))

            def step(x: Any) -> Any:
                return backend.all_reduce(paddle.matmul(x, weight)) * 2

            graphs = backend.graph_backend()
            example = paddle.ones([2, 4])
            graphs.capture(2, step, [example])
            probe = paddle.full([2, 4], 0.5)
            graph["eager"] = step(paddle.assign(probe)).numpy().tolist()
            graph["replay"] = graphs.replay(2, [probe]).numpy().tolist() if graphs.has(2) else None
    return {"rank": rank, "world": world, "results": results, "graph": graph}
