"""Graph row: the tiny ERNIE-4.5 decode step replayed as a Paddle static graph vs run eagerly, tp=1, cpu platform."""

from __future__ import annotations

import os
import statistics
import time

from fd_bench.report import Line


def graph_rows(smoke: bool) -> list[Line]:
    import numpy as np

    from fd_bench.ranks import at, decode_setup, seeded_model, table_width
    from fd_core import ParallelConfig
    from fd_core.host.backend import load_backend

    env = dict(os.environ)
    env["FD_PLATFORM"] = "cpu"
    backend = load_backend(ParallelConfig(), env=env)
    arch, config, prompt, steps, samples, warm, max_len = decode_setup(backend, smoke)
    models = {"static": seeded_model(arch, config, backend, 0, 1, max_len),
              "eager": seeded_model(arch, config, backend, 0, 1, max_len)}
    start = time.perf_counter()
    models["static"].capture(backend.graph_backend(), 1, table_width(max_len))
    capture_s = time.perf_counter() - start
    first = {n: m.prefill(prompt, None, at(0, prompt.shape[1], max_len)).numpy() for n, m in models.items()}
    token = np.asarray([[int(first["eager"].argmax())]], dtype="int64")
    # Step by step, alternating (the order flips each pair), as the decode row does.
    times: dict[str, list[int]] = {n: [] for n in models}
    names = list(models)
    for i in range(warm + samples):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter_ns()
            models[name].decode_step(token, at(prompt.shape[1] + i % steps, 1, max_len)).numpy()
            if i >= warm:
                times[name].append(time.perf_counter_ns() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    # The same weights, token and position on both sides: one more step each must agree.
    pos = prompt.shape[1]
    close = bool(np.allclose(models["static"].decode_step(token, at(pos, 1, max_len)).numpy(),
                             models["eager"].decode_step(token, at(pos, 1, max_len)).numpy(), atol=1e-4))
    return [Line(
        row="graph", case="tp=1 (one rank: no all-reduce)", a="static graph replay", b="eager",
        a_value=med["static"] / 1000, b_value=med["eager"] / 1000, unit="us",
        ratio=med["eager"] / med["static"], ratio_label="eager / static", target="reported", met=None,
        note=(f"medians of {samples} steps per side, alternating step by step; static graph "
              f"{'faster' if med['static'] < med['eager'] else 'slower'}; "
              f"capture took {capture_s:.2f} s; last logits agree: {close}"),
        details={"capture_s": capture_s, "steps_per_side": samples, "logits_agree": close,
                 "p10_us": {n: statistics.quantiles(v, n=10)[0] / 1000 for n, v in times.items()}},
    )]
