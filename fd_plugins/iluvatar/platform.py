"""Hook implementations of the iluvatar platform (Iluvatar CoreX GPUs through paddle's custom device)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fd_core import Detection, GraphVote, ModelConfig, ParallelConfig, hookimpl

# The Iluvatar build serves paddle's CUDAGraph API, so capture is cuda's; its allocator is a custom
# device's, so cleanup uses the device-generic call (paddle.device.cuda.empty_cache does nothing there).
from fd_plugins.cuda.memory import custom_device_memory, empty_custom_device_cache, release_state_dict
from fd_plugins.cuda.platform import fd_graph_backend

__all__ = ["fd_all_reduce", "fd_clean_memory_fragments", "fd_graph_backend", "fd_graph_eligibility", "fd_platform_detect"]

DEVICE_TYPE = "iluvatar_gpu"
DISTRIBUTION = "paddle-iluvatar-gpu"
# Architectures whose decode fails under CUDA graph capture on Iluvatar when tp > 1.
_VL_GRAPH_UNSAFE = ("ernie4_5_vl", "Ernie4_5_VLMoeForConditionalGeneration")


@hookimpl
def fd_platform_detect() -> Detection:
    """Detected when paddle has the iluvatar_gpu custom device compiled in and sees a device."""
    try:
        version(DISTRIBUTION)
    except PackageNotFoundError:
        return Detection(detected=False, reason=f"{DISTRIBUTION} is not installed")
    import paddle

    if not paddle.is_compiled_with_custom_device(DEVICE_TYPE):
        return Detection(detected=False, reason=f"paddle has no {DEVICE_TYPE} custom device")
    devices = [d for d in paddle.device.get_available_custom_device() or [] if d.startswith(DEVICE_TYPE)]
    if not devices:
        return Detection(detected=False, reason=f"paddle has the {DEVICE_TYPE} device type but sees no device")
    try:
        memory, unreported = custom_device_memory(DEVICE_TYPE, len(devices)), ""
    except Exception as exc:  # noqa: BLE001 - a failed query leaves the memory unchecked, never the device undetected
        memory, unreported = (), f" (memory not reported: {type(exc).__name__}: {exc})"
    return Detection(
        detected=True,
        # Above cuda: an Iluvatar build also answers to CUDA-style queries.
        priority=20,
        reason=f"{len(devices)} Iluvatar device(s){unreported}",
        device=DEVICE_TYPE,
        dist_backend="xccl",
        max_ranks=len(devices),
        dtypes=("bfloat16", "float16", "float32"),
        device_memory=memory,
    )


@hookimpl
def fd_clean_memory_fragments(state_dict: dict[str, Any] | None) -> None:
    """Free the loaded tensors, then return the custom device's cached blocks and synchronize."""
    release_state_dict(state_dict)
    empty_custom_device_cache()


@hookimpl
def fd_all_reduce(tensor: Any, group: Any) -> Any:
    """Sum on the calculation stream, synchronously, so CUDA graph capture records it at tp > 1."""
    import paddle.distributed as dist

    dist.stream.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, sync_op=True, use_calc_stream=True)
    return tensor


@hookimpl
def fd_graph_eligibility(model_config: ModelConfig, parallel_config: ParallelConfig, graph_mode: str) -> GraphVote:
    """Veto CUDA graphs for ERNIE-VL at tp > 1, which fails under capture on Iluvatar."""
    if model_config.architecture in _VL_GRAPH_UNSAFE and parallel_config.tp_size > 1:
        return GraphVote.veto(
            f"ERNIE-4.5-VL (Ernie4_5_VLMoeForConditionalGeneration) with tp={parallel_config.tp_size} fails under CUDA graph capture on Iluvatar"
        )
    return GraphVote.ok("Iluvatar captures this model's decode")
