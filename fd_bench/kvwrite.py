"""KV-write row: writing one decode step's keys and values into the paged cache (the write_kv_cache op) at two pool
sizes, ERNIE-4.5-0.3B's layer shape, eager and inside a captured static program; the cost must not grow with the
cache."""

from __future__ import annotations

import statistics
import time
from typing import Any

from fd_bench.report import Line

LENGTHS = (80, 320)  # positions the pool holds
BLOCK_SIZE = 16
# ERNIE-4.5-0.3B at tp=1: 2 kv heads of 128; one decode step writes k and v for each of its 18 layers.
KV_HEADS, HEAD_DIM, LAYERS = 2, 128, 18


def _step(caches: list, new, slot):  # noqa: ANN001, ANN202 - paddle tensors
    """Every layer's k and v written at `slot` [1], as the decode step does."""
    from fd_core import native_ops

    for i in range(0, len(caches), 2):  # to_static has no zip(strict=)
        native_ops.write_kv_cache(new, new, caches[i], caches[i + 1], slot)
    return new


def measure(smoke: bool) -> dict[str, dict[int, float]]:
    """Median microseconds of one step's writes, per mode and pool size, the sizes interleaved."""
    import paddle
    from paddle.static import InputSpec

    from fd_core import native_ops

    paddle.set_device("cpu")
    samples = 30 if smoke else 400
    new = paddle.rand([1, KV_HEADS, HEAD_DIM])
    setups: dict[int, tuple[Any, Any, dict[str, Any]]] = {}
    for length in LENGTHS:
        blocks = length // BLOCK_SIZE
        caches = [c for _ in range(LAYERS) for c in native_ops.allocate_kv_cache(blocks, BLOCK_SIZE, KV_HEADS,
                                                                                 HEAD_DIM, "float32")]
        slot = paddle.to_tensor([length - 2], dtype="int64")
        specs: list[Any] = [[InputSpec(list(c.shape), "float32") for c in caches],
                            InputSpec([1, KV_HEADS, HEAD_DIM], "float32"), InputSpec([1], "int64")]
        static = paddle.jit.to_static(_step, input_spec=specs, full_graph=True)
        setups[length] = (caches, slot, {"eager": _step, "static": static})
    times: dict[str, dict[int, list[int]]] = {m: {n: [] for n in LENGTHS} for m in ("eager", "static")}
    for i in range(samples + 5):
        for length in LENGTHS if i % 2 == 0 else LENGTHS[::-1]:
            caches, slot, fns = setups[length]
            for mode, fn in fns.items():
                start = time.perf_counter_ns()
                fn(caches, new, slot)
                if i >= 5:
                    times[mode][length].append(time.perf_counter_ns() - start)
    return {m: {n: statistics.median(v) / 1000 for n, v in by.items()} for m, by in times.items()}


def kvwrite_rows(smoke: bool) -> list[Line]:
    med = measure(smoke)
    short, long = LENGTHS
    lines = []
    for mode, by in med.items():
        ratio = by[long] / by[short]
        lines.append(Line(
            row="kvwrite", case=f"{mode}, {2 * LAYERS} caches of T positions in blocks of {BLOCK_SIZE}",
            a=f"write at T={long}", b=f"write at T={short}", a_value=by[long], b_value=by[short], unit="us",
            ratio=ratio, ratio_label=f"T={long} / T={short}", target="<= 1.20", met=ratio <= 1.2,
            note=f"the write_kv_cache op at the step's slot into every layer's k and v cache; "
                 f"{'30' if smoke else '400'} steps per size, interleaved"
                 + ("; a static program's call costs a fixed overhead" if mode == "static" else ""),
            details={"us": by},
        ))
    return lines
