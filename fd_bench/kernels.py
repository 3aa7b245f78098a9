"""Kernel rows: a layer's call of a resolved op against a direct call of the same function, and the cpu
platform's fused RMSNorm and complex-number rotary (a decode step's: one position a row) against the native ops at
decode and prefill sizes."""

from __future__ import annotations

import time
import types
from typing import Any, Callable

from fd_bench.report import Line
from fd_bench.timing import interleave

perf_counter_ns = time.perf_counter_ns
UNROLL = 10


def _three(fn: Callable[..., Any], a: Any, b: Any, c: Any) -> Callable[[int], int]:
    """A batch of `n` x UNROLL calls fn(a, b, c)."""

    def run(n: int) -> int:
        start = perf_counter_ns()
        for _ in range(n):
            fn(a, b, c); fn(a, b, c); fn(a, b, c); fn(a, b, c); fn(a, b, c)  # noqa: E702 - unrolled on purpose
            fn(a, b, c); fn(a, b, c); fn(a, b, c); fn(a, b, c); fn(a, b, c)  # noqa: E702
        return perf_counter_ns() - start

    return run


def _calls(fn: Callable[..., Any], *args: Any) -> Callable[[int], int]:
    """A batch of `n` x UNROLL calls fn(*args), for kernels whose own time dwarfs the unpacking."""

    def run(n: int) -> int:
        start = perf_counter_ns()
        for _ in range(n * UNROLL):
            fn(*args)
        return perf_counter_ns() - start

    return run


