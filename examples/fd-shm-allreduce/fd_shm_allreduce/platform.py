"""Hook implementations of the `cpu_shm` platform: the cpu platform with a shared-memory all-reduce.

Importing this module imports neither paddle nor numpy: fd_core imports every platform module to ask
whether its hardware is here, and that must stay cheap. The all-reduce engine lives in
`fd_shm_allreduce.shm` and is imported on the first all-reduce.
"""

from __future__ import annotations

import os
from typing import Any

from fd_core import Capabilities, Detection, GraphVote, ModelConfig, ParallelConfig, hookimpl
from fd_plugins.cpu import platform as _cpu

# What the shared-memory path sums; any other dtype goes through the cpu platform's gloo path.
# float16 and bfloat16 are summed in float32 and rounded once at the end (as the cpu platform does
# for float16, whose gloo sum overflows to inf).
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "float64", "int32", "int64", "float16", "bfloat16")

# What the conformance suite (`fd check cpu_shm`) checks. Graphs: the cpu static-graph backend,
# vetoed at tp > 1 (see fd_graph_eligibility), so the suite's in-graph all-reduce check skips.
FD_CAPABILITIES = Capabilities(world_sizes=(1, 2), dtypes=SUPPORTED_DTYPES, graphs=True, in_place=True)

# One reducer per process group (None is the default group), made by the group's first all-reduce.
_REDUCERS: dict[Any, Any] = {}


@hookimpl
def fd_platform_detect() -> Detection:
    """Always available but opt-in: priority -1 keeps the built-in cpu platform the default."""
    cores = os.cpu_count() or 1
    return Detection(
        detected=True,
        priority=-1,
        reason=f"opt-in: set FD_PLATFORM=cpu_shm for a shared-memory all-reduce between ranks on this host ({cores} cores)",
        device="cpu",
        dist_backend="gloo",
        max_ranks=cores,
    )


@hookimpl
def fd_all_reduce(tensor: Any, group: Any) -> Any:
    """Sum through shared memory when every rank is on this host and the tensor fits a slot, else over gloo."""
    reducer = _REDUCERS.get(group)
    if reducer is None:
        # Zero-size tensors never reach the setup: it is collective, and gloo rejects them anyway.
        if 0 in tensor.shape:
            return tensor
        from fd_shm_allreduce.shm import setup_group

        reducer = _REDUCERS[group] = setup_group(group, _cpu.fd_all_reduce).reducer()
    return reducer(tensor)


@hookimpl
def fd_clean_memory_fragments(state_dict: dict[str, Any] | None) -> None:
    """The cpu platform's cleanup: collect reference cycles."""
    _cpu.fd_clean_memory_fragments(state_dict)


@hookimpl
def fd_graph_eligibility(model_config: ModelConfig, parallel_config: ParallelConfig, graph_mode: str) -> GraphVote | None:
    """Veto static graphs at tp > 1: the numpy all-reduce is invisible to the tracer."""
    if parallel_config.tp_size > 1:
        return GraphVote.veto(
            "the shared-memory all-reduce runs in numpy and cannot be traced into a static graph"
        )
    return GraphVote.ok("one rank: no all-reduce to trace")


@hookimpl
def fd_graph_backend(parallel_config: ParallelConfig) -> Any:
    """The cpu platform's static-graph backend (used at tp 1, where no all-reduce runs)."""
    return _cpu.fd_graph_backend(parallel_config)

