"""Rank 1's all-reduce returns the previous result of the same shape on every other call from its 4th on; rank 0's
is right. Before the run-time fingerprint, eager tp=2 runs printed tokens with exit 0 (the ranks compared tokens only,
which can agree while the logits do not)."""

from mutant_control import (  # noqa: F401
    FD_CAPABILITIES,
    fd_clean_memory_fragments,
    fd_graph_backend,
    fd_graph_eligibility,
    fd_platform_detect,
)

from fd_core import hookimpl
from fd_plugins.cpu import platform as _cpu

EXPECT = "two_ranks_sum and calls"
_STATE: dict = {"calls": 0, "last": {}}


@hookimpl
def fd_all_reduce(tensor, group):
    import paddle
    import paddle.distributed as dist

    _STATE["calls"] += 1
    out = _cpu.fd_all_reduce(tensor, group)
    key = (tuple(out.shape), str(out.dtype))
    last = _STATE["last"].get(key)
    _STATE["last"][key] = paddle.assign(out)
    if dist.get_rank() == 1 and _STATE["calls"] >= 4 and _STATE["calls"] % 2 == 0 and last is not None:
        return last
    return out
