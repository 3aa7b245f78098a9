"""Above 512 KiB the sum goes through a staging buffer whose last 16 elements are never written (left NaN)."""

from mutant_control import (  # noqa: F401
    FD_CAPABILITIES,
    fd_clean_memory_fragments,
    fd_graph_backend,
    fd_graph_eligibility,
    fd_platform_detect,
)

from fd_core import hookimpl
from fd_plugins.cpu import platform as _cpu

EXPECT = "two_ranks_sum and MiB"


@hookimpl
def fd_all_reduce(tensor, group):
    import paddle

    out = _cpu.fd_all_reduce(tensor, group)
    if out.dtype == paddle.float32 and out.numel().item() * 4 > (512 << 10):
        flat = out.reshape([-1])
        flat[-16:] = float("nan")
        out = flat.reshape(out.shape)
    return out
