"""What each of two real gloo ranks runs for the tp=2 rows (importable: spawned ranks import it by name).

`run_rank(tasks, smoke)` joins the process group once and runs every requested task in order; all ranks
make the same calls in the same order, as collectives require. Each task returns plain data.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

perf_counter_ns = time.perf_counter_ns

SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20)
CALLS_FULL = {1 << 10: 400, 64 << 10: 400, 1 << 20: 300, 16 << 20: 100}
CALLS_SMOKE = {1 << 10: 40, 64 << 10: 40, 1 << 20: 10, 16 << 20: 4}
# From this size on, gloo is also timed against itself (an A/A control): the noise band of the run.
CONTROL_FROM = 1 << 20


class DirectCtx:
    """The benchmark-only copy of the model's context: all-reduce wired straight to paddle.distributed."""

    def __init__(self, parallel: Any) -> None:
        import paddle.distributed as dist

        self.parallel = parallel
        group = parallel.group
        dist_all_reduce = dist.all_reduce

        def all_reduce(tensor: Any) -> Any:
            dist_all_reduce(tensor, group=group)
            return tensor

        self.all_reduce = all_reduce


def _backend(platform: str, rank: int, world: int) -> Any:
    from fd_core import ParallelConfig
    from fd_core.host.backend import load_backend

    env = dict(os.environ)
    env["FD_PLATFORM"] = platform
    return load_backend(ParallelConfig(tp_size=world, tp_rank=rank), env=env)


def seeded_model(arch: Any, config: Any, ctx: Any, rank: int, world: int, max_len: int) -> Any:
    from fd_core.runtime.engine.runner import init_std
    from fd_core.runtime.weights import random_state_dict

    model = arch.build(config, ctx)
    model.load_weights(random_state_dict(model.weight_specs(), 0, rank, world, init_std(config)))
    model.allocate_kv_cache(1 + table_width(max_len), BLOCK_SIZE)
    return model


BLOCK_SIZE = 16


