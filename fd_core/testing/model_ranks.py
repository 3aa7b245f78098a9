"""Work the model suite runs on every rank of a real two-rank group: `fd run`'s own job per plan."""

from __future__ import annotations

from typing import Any, Sequence

from fd_core.runtime.plan import Plan


def runs_on_rank(plans: Sequence[Plan]) -> list[dict[str, Any]]:
    """On one spawned rank: `run_rank` (what `fd run` runs on a rank) for each plan, in order."""
    from fd_core.host.paddle_logs import quiet_paddle_logs
    from fd_core.runtime.ranks.launch import run_rank
    from fd_core.runtime.ranks.spawn import init_rank

    quiet_paddle_logs()
    rank, world = init_rank()
    out = []
    for plan in plans:
        result = run_rank(plan, rank, world)
        out.append({"rank": rank, "tokens": result["tokens"], "graph": result["graph"]})
    return out
