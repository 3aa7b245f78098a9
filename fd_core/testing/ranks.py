"""Work the conformance suite runs on every rank of a real multi-process group (spawned, not mocked).

Each all-reduce case is checked on the rank against an oracle computed another way: every rank's
input is regenerated from its seed (the inputs are deterministic per case, rank and call) and summed
with numpy in float64. Ranks write each case's outcome as one JSON line as soon as it is known, so a
run that stops part-way (a hang, a crash) still reports every case that finished, and names the one
it stopped in.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Case:
    """One all-reduce check: `calls` calls in a row of `shape` and `dtype`, fresh values each call.

    `layout` "contiguous", or a non-contiguous view of a larger tensor: "slice" (every other element
    of the last axis) or "transpose" (the first two axes swapped). `rtol` is relative to the sum of the
    inputs' magnitudes, element by element (0: exact).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str = "contiguous"
    calls: int = 1
    rtol: float = 0.0
    in_place: bool = False


def _round_bf16(values: Any) -> Any:
    """float32 values rounded to the nearest bfloat16 (ties to even), still float32: what a bfloat16 tensor holds."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def rank_input(case: Case, rank: int, call: int = 0) -> Any:
    """Rank `rank`'s input for call `call` of `case` as float64 numpy: random, non-integer, exactly representable in
    the dtype."""
    import numpy as np

    seed = zlib.crc32(f"{case.name}/{case.dtype}/{rank}/{call}".encode())
    rng = np.random.default_rng(seed)
    shape = case.shape
    if case.dtype.startswith("int"):
        return rng.integers(-1000, 1000, size=shape).astype(np.float64)
    values = rng.standard_normal(size=shape) * 3.0
    if case.dtype == "bfloat16":
        return _round_bf16(values.astype(np.float32)).astype(np.float64)
    return values.astype(case.dtype).astype(np.float64)


def expected_sum(case: Case, world: int, call: int = 0) -> tuple[Any, Any]:
    """(the exact sum, the sum of magnitudes) of every rank's input, in float64."""
    import numpy as np

    inputs = [rank_input(case, r, call) for r in range(world)]
    return np.sum(inputs, axis=0), np.sum(np.abs(inputs), axis=0)


def _to_numpy(tensor: Any) -> Any:
    import paddle

    if tensor.dtype == paddle.bfloat16:
        tensor = tensor.astype("float32")
    return tensor.numpy().astype("float64")


def _make_tensor(case: Case, values: Any) -> tuple[Any, Any, Any]:
    """(the tensor to reduce, the tensor it is a view of or None, a mask of the base's elements outside the view)."""
    import numpy as np
    import paddle

    def tensor_of(array: Any) -> Any:
        if case.dtype == "bfloat16":
            return paddle.to_tensor(array.astype(np.float32)).astype("bfloat16")
        return paddle.to_tensor(array.astype(case.dtype))

    if case.layout == "contiguous":
        return tensor_of(values), None, None
    if case.layout == "slice":
        # The view is every other element of the last axis of a base twice as wide; the others are a sentinel.
        wide = list(case.shape[:-1]) + [2 * case.shape[-1]]
        base_values = np.full(wide, 7.0)
        base_values[..., ::2] = values
        base = tensor_of(base_values)
        outside = np.ones(wide, dtype=bool)
        outside[..., ::2] = False
        return base[..., ::2], base, outside
    if case.layout == "transpose":
        swapped = (case.shape[1], case.shape[0], *case.shape[2:])
        order = [1, 0, *range(2, len(case.shape))]
        base = tensor_of(np.transpose(values, order).reshape(swapped))
        return base.transpose(order), None, None
    raise ValueError(f"unknown layout {case.layout!r}")


def _mismatch(got: Any, want: Any, scale: Any, rtol: float) -> dict[str, Any] | None:
    """None if every element is within tolerance; else the first element outside it and the largest error."""
    import numpy as np

    error = np.abs(got - want)
    tolerance = rtol * scale
    bad = ~(error <= tolerance)  # NaN counts as outside
    if not bad.any():
        return None
    first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad.reshape(-1))), got.shape))
    finite = np.where(np.isnan(error), np.inf, error)
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(finite.reshape(-1))), got.shape))
    return {
        "index": list(first),
        "got": float(got[first]),
        "want": float(want[first]),
        "tolerance": float(tolerance[first]),
        "wrong": int(bad.sum()),
        "size": int(bad.size),
        "max_error": float(finite[worst]),
        "max_index": list(worst),
    }


