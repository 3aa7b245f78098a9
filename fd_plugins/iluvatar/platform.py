"""Hook implementations of the iluvatar platform (Iluvatar CoreX GPUs through paddle's custom device)."""

from __future__ import annotations

from typing import Any

from fd_core import Detection, GraphVote, ModelConfig, ParallelConfig, hookimpl
from fd_plugins.cuda.build import CPU_DISTRIBUTION, INSTALL_DOC, installed, paddle_build

# The Iluvatar build serves paddle's CUDAGraph API, so capture is cuda's; its allocator is a custom
# device's, so cleanup uses the device-generic call (paddle.device.cuda.empty_cache does nothing there).
from fd_plugins.cuda.memory import custom_device_memory, empty_custom_device_cache, release_state_dict
from fd_plugins.cuda.platform import fd_graph_backend

# The version of fd's plugin contract this plugin was written for (fd_core.contract).
FD_CONTRACT = "1.1"

__all__ = ["fd_all_reduce", "fd_clean_memory_fragments", "fd_graph_backend", "fd_graph_eligibility",
           "fd_platform_detect"]

DEVICE_TYPE = "iluvatar_gpu"
# Paddle's Iluvatar support is a custom-device plugin installed over its CPU build, from Paddle's `ixuca` index.
DISTRIBUTION = "paddle-iluvatar-gpu"
INSTALL_ADVICE = (f"Iluvatar GPUs need Paddle's CPU build ({CPU_DISTRIBUTION}) plus its {DISTRIBUTION} "
                  f"custom-device plugin, see {INSTALL_DOC}")
# Architectures whose decode fails under CUDA graph capture on Iluvatar when tp > 1.
_VL_GRAPH_UNSAFE = ("ernie4_5_vl", "Ernie4_5_VLMoeForConditionalGeneration")


@hookimpl
def fd_platform_detect() -> Detection:
    """Detected when paddle has the iluvatar_gpu custom device compiled in and sees a device."""
    plugin = installed(DISTRIBUTION)
    if plugin is None:
        # Known from the metadata alone: paddle need not be imported to say what is missing.
        return Detection(detected=False,
                         reason=f"{DISTRIBUTION} is not installed and paddle is {paddle_build()}: {INSTALL_ADVICE}")
    import paddle

    if not paddle.is_compiled_with_custom_device(DEVICE_TYPE):
        # The plugin is there but paddle did not load it: usually a plugin built for another paddle version.
        return Detection(
            detected=False,
            reason=f"paddle is {paddle_build()} but did not load {DISTRIBUTION} {plugin} "
            f"(is_compiled_with_custom_device('{DEVICE_TYPE}') is False): "
            f"install the {DISTRIBUTION} release made for this paddle, see {INSTALL_DOC}",
        )
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
            f"ERNIE-4.5-VL (Ernie4_5_VLMoeForConditionalGeneration) with tp={parallel_config.tp_size} "
            "fails under CUDA graph capture on Iluvatar"
        )
    return GraphVote.ok("Iluvatar captures this model's decode")
