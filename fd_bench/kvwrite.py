"""KV-write row: writing one decode step's keys and values into the cache at two cache lengths, ERNIE-4.5-0.3B's
layer shape, eager and inside a captured static program; the cost must not grow with the cache."""

from __future__ import annotations

import statistics
import time
from typing import Any

from fd_bench.report import Line

LENGTHS = (80, 320)
# ERNIE-4.5-0.3B at tp=1: 2 kv heads of 128; one decode step writes k and v for each of its 18 layers.
KV_HEADS, HEAD_DIM, LAYERS = 2, 128, 18


def _step(caches: list, new, position):  # noqa: ANN001, ANN202 - paddle tensors
    """Every layer's k and v written at `position` [1, 1], as the decode step does (one index for all layers)."""
    from fd_models.layers.attention import cache_index, write_cache

    index = cache_index(position, 1, KV_HEADS)
    for cache in caches:
        write_cache(cache, new, index)
    return new


def measure(smoke: bool) -> dict[str, dict[int, float]]:
    """Median microseconds of one step's writes, per mode and cache length, the lengths interleaved."""
    import paddle
    from paddle.static import InputSpec

    paddle.set_device("cpu")
    samples = 30 if smoke else 400
    new = paddle.rand([1, KV_HEADS, 1, HEAD_DIM])
    setups: dict[int, tuple[Any, Any, dict[str, Any]]] = {}
    for length in LENGTHS:
        caches = [paddle.zeros([1, KV_HEADS, length, HEAD_DIM]) for _ in range(2 * LAYERS)]
        position = paddle.to_tensor([[length - 2]], dtype="int64")
        specs: list[Any] = [[InputSpec(list(c.shape), "float32") for c in caches],
                            InputSpec([1, KV_HEADS, 1, HEAD_DIM], "float32"), InputSpec([1, 1], "int64")]
        static = paddle.jit.to_static(_step, input_spec=specs, full_graph=True)
        setups[length] = (caches, position, {"eager": _step, "static": static})
    times: dict[str, dict[int, list[int]]] = {m: {n: [] for n in LENGTHS} for m in ("eager", "static")}
    for i in range(samples + 5):
        for length in LENGTHS if i % 2 == 0 else LENGTHS[::-1]:
            caches, position, fns = setups[length]
            for mode, fn in fns.items():
                start = time.perf_counter_ns()
                fn(caches, new, position)
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
            row="kvwrite", case=f"{mode}, {2 * LAYERS} caches [1, {KV_HEADS}, T, {HEAD_DIM}]",
            a=f"write at T={long}", b=f"write at T={short}", a_value=by[long], b_value=by[short], unit="us",
            ratio=ratio, ratio_label=f"T={long} / T={short}", target="<= 1.20", met=ratio <= 1.2,
            note=f"index_put_ at the step's position into every layer's k and v cache; "
                 f"{'30' if smoke else '400'} steps per length, interleaved"
                 + ("; a static program's call costs a fixed ~0.3 ms here" if mode == "static" else ""),
            details={"us": by},
        ))
    return lines
