"""Hook implementations of the cuda platform (NVIDIA GPUs through paddlepaddle-gpu)."""

from __future__ import annotations

from typing import Any

from fd_core import Detection, GraphVote, ModelConfig, ParallelConfig, hookimpl
from fd_plugins.cuda.build import CPU_DISTRIBUTION, INSTALL_DOC, installed, paddle_build

# The version of fd's plugin contract this plugin was written for (fd_core.contract).
FD_CONTRACT = "1.6"

GPU_DISTRIBUTION = "paddlepaddle-gpu"
# Public PyPI stops at paddlepaddle-gpu 2.6.2; the 3.x builds come from Paddle's index, one per CUDA version.
INSTALL_ADVICE = f"install {GPU_DISTRIBUTION} for your CUDA version, see {INSTALL_DOC}"


@hookimpl
def fd_platform_detect() -> Detection:
    """Detected when paddle is a CUDA build and sees at least one device."""
    gpu = installed(GPU_DISTRIBUTION)
    if gpu is None:
        # Without the GPU build there is nothing to find, and the metadata says which build is here
        # without importing paddle.
        return Detection(detected=False, reason=f"paddle is {paddle_build()}: {INSTALL_ADVICE}")
    if installed(CPU_DISTRIBUTION) is not None:
        # Both ship the `paddle` package: whichever was installed last overwrote the other's files.
        return Detection(
            detected=False,
            reason=f"{CPU_DISTRIBUTION} and {GPU_DISTRIBUTION} are both installed and overwrite each other's paddle: "
            f"pip uninstall -y {CPU_DISTRIBUTION} {GPU_DISTRIBUTION}, then {INSTALL_ADVICE}",
        )
    import paddle

    if not paddle.is_compiled_with_cuda():
        return Detection(
            detected=False,
            reason=f"paddle is not a CUDA build ({GPU_DISTRIBUTION} {gpu}, is_compiled_with_cuda() is False): "
            f"{INSTALL_ADVICE}",
        )
    count = paddle.device.cuda.device_count()
    if count == 0:
        return Detection(detected=False, reason="paddle is a CUDA build but sees no CUDA device")
    memory, unreported = _device_memory(count)
    return Detection(
        detected=True,
        priority=10,
        reason=f"{count} CUDA device(s): {paddle.device.cuda.get_device_name(0)}{unreported}",
        device="gpu",
        dist_backend="nccl",
        max_ranks=count,
        dtypes=("bfloat16", "float16", "float32"),
        device_memory=memory,
    )


def _device_memory(count: int) -> tuple[tuple[Any, ...], str]:
    """Each device's memory, or none and why (a failed query leaves the memory unchecked,
    never the device undetected)."""
    from fd_plugins.cuda.memory import device_memory

    try:
        return device_memory(count), ""
    except Exception as exc:  # noqa: BLE001 - the driver's error, shown in the reason
        return (), f" (memory not reported: {type(exc).__name__}: {exc})"


@hookimpl
def fd_all_reduce(tensor: Any, group: Any) -> Any:
    """Sum over NCCL through paddle.distributed."""
    import paddle.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, sync_op=True)
    return tensor


@hookimpl
def fd_clean_memory_fragments(state_dict: dict[str, Any] | None) -> None:
    """Free the loaded state dict's tensors, then empty the caching allocator and synchronize."""
    from fd_plugins.cuda.memory import empty_device_cache, release_state_dict

    release_state_dict(state_dict)
    empty_device_cache()


@hookimpl
def fd_graph_eligibility(model_config: ModelConfig, parallel_config: ParallelConfig, graph_mode: str) -> GraphVote:
    """CUDA graphs capture the decode step, NCCL all-reduce included."""
    return GraphVote.ok("CUDA graphs capture decode, NCCL all-reduce included")


@hookimpl
def fd_graph_backend(parallel_config: ParallelConfig) -> Any:
    """A CUDA graph backend."""
    from fd_plugins.cuda.graphs import CudaGraphBackend

    return CudaGraphBackend()


@hookimpl
def fd_register_kernels(register: Any) -> None:
    """Weight-only quantized products through Paddle's weight_only_linear, weights repacked once at load."""
    from fd_plugins.cuda.quantized import prepare, quant_matmul

    register("quant_matmul", quant_matmul, prepare=prepare)
