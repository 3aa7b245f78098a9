"""A ring of result buffers whose index wraps wrongly after 128 calls: from then on every other call
returns the previous result."""

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
_STATE = {"calls": 0, "last": None}


@hookimpl
def fd_all_reduce(tensor, group):
    import paddle

    _STATE["calls"] += 1
    out = _cpu.fd_all_reduce(tensor, group)
    last = _STATE["last"]
    _STATE["last"] = paddle.assign(out)
    if (_STATE["calls"] > 128 and _STATE["calls"] % 2 == 0 and last is not None and last.shape == out.shape
            and last.dtype == out.dtype):
        return last
    return out