def _run_case(backend: Any, case: Case, rank: int, world: int) -> dict[str, Any]:
    """Every call of `case` through the Backend, checked here; the first problem is the case's outcome."""
    import numpy as np

    outcome: dict[str, Any] = {"calls": 0}
    for call in range(case.calls):
        values = rank_input(case, rank, call)
        tensor, base, outside = _make_tensor(case, values)
        base_before = _to_numpy(base) if base is not None else None
        try:
            out = backend.all_reduce(tensor)
        except Exception as exc:  # noqa: BLE001 - the platform's error, reported for this case
            return {**outcome, "call": call, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        outcome["calls"] = call + 1
        where = {"call": call}
        if out is None:
            return {**outcome, **where, "error": "fd_all_reduce returned None"}
        shape, dtype = (
            list(getattr(out, "shape", [])),
            str(getattr(out, "dtype", type(out).__name__)).replace("paddle.", ""),
        )
        if shape != list(case.shape):
            return {**outcome, **where, "problem": f"returned shape {shape}, expected {list(case.shape)}"}
        if dtype != case.dtype:
            return {**outcome, **where, "problem": f"returned dtype {dtype}, expected {case.dtype}"}
        want, scale = expected_sum(case, world, call)
        bad = _mismatch(_to_numpy(out), want, scale, case.rtol)
        if bad is not None:
            return {**outcome, **where, "wrong": bad}
        if case.in_place or out is tensor:
            bad = _mismatch(_to_numpy(tensor), want, scale, case.rtol)
            if bad is not None:
                return {**outcome, **where, "wrong": bad, "in_input": True}
        if base is not None and base_before is not None:
            after = _to_numpy(base)
            changed = outside & ~(after == base_before)
            if changed.any():
                index = [int(i) for i in np.argwhere(changed)[0]]
                return {**outcome, **where, "problem": f"wrote outside the view it was given: element {index} of the "
                        f"tensor it views changed from {base_before[tuple(index)]:g} to {after[tuple(index)]:g}"}
    return outcome


def _own_graph_decision(backend: Any) -> dict[str, Any]:
    """Whether the platform captures graphs here ("allowed", with its "summary"), asked of its own graphs: an
    extension's uncapturable kernel (which refuses --graph on) is not the platform's."""
    from fd_core.config import ModelConfig
    from fd_core.host.backend import Backend
    from fd_core.host.kernel_table import KernelTable

    own = Backend(backend.plugins, backend.parallel, kernels=KernelTable())
    decision = own.graph_decision(ModelConfig(architecture="conformance_probe"), requested="on")
    return {"allowed": decision.allowed, "summary": decision.summary()}


def _graph_case(backend: Any, dtype: Any, rank: int) -> dict[str, Any]:
    """An all-reduce captured inside a graph, replayed, against eager."""
    import paddle

    graph = _own_graph_decision(backend)
    if not graph["allowed"]:
        return graph
    weight = paddle.full([4, 4], float(rank + 1)).astype(dtype)

    def step(x: Any) -> Any:
        return backend.all_reduce(paddle.matmul(x, weight)) * 2

    graphs = backend.graph_backend()
    graphs.capture(2, step, [paddle.ones([2, 4]).astype(dtype)])
    probe = paddle.full([2, 4], 0.5).astype(dtype)
    graph["eager"] = _to_numpy(step(paddle.assign(probe))).tolist()
    graph["replay"] = _to_numpy(graphs.replay(2, [probe])).tolist() if graphs.has(2) else None
    return graph


# The entry of `graph_dtypes` that asks for a model captured at tp=2 with the platform's kernels (its outcome is
# "graph-model"): an all-reduce alone captures, where a kernel's strided output fed to it fails only in a model.
MODEL_GRAPH = "model"


def _model_graph_case(backend: Any) -> dict[str, Any]:
    """A text architecture's tiny preset on this rank's Backend (the platform's kernels), its decode step captured
    (graph "on") and replayed: its greedy tokens against the same model eager."""
    from fd_core.error_lines import error_line
    from fd_core.runtime.engine.loop import Engine
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for
    from fd_core.runtime.request import Request

    outcome = _own_graph_decision(backend)
    arch = next((a for a in backend.plugins.registry if a.graph_capable and not a.multimodal), None)
    if not outcome["allowed"] or arch is None:
        return outcome
    outcome["architecture"] = arch.name
    request = Request.greedy([[5, 1, 4, 2, 3]], 4)

    def tokens(graph: str) -> list[int]:
        runner = ModelRunner(backend, arch, model_config_for(arch, None), graph=graph)
        runner.load()
        runner.decide()
        return Engine(runner, max_batch=2).generate(request)[0].token_ids

    outcome["eager"] = tokens("off")
    try:
        outcome["captured"] = tokens("on")
    except Exception as exc:  # noqa: BLE001 - the capture's or the replay's error, for this check
        outcome["error"] = error_line(exc)
    return outcome


def all_reduce_on_rank(
    platform: str, cases: Sequence[Case], graph_dtypes: Sequence[str], out_dir: str
) -> dict[str, Any]:
    """On one rank: every case through the Backend, then an all-reduce inside a captured graph per dtype.

    Each outcome is appended to `out_dir`/rank<r>.jsonl when it is known (a "start" line before each),
    so a run that stops part-way still tells what finished and where it stopped.
    """
    os.environ["FD_PLATFORM"] = platform
    from fd_core.config import ParallelConfig
    from fd_core.host.backend import load_backend
    from fd_core.runtime import progress
    from fd_core.runtime.ranks.spawn import init_rank

    rank, world = init_rank()
    backend = load_backend(ParallelConfig(tp_size=world, tp_rank=rank))
    with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a") as log:

        def note(entry: dict[str, Any]) -> None:
            log.write(json.dumps(entry) + "\n")
            log.flush()

        for case in cases:
            progress.report(f"all-reduce {case.name}")
            note({"start": case.name})
            note({"case": case.name, **_run_case(backend, case, rank, world)})
        for dtype in graph_dtypes:
            name = f"graph-{dtype}"
            model = dtype == MODEL_GRAPH
            progress.report("a model captured at tp=2" if model else f"all-reduce inside a captured graph ({dtype})")
            note({"start": name})
            try:
                outcome = _model_graph_case(backend) if model else _graph_case(backend, dtype, rank)
            except Exception as exc:  # noqa: BLE001 - the vote's, the capture's or the replay's error, for this check
                from fd_core.error_lines import error_line

                outcome = {"error": error_line(exc)}
            note({"case": name, **outcome})
    return {"rank": rank, "world": world}
