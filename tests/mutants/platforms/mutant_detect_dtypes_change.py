"""Detection probes the hardware lazily: the first answer lists float32, later ones (after the probe) bfloat16 first."""

from mutant_control import (  # noqa: F401
    FD_CAPABILITIES,
    fd_all_reduce,
    fd_clean_memory_fragments,
    fd_graph_backend,
    fd_graph_eligibility,
)

from fd_core import Detection, hookimpl

EXPECT = "detection"
_CALLS = [0]


@hookimpl
def fd_platform_detect():
    _CALLS[0] += 1
    dtypes = ("float32",) if _CALLS[0] == 1 else ("bfloat16", "float32")
    return Detection(detected=True, priority=-5, reason="probed lazily", device="cpu", dist_backend="gloo", max_ranks=2,
                     dtypes=dtypes)
