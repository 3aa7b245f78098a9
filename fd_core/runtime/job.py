"""`fd run`'s job, through a session: the plan's request generated, reload cycles that must give the same
tokens, and every rank's report (rank 0's with the outputs, the cycles and the wall time)."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Literal

from fd_core.errors import RankError
from fd_core.host.backend import Backend
from fd_core.host.loading import PluginSet
from fd_core.runtime.plan import Plan
from fd_core.runtime.procstats import resident_bytes
from fd_core.runtime.ranks.spawn import DEFAULT_STALL_S
from fd_core.runtime.session import Session


def run_plan(
    plan: Plan, plugins: PluginSet, *, backend: Backend | None = None,
    on_text: Callable[[int, str], None] | None = None, rank_timeout: float = 30.0,
    stall_timeout: float = DEFAULT_STALL_S, start_method: Literal["spawn", "fork"] = "spawn",
) -> list[dict[str, Any]]:
    """Run `plan` (its request, then `plan.run.reload_cycles` weight updates, each checked to give the same tokens);
    each rank's report in rank order (under a launcher, this process's rank only).

    Rank 0's report carries the outputs, the tokens of the first prompt, the reload cycles, the wall time from the
    run's start and, after spawned ranks, their teardown as a phase. Ctrl-C and stop signals stop every rank before
    they propagate.
    """
    run = plan.run

    def log(message: str) -> None:
        if run.progress and (session.launched is None or session.launched[0] == 0):
            print(f"fd: {message}", file=sys.stderr, flush=True)

    with Session(plan, plugins, backend=backend, rank_timeout=rank_timeout, stall_timeout=stall_timeout,
                 start_method=start_method) as session:
        log(f"generating for {len(plan.request.prompts)} prompt(s)")
        first = session.generate(plan.request, on_text)
        # The request's speed, before any reload cycle generates again (the report says this one, as the log does).
        speed = None
        if run.progress or run.reload_cycles:
            head = session.reports()[0]
            speed = head["tokens_per_s"]
            log(f"generated {sum(len(c.token_ids) for c in first)} tokens at {speed:.1f} tokens/s")
            log(f"first token {head['time_to_first_token_s']:.2f}s after start")
        cycles = []
        for cycle in range(run.reload_cycles):
            start = time.perf_counter()
            session.reload()
            again = session.generate(plan.request)
            same = [c.token_ids for c in again] == [c.token_ids for c in first]
            cycles.append({"cycle": cycle + 1, "seconds": round(time.perf_counter() - start, 4),
                           "rss_bytes": resident_bytes(), "tokens_match": same})
            if not same:
                changed = next(
                    i for i, (a, b) in enumerate(zip(again, first, strict=True)) if a.token_ids != b.token_ids
                )
                raise RankError(
                    f"reload cycle {cycle + 1} changed the output of prompt {changed + 1}: "
                    f"{again[changed].token_ids} != {first[changed].token_ids}; the cleanup, clear or load hooks do "
                    f"not restore the weights (fd check tests them)"
                )
        reports = session.reports()
    head = reports[0]
    head.update({"tokens": first[0].token_ids, "outputs": [c.to_dict() for c in first], "reload_cycles": cycles})
    if speed is not None:
        head["tokens_per_s"] = speed
    _add_wall_time(head, run.started_at)
    return reports


def _add_wall_time(report: dict[str, Any], started_at: float | None) -> None:
    """Rank 0's report gains the wall time so far and, after spawned ranks, their teardown as a phase."""
    now = time.time()
    finished = report.pop("finished_at", now)
    if started_at is None:
        return
    if now - finished > 1e-3:
        report["timings_s"]["teardown"] = round(now - finished, 4)
    report["wall_s"] = round(now - started_at, 4)
