"""Names a rendezvous backend paddle.distributed does not have ("mpi")."""

from mutant_control import (  # noqa: F401
    FD_CAPABILITIES,
    fd_all_reduce,
    fd_clean_memory_fragments,
    fd_graph_backend,
    fd_graph_eligibility,
)

from fd_core import Detection, hookimpl

EXPECT = "detection or 1-float32"


@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=-5, reason="emulated", device="cpu", dist_backend="mpi", max_ranks=2)
