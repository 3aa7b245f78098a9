"""The job of `fd run` on each rank: start the worker from the plan, generate, reload cycles, and the
rank's result (tokens, timings, memory); in this process at tp=1, in spawned or launched ranks above."""

from __future__ import annotations

import time
from typing import Any, Mapping

from fd_core.errors import RankError
from fd_core.host.loading import PluginSet
from fd_core.host.output import fd_stdout
from fd_core.host.paddle_logs import quiet_paddle_logs
from fd_core.runtime import progress
from fd_core.runtime.plan import Plan
from fd_core.runtime.procstats import peak_resident_bytes, resident_bytes
from fd_core.runtime.ranks.spawn import init_rank
from fd_core.runtime.ranks.worker import RankWorker, print_text


def run_rank(
    plan: Plan, rank: int = 0, tp: int = 1, group: Any = None, before: Mapping[str, float] | None = None, plugins: PluginSet | None = None
) -> dict[str, Any]:
    """The whole job on one rank; rank 0's result carries the summary.

    `before` holds phases the caller timed before this (the rendezvous), and their start as "at";
    `plugins`, the planning process's when this rank runs in it.
    """
    run = plan.run
    entered = time.time()
    # What this rank holds before any work of its own: a forked rank shares its parent's imports
    # and holds less than a freshly started process that imported paddle.
    entry_rss = resident_bytes()
    before = dict(before or {})
    started = run.started_at if run.started_at is not None else entered
    worker = RankWorker.start(plan, rank, tp, group, entered=entered, plugins=plugins)
    runner, engine = worker.runner, worker.engine
    # Start-up as phases: process start, imports and the plan up to starting the ranks; starting
    # them; the rendezvous; then plugin discovery and the backend on this rank ("setup").
    rank_start = before.pop("at", entered)
    spawned = run.spawned_at if run.spawned_at is not None else rank_start
    # Before what the rank timed itself, in the order they happened.
    early = {"start": max(0.0, spawned - started)}
    if run.spawned_at is not None:
        early["spawn"] = max(0.0, rank_start - spawned)
    runner.timings = {**early, **before, **runner.timings}
    first = worker.generate(worker.plan.request, print_text if rank == 0 and run.stream else None)
    if rank == 0 and run.stream:
        print(file=fd_stdout(), flush=True)
    first_token_s = (engine.first_token_at or time.time()) - started
    worker.log(f"first token {first_token_s:.2f}s after start")
    cycles = []
    for cycle in range(run.reload_cycles):
        start = time.perf_counter()
        runner.reload()
        again = engine.generate(worker.plan.request)
        same = [c.token_ids for c in again] == [c.token_ids for c in first]
        cycles.append(
            {
                "cycle": cycle + 1,
                "seconds": round(time.perf_counter() - start, 4),
                "rss_bytes": resident_bytes(),
                "tokens_match": same,
            }
        )
        if not same:
            changed = next(i for i, (a, b) in enumerate(zip(again, first, strict=True)) if a.token_ids != b.token_ids)
            raise RankError(
                f"reload cycle {cycle + 1} changed the output of prompt {changed + 1}: {again[changed].token_ids} != {first[changed].token_ids}; "
                f"the cleanup, clear or load hooks do not restore the weights (fd check tests them)"
            )
    model = runner.model
    return {
        **worker.describe(),
        # What the memory target compares the peak with: this rank's parameters and KV cache.
        "weight_bytes": sum(p.numel().item() * p.element_size() for p in model.parameters()),  # type: ignore[union-attr]
        "kv_cache_bytes": getattr(model, "cache_bytes", lambda: 0)(),
        "entry_rss_bytes": entry_rss,
        "tokens": first[0].token_ids,
        "outputs": [c.to_dict() for c in first],
        "tokens_per_s": round(engine.tokens_per_s, 2),
        "time_to_first_token_s": round(first_token_s, 4),
        "decode_core_share": round(engine.decode_core_s / engine.decode_s, 3) if engine.decode_s > 0 else None,
        "decode_step_ms": _step_breakdown(engine),
        "finished_at": time.time(),
        "reload_cycles": cycles,
        "rss_bytes": resident_bytes(),
        "peak_rss_bytes": peak_resident_bytes(),
    }


def _step_breakdown(engine: Any) -> dict[str, float] | None:
    """A decode step's milliseconds: the whole, choosing the token (the non-finite check and sampling), and the model step with the loop around it."""
    if not engine.choose_calls or engine.decode_s <= 0:
        return None
    steps = max(1, engine.choose_calls - 1)  # the first choice (of the prefill's logits) is not decode time
    choose = engine.choose_s * steps / engine.choose_calls
    return {"step": round(engine.decode_s / steps * 1e3, 3), "choose": round(choose / steps * 1e3, 3),
            "model_and_loop": round((engine.decode_s - choose) / steps * 1e3, 3)}


def spawned_rank(plan: Plan, plugins: PluginSet | None = None) -> dict[str, Any]:
    """Entry point of a rank started by paddle.distributed.spawn or launch (`plugins`: under a launcher, the ones it planned with)."""
    quiet_paddle_logs()
    progress.report("rendezvous")
    at = time.time()
    rank, world = init_rank()
    return run_rank(plan, rank, world, before={"at": at, "rendezvous": time.time() - at}, plugins=plugins)
