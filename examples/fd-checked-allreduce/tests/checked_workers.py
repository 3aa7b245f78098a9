"""What each of two real ranks runs for the tests (importable, as spawned ranks need); returns plain data."""

from __future__ import annotations

import os
from typing import Any


def battery() -> dict[str, Any]:
    """Ranks in step sum; ranks out of step (shape, dtype, a skipped call) raise on every rank, naming both."""
    os.environ["FD_PLATFORM"] = "cpu_checked"
    from fd_core import ModelConfig, ParallelConfig
    from fd_core.host.backend import load_backend
    from fd_core.runtime.ranks.spawn import init_rank

    rank, world = init_rank()
    import paddle
    import paddle.distributed as dist

    backend = load_backend(ParallelConfig(tp_size=world, tp_rank=rank))
    result: dict[str, Any] = {"rank": rank, "platform": backend.platform, "binding": backend.all_reduce_binding}
    result["sum"] = backend.all_reduce(paddle.full([2, 3], float(rank + 1))).numpy().tolist()
    decision = backend.graph_decision(ModelConfig(architecture="probe"))
    result["graph"] = {"allowed": decision.allowed, "summary": decision.summary()}

    def attempt(tensor: Any) -> str:
        try:
            backend.all_reduce(tensor)
            return "no error"
        except RuntimeError as exc:
            return str(exc)

    result["shape"] = attempt(paddle.ones([4] if rank == 0 else [2, 2]))
    result["dtype"] = attempt(paddle.ones([4], dtype="float32" if rank == 0 else "float64"))
    # Rank 1 skips one call: from then on the call numbers differ.
    if rank == 0:
        from fd_checked_allreduce import platform

        platform._CALLS[None] += 1
    result["skipped"] = attempt(paddle.ones([4]))
    dist.barrier()
    return result