def kernel_rows(smoke: bool) -> list[Line]:
    import paddle

    from fd_core import hookimpl, native_ops
    from fd_core.host.backend import Backend
    from fd_core.host.loading import load_plugins
    from fd_models.layers.norm import RMSNorm
    from fd_plugins.cpu.kernels import rms_norm as cpu_rms_norm
    from fd_plugins.cpu.kernels import rotary_embedding as cpu_rotary

    lines: list[Line] = []
    # Dispatch: a layer calls the op it fetched from the Backend when it was built. With a kernel that
    # does nothing (an extension registered here), what is timed is the call itself, against a direct
    # call of the same function.
    probe = types.ModuleType("fd_bench_kernel_probe")

    def nothing(x: Any, weight: Any, eps: float) -> Any:
        return x

    @hookimpl
    def fd_register_kernels(register: Callable[..., None]) -> None:
        register("rms_norm", nothing)

    probe.fd_register_kernels = fd_register_kernels  # type: ignore[attr-defined]
    plugins = load_plugins({"FD_PLATFORM": "cpu"}, extra=[("extension", "kernel-probe", probe)])
    backend = Backend(plugins)
    resolved = RMSNorm(8, 1e-6, backend).rms_norm
    iters, batches = (300, 15) if smoke else (3000, 61)
    x, w = paddle.ones([1, 1, 8]), paddle.ones([8])
    ns = {k: s.median / UNROLL for k, s in interleave(
        {"layer": _three(resolved, x, w, 1e-6), "direct": _three(nothing, x, w, 1e-6)}, iters, batches).items()}
    ratio = ns["layer"] / ns["direct"]
    lines.append(Line(
        row="kernels", case="an op as a layer calls it (a kernel doing nothing) vs a direct call",
        a="layer.rms_norm(x, w, eps)", b="kernel(x, w, eps)", a_value=ns["layer"], b_value=ns["direct"], unit="ns",
        ratio=ratio, ratio_label="layer / direct", target="<= 1.10", met=ratio <= 1.10 and resolved is nothing,
        note=f"the layer holds the kernel itself (the same function object): {resolved is nothing}; provider "
             f"{backend.kernels.providers()['rms_norm']}; any difference is this machine's noise",
    ))
    # What the cpu platform's own kernel buys: fused RMSNorm vs the native composition, 0.3B hidden size.
    kiters, kbatches = (50, 9) if smoke else (400, 31)
    for shape in ((1, 1, 1024), (1, 16, 1024)):
        x, w = paddle.randn(list(shape)), paddle.randn([shape[-1]])
        ns = {k: s.median / UNROLL for k, s in interleave(
            {"cpu": _three(cpu_rms_norm, x, w, 1e-6), "native": _three(native_ops.rms_norm, x, w, 1e-6)},
            kiters, kbatches).items()}
        speedup = ns["native"] / ns["cpu"]
        same = bool(paddle.allclose(cpu_rms_norm(x, w, 1e-6), native_ops.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5))
        lines.append(Line(
            row="kernels", case=f"rms_norm x{list(shape)} float32",
            a="cpu kernel (fused)", b="native op", a_value=ns["cpu"] / 1000, b_value=ns["native"] / 1000, unit="us",
            ratio=speedup, ratio_label="native / cpu", target=">= 1.2 (the kernel pays)", met=speedup >= 1.2 and same,
            note=f"results agree within the op's float32 tolerance: {same}",
        ))
    # The fused residual add + RMSNorm against what a layer ran without it: the add, then the cpu platform's norm.
    from fd_plugins.cpu.kernels import add_rms_norm as cpu_add_rms_norm

    def add_then_norm(x: Any, r: Any, w: Any, eps: float) -> tuple[Any, Any]:
        summed = x + r
        return cpu_rms_norm(summed, w, eps), summed

    for shape in ((1, 1, 1024), (1, 16, 1024)):
        x, r, w = paddle.randn(list(shape)), paddle.randn(list(shape)), paddle.randn([shape[-1]])
        ns = {k: s.median / UNROLL for k, s in interleave(
            {"cpu": _calls(cpu_add_rms_norm, x, r, w, 1e-6), "apart": _calls(add_then_norm, x, r, w, 1e-6)},
            kiters, kbatches).items()}
        speedup = ns["apart"] / ns["cpu"]
        # A decode step's one row is where one call instead of two pays; at a prefill's rows the norm's own work
        # dominates, and the fused call must merely not be slower.
        floor = 1.2 if shape[1] == 1 else 0.9
        got, want = cpu_add_rms_norm(x, r, w, 1e-6), native_ops.add_rms_norm(x, r, w, 1e-6)
        same = all(bool(paddle.allclose(g, t, rtol=1e-5, atol=1e-5)) for g, t in zip(got, want, strict=True))
        lines.append(Line(
            row="kernels", case=f"add_rms_norm x{list(shape)} float32",
            a="cpu kernel (one fused call)", b="add, then the cpu rms_norm", a_value=ns["cpu"] / 1000,
            b_value=ns["apart"] / 1000, unit="us", ratio=speedup, ratio_label="apart / cpu",
            target=">= 1.2 (the kernel pays)" if floor > 1 else ">= 0.9 (no slower)", met=speedup >= floor and same,
            note=f"both results agree with the native op within its float32 tolerance: {same}",
        ))
    # The rotary op at a decode step's q of the 0.3B model (16 heads of 128, one position, per-row tables).
    for layout in ("interleaved", "half"):
        x, cos, sin = paddle.randn([1, 16, 1, 128]), paddle.randn([1, 1, 1, 64]), paddle.randn([1, 1, 1, 64])
        ns = {k: s.median / UNROLL for k, s in interleave(
            {"cpu": _calls(cpu_rotary, x, cos, sin, layout),
             "native": _calls(native_ops.rotary_embedding, x, cos, sin, layout)},
            kiters // 4, kbatches).items()}
        speedup = ns["native"] / ns["cpu"]
        same = bool(paddle.allclose(cpu_rotary(x, cos, sin, layout), native_ops.rotary_embedding(x, cos, sin, layout),
                                    rtol=1e-5, atol=1e-5))
        lines.append(Line(
            row="kernels", case=f"rotary_embedding x[1, 16, 1, 128] {layout} float32",
            a="cpu kernel (complex)", b="native op", a_value=ns["cpu"] / 1000, b_value=ns["native"] / 1000, unit="us",
            ratio=speedup, ratio_label="native / cpu", target=">= 1.2 (the kernel pays)", met=speedup >= 1.2 and same,
            note=f"results agree within the op's float32 tolerance: {same}",
        ))
    return lines
