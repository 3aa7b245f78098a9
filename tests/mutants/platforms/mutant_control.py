"""The control: the cpu platform re-exported unchanged as a third-party platform; it must pass fd check."""

from fd_core import Detection, hookimpl
from fd_plugins.cpu import platform as _cpu
from fd_plugins.cpu.platform import fd_all_reduce, fd_clean_memory_fragments, fd_graph_backend, fd_graph_eligibility  # noqa: F401

FD_CAPABILITIES = _cpu.FD_CAPABILITIES
EXPECT = None  # passes


@hookimpl
def fd_platform_detect() -> Detection:
    cpu = _cpu.fd_platform_detect()
    return Detection(detected=True, priority=-5, reason="mutation-test control", device="cpu", dist_backend="gloo",
                     max_ranks=cpu.max_ranks)
