"""Hook implementations of the cpu platform, the embedded default."""

from __future__ import annotations

import gc
import os
from typing import Any

from fd_core import Capabilities, Detection, GraphVote, ModelConfig, ParallelConfig, hookimpl

# What the conformance suite checks; float16 is summed in float32 (see fd_all_reduce).
FD_CAPABILITIES = Capabilities(
    world_sizes=(1, 2),
    dtypes=("float32", "float64", "float16", "bfloat16", "int32", "int64"),
    graphs=True,
    in_place=True,
)
# gloo's float16 sum overflows to inf (seen with paddle 3.3.1), so half floats are summed in float32.
_UPCAST = ("float16",)


@hookimpl
def fd_platform_detect() -> Detection:
    """Always available: every build of paddle has CPU kernels."""
    cores = os.cpu_count() or 1
    return Detection(
        detected=True,
        priority=0,
        reason=f"always available ({cores} cores)",
        device="cpu",
        dist_backend="gloo",
        max_ranks=cores,
        # Paddle's CPU kernels have no bfloat16 or float16 matmul.
        dtypes=("float32",),
        memory_bytes=_available_memory(),
    )


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo (what the kernel can give without swapping), None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@hookimpl
def fd_all_reduce(tensor: Any, group: Any) -> Any:
    """Sum over gloo; zero-size tensors return at once (gloo rejects them)."""
    import paddle
    import paddle.distributed as dist

    if 0 in tensor.shape:
        return tensor
    if tensor.dtype == paddle.float16:
        wide = tensor.astype("float32")
        dist.all_reduce(wide, group=group)
        paddle.assign(wide.astype(tensor.dtype), output=tensor)
        return tensor
    dist.all_reduce(tensor, group=group)
    return tensor


@hookimpl
def fd_clean_memory_fragments(state_dict: dict[str, Any] | None) -> None:
    """The CPU allocator returns freed blocks itself; collecting cycles frees what they hold."""
    gc.collect()


@hookimpl
def fd_graph_eligibility(model_config: ModelConfig, parallel_config: ParallelConfig, graph_mode: str) -> GraphVote:
    """Static graphs trace gloo all-reduce, so every model and tp may be captured."""
    return GraphVote.ok("paddle static graph traces the model and its gloo all-reduce")


@hookimpl
def fd_graph_backend(parallel_config: ParallelConfig) -> Any:
    """A static-graph backend."""
    from fd_plugins.cpu.static_graph import StaticGraphBackend

    return StaticGraphBackend()
