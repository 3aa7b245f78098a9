"""Sums 16-bit floats in float32 and returns the float32 sum, not a tensor of the input's dtype."""

from mutant_control import (  # noqa: F401
    FD_CAPABILITIES,
    fd_clean_memory_fragments,
    fd_graph_backend,
    fd_graph_eligibility,
    fd_platform_detect,
)

from fd_core import hookimpl
from fd_plugins.cpu import platform as _cpu

EXPECT = "two_ranks_sum and (float16 or bfloat16)"


@hookimpl
def fd_all_reduce(tensor, group):
    import paddle

    if tensor.dtype in (paddle.float16, paddle.bfloat16) and 0 not in tensor.shape:
        return _cpu.fd_all_reduce(tensor.astype("float32"), group)
    return _cpu.fd_all_reduce(tensor, group)
