"""Sums in chunks of 65536 elements and forgets the tail after the last full chunk (an off-by-one in a chunked ring)."""

from mutant_control import (  # noqa: F401
    FD_CAPABILITIES,
    fd_clean_memory_fragments,
    fd_graph_backend,
    fd_graph_eligibility,
    fd_platform_detect,
)

from fd_core import hookimpl
from fd_plugins.cpu import platform as _cpu

EXPECT = "two_ranks_sum and float32"
CHUNK = 65536


@hookimpl
def fd_all_reduce(tensor, group):
    n = tensor.numel().item() if len(tensor.shape) else 1
    if n <= CHUNK or n % CHUNK == 0:
        return _cpu.fd_all_reduce(tensor, group)
    import paddle

    flat = tensor.reshape([-1])
    full = n - n % CHUNK
    head = _cpu.fd_all_reduce(flat[:full].contiguous(), group)
    return paddle.concat([head, flat[full:]]).reshape(tensor.shape)  # the tail keeps this rank's own values