def table_width(max_len: int) -> int:
    """Blocks of one sequence of `max_len` positions (the benchmark's one row owns blocks 1 onward)."""
    return -(-max_len // BLOCK_SIZE)


def at(position: int, length: int, max_len: int) -> Any:
    """The KVBatch of one row's `length` new tokens from `position` in its own blocks."""
    from fd_core.kvcache import KVBatch

    return KVBatch.contiguous(1, position, length, BLOCK_SIZE, table_width(max_len))


def decode_setup(backend: Any, smoke: bool) -> tuple[Any, Any, Any, int, int, int, int]:
    """The tiny ERNIE-4.5 decode benchmark's setting: architecture, config, prompt, steps, samples, warm-up,
    cache length."""
    import numpy as np

    from fd_core.runtime.plan import model_config_for

    arch = backend.plugins.registry.get("ernie4_5")
    config = model_config_for(arch, None)
    prompt = np.asarray([[1, 2, 3, 4]], dtype="int64")
    steps = 20  # positions cycle through the cache's 20 decode slots
    samples, warm = (40, 6) if smoke else (800, 20)
    return arch, config, prompt, steps, samples, warm, prompt.shape[1] + steps


def decode(rank: int, world: int, smoke: bool, modes: tuple[str, ...] = ("eager", "static")) -> dict[str, Any]:
    """ERNIE-4.5 tiny decode step: fd_core's Backend (cpu platform) vs the DirectCtx copy, alternating step by step.

    One model instance serves both sides: between steps its layers' `ctx` is switched between the
    Backend and DirectCtx (static mode: between the two captured graphs), so both sides run on the
    same weights, caches and memory. Two separate instances with identical wiring differed from each
    other by far more than a 2% target on the machine docs/benchmarks.md describes, which would drown it.
    """
    import numpy as np

    from fd_plugins.cpu.static_graph import forget_traces

    backend = _backend("cpu", rank, world)
    arch, config, prompt, steps, samples, warm, max_len = decode_setup(backend, smoke)
    direct = DirectCtx(backend.parallel)
    out: dict[str, Any] = {"binding": backend.all_reduce_binding, "steps_per_side": samples}
    for mode in modes:
        model = seeded_model(arch, config, backend, rank, world, max_len)
        holders = [layer for layer in (model, *model.sublayers()) if getattr(layer, "ctx", None) is backend]
        # fd_control is the fd wiring again (its own graph in static mode): an A/A control whose gap
        # to fd is the noise band of this run.
        ctxs = {"fd": backend, "direct": direct, "fd_control": backend}
        graphs: dict[str, Any] = {}

        def wire(
            name: str, holders: list[Any] = holders, ctxs: dict[str, Any] = ctxs, graphs: dict[str, Any] = graphs,
            model: Any = model,
        ) -> None:
            for layer in holders:
                layer.ctx = ctxs[name]
            if name in graphs:
                model.use_graphs(graphs[name])

        try:
            if mode == "static":
                for name in ctxs:
                    wire(name)
                    # The cpu static-graph backend keeps one traced program per function and shapes
                    # (on the function): dropped here, so that each side traces its own all-reduce.
                    forget_traces(model.decode_fn)
                    model.capture(backend.graph_backend(), 1, table_width(max_len))
                    graphs[name] = model.graphs
        except Exception as exc:  # noqa: BLE001 - reported in the row, the eager numbers stand
            out[mode] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        wire("fd")
        first = model.prefill(prompt, None, at(0, prompt.shape[1], max_len)).numpy()
        token = np.asarray([[int(first.argmax())]], dtype="int64")
        # Step by step: the sides take turns every decode step (the order rotates and flips), so the noise of
        # a shared machine (a peer rank descheduled for a time slice) falls on both sides alike.
        times: dict[str, list[int]] = {n: [] for n in ctxs}
        names = list(ctxs)
        for i in range(warm + samples):
            for name in names[i % 3:] + names[: i % 3] if i % 2 == 0 else (names[i % 3:] + names[: i % 3])[::-1]:
                wire(name)
                start = perf_counter_ns()
                # the logits are used, as a sampler would
                model.decode_step(token, at(prompt.shape[1] + i % steps, 1, max_len)).numpy()
                if i >= warm:
                    times[name].append(perf_counter_ns() - start)
        # Both wirings compute the same step: the same position and token on the same cache.
        check = {}
        for name in ("fd", "direct"):
            wire(name)
            check[name] = model.decode_step(token, at(prompt.shape[1], 1, max_len)).numpy()
        out[mode] = {
            "fd_step_ns": statistics.median(times["fd"]),
            "direct_step_ns": statistics.median(times["direct"]),
            "fd_control_step_ns": statistics.median(times["fd_control"]),
            "fd_p10_ns": statistics.quantiles(times["fd"], n=10)[0],
            "direct_p10_ns": statistics.quantiles(times["direct"], n=10)[0],
            "same_logits": bool(np.array_equal(check["fd"], check["direct"])),
            "rewired_layers": len(holders),
            "captured": bool(graphs),
        }
    return out


def allreduce(rank: int, world: int, smoke: bool) -> dict[str, Any]:
    """The cpu platform's Backend all-reduce (shared memory) vs its gloo path, call by call,
    ranks lined up before each call."""
    import paddle

    from fd_plugins.cpu.platform import gloo_all_reduce

    cpu = _backend("cpu", rank, world)
    group = cpu.parallel.group
    sides = {"gloo": lambda t: gloo_all_reduce(t, group), "shm": cpu.all_reduce}
    # Lining the ranks up before each timed call keeps the skew one call leaves from being charged to the next.
    align_t = paddle.zeros([1], dtype="float32")
    align = cpu.all_reduce
    calls = CALLS_SMOKE if smoke else CALLS_FULL
    out: dict[str, Any] = {"bindings": {"shm": cpu.all_reduce_binding}, "shm_missing": None, "sizes": {}}
    for nbytes in SIZES:
        tensor = paddle.zeros([nbytes // 4], dtype="float32")
        for fn in sides.values():
            for _ in range(3):
                fn(tensor)
        timed = dict(sides)
        if nbytes >= CONTROL_FROM:
            timed["gloo_control"] = sides["gloo"]
        times: dict[str, list[int]] = {n: [] for n in timed}
        order = list(timed)
        for i in range(calls[nbytes]):
            for name in order if i % 2 == 0 else reversed(order):
                align(align_t)
                fn = timed[name]
                start = perf_counter_ns()
                fn(tensor)
                times[name].append(perf_counter_ns() - start)
        out["sizes"][nbytes] = {n: statistics.median(v) for n, v in times.items()} | {"calls": calls[nbytes]}
    from fd_plugins.cpu.shm import group_state

    state = group_state(group)
    out["shm_state"] = (
        {"usable": state.usable, "slot_bytes": state.slot_bytes, "calls": dict(state.calls)} if state else None
    )
    return out


TASKS: dict[str, Callable[..., dict[str, Any]]] = {"decode": decode, "allreduce": allreduce}


def run_rank(tasks: tuple[str, ...], smoke: bool) -> dict[str, Any]:
    """Entry point of a spawned rank."""
    from fd_core.host.paddle_logs import quiet_paddle_logs
    from fd_core.runtime.ranks.spawn import init_rank

    quiet_paddle_logs()
    rank, world = init_rank()
    return {"rank": rank, **{t: TASKS[t](rank, world, smoke) for t in tasks}}
