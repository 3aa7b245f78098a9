"""In-process dispatch rows: the bound all-reduce against a direct call, the hook call, a wrapper, tp=1.

Every side is a loop of `n` iterations with ten calls each (loop overhead is spread over ten calls
and is the same on both sides). The collective returns at once, so what is timed is the dispatch.
"""

from __future__ import annotations

import itertools
import os
import time
from types import ModuleType
from typing import Any, Callable

from fd_bench import benchplat, benchtrace
from fd_bench.report import Line
from fd_bench.timing import interleave

UNROLL = 10
perf_counter_ns = time.perf_counter_ns


# One loop body per kind of call; each side gets its own freshly compiled copy (see _loop).
_BODIES = {
    "one": "fn(t)",
    "two": "fn(t, g)",
    "hook": "fn(tensor=t, group=g)",
}
_TEMPLATE = """
def run(n):
    rep = repeat(None, n)
    start = perf_counter_ns()
    for _ in rep:
        {body}
    return perf_counter_ns() - start
"""


def _loop(kind: str, fn: Any, t: Any, g: Any = None) -> Callable[[int], int]:
    """A batch function calling `fn` UNROLL times per iteration, compiled afresh for this side.

    Each side needs its own code object: CPython 3.11 specialises a call site for the function it
    last saw, so two sides sharing one loop would keep un-specialising each other's calls and the
    side that runs second would pay for it.
    """
    body = "; ".join([_BODIES[kind]] * UNROLL)
    namespace: dict[str, Any] = {"repeat": itertools.repeat, "perf_counter_ns": perf_counter_ns,
                                 "fn": fn, "t": t, "g": g}
    exec(compile(_TEMPLATE.format(body=body), f"<fd_bench loop {kind}>", "exec"), namespace)  # noqa: S102 - our own template
    return namespace["run"]


def _calls_1(fn: Callable[[Any], Any], t: Any) -> Callable[[int], int]:
    return _loop("one", fn, t)


def _calls_2(fn: Callable[[Any, Any], Any], t: Any, g: Any) -> Callable[[int], int]:
    return _loop("two", fn, t, g)


def _calls_hook(hook: Any, t: Any, g: Any) -> Callable[[int], int]:
    return _loop("hook", hook, t, g)


def _per_call(sides: dict[str, Callable[[int], int]], iters: int, batches: int) -> dict[str, float]:
    """Median nanoseconds per call of each side (each batch is `iters` x UNROLL calls)."""
    samples = interleave(sides, iters, batches)
    return {k: s.median / UNROLL for k, s in samples.items()}


def _plugins(extensions: tuple[ModuleType, ...] = ()) -> Any:
    from fd_core.host.loading import load_plugins

    env = {k: v for k, v in os.environ.items() if k not in ("FD_PLATFORM",)}
    env["FD_PLATFORM"] = benchplat.NAME
    extra = [("platform", benchplat.NAME, benchplat)] + [("extension", m.NAME, m) for m in extensions]
    return load_plugins(env, extra=extra)


def _tensor() -> Any:
    import paddle

    return paddle.ones([8, 64], dtype="float32")


def dispatch_rows(selected: set[str], smoke: bool) -> list[Line]:
    from fd_core import ParallelConfig
    from fd_core.host.backend import Backend

    iters, batches = (300, 15) if smoke else (2000, 60)
    t, group = _tensor(), object()
    lines: list[Line] = []
    plugins = _plugins()
    backend = Backend(plugins, ParallelConfig(tp_size=2, tp_rank=0, group=group))
    bound = backend.all_reduce
    impl = benchplat.fd_all_reduce
    hook = plugins.pm.hook.fd_all_reduce
    assert bound(t) is t and hook(tensor=t, group=group) is t
    binding = backend.all_reduce_binding
    if "dispatch" in selected or "dispatch_vs_hook" in selected:
        ns = _per_call(
            {"bound": _calls_1(bound, t), "direct": _calls_2(impl, t, group), "hook": _calls_hook(hook, t, group)},
            iters, batches,
        )
        if "dispatch" in selected:
            ratio = ns["bound"] / ns["direct"]
            lines.append(Line(
                row="dispatch", case="tp=2, collective returns at once",
                a="backend.all_reduce(t)", b="impl(t, group)", a_value=ns["bound"], b_value=ns["direct"], unit="ns",
                ratio=ratio, ratio_label="bound / direct", target="<= 1.10", met=ratio <= 1.10,
                note=f"binding: {binding}",
            ))
        if "dispatch_vs_hook" in selected:
            speedup = ns["hook"] / ns["bound"]
            lines.append(Line(
                row="dispatch_vs_hook", case="tp=2, no wrapper",
                a="backend.all_reduce(t)", b="pm.hook.fd_all_reduce(...)",
                a_value=ns["bound"], b_value=ns["hook"], unit="ns",
                ratio=speedup, ratio_label="hook / bound", target=">= 10", met=speedup >= 10,
                note=f"binding: {binding}",
            ))
    if "dispatch_wrapper" in selected:
        wrapped = _plugins((benchtrace,))
        wbackend = Backend(wrapped, ParallelConfig(tp_size=2, tp_rank=0, group=group))
        whook = wrapped.pm.hook.fd_all_reduce
        before = benchtrace.CALLS[0]
        assert wbackend.all_reduce(t) is t and benchtrace.CALLS[0] == before + 1, "the wrapper did not run"
        ns = _per_call({"backend": _calls_1(wbackend.all_reduce, t), "hook": _calls_hook(whook, t, group)},
                       iters, batches)
        ratio = ns["backend"] / ns["hook"]
        lines.append(Line(
            row="dispatch_wrapper", case="tp=2, tracing wrapper (wrapper=True)",
            a="backend.all_reduce(t)", b="pm.hook.fd_all_reduce(...)",
            a_value=ns["backend"], b_value=ns["hook"], unit="ns",
            ratio=ratio, ratio_label="backend / hook", target="<= 1.00 (no slower)", met=ratio <= 1.0,
            note=f"binding: {wbackend.all_reduce_binding}",
        ))
    if "tp1" in selected:
        one = Backend(plugins, ParallelConfig(tp_size=1))

        def returns(tensor: Any) -> Any:
            return tensor

        ns = _per_call({"backend": _calls_1(one.all_reduce, t), "return": _calls_1(returns, t)}, iters, batches)
        ratio = ns["backend"] / ns["return"]
        lines.append(Line(
            row="tp1", case="tp=1",
            a="backend.all_reduce(t)", b="returns(t)", a_value=ns["backend"], b_value=ns["return"], unit="ns",
            ratio=ratio, ratio_label="backend / return", target="<= 1.10", met=ratio <= 1.10,
            note=f"binding: {one.all_reduce_binding}",
        ))
    return lines
