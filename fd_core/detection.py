"""What a platform says about itself when asked whether its hardware is here."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from fd_core.contract import deprecated


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory as its platform sees it when detected: `total` bytes, and `free` bytes fd may use now.

    One per device, not per host: a host platform reports the host (its memory within the process's
    cgroup limit) as one device that all its ranks share; a platform with a device per rank reports each.
    """

    total: int
    free: int

    def problem(self) -> str | None:
        for name in ("total", "free"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return f"{name}={value!r}, expected a non-negative integer of bytes"
        if self.free > self.total:
            return f"free={self.free} is more than total={self.total}"
        return None


# Positions per KV-cache block when the platform states none: vLLM's default; a platform's kernels may want more.
DEFAULT_KV_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Detection:
    """A platform's answer to `fd_platform_detect`; the highest `priority` among detected platforms wins."""

    detected: bool
    priority: int = 0
    reason: str = ""
    # The paddle device type ops run on (what paddle.set_device takes); "" when not detected.
    device: str = ""
    # The paddle.distributed backend its ranks rendezvous with.
    dist_backend: str = ""
    # How many tensor-parallel ranks this host can serve; None means no stated limit.
    max_ranks: int | None = None
    # The dtypes its kernels run models in, preferred first (the default of `fd run --dtype`).
    dtypes: tuple[str, ...] = ("float32",)
    # Bytes the ranks it serves on this host may use together for weights and caches; None: unknown.
    # Deprecated in contract 1.0 (removed in 2.0) for device_memory: used, as one device all ranks share, only when
    # device_memory is empty.
    memory_bytes: int | None = None
    # Each device's total and free bytes, in local rank order: rank r of this host uses device
    # r % len(device_memory), and ranks on one device share it. Empty: not reported.
    device_memory: tuple[DeviceMemory, ...] = ()
    # Cores this process may run compute threads on (its affinity mask capped by its cgroup's quota);
    # the plan divides them among the host's ranks. None: not reported (the affinity mask is used).
    host_cores: int | None = None
    # Positions per block of the paged KV cache its attention kernels want (`--kv-block-size` overrides); None:
    # fd's default, DEFAULT_KV_BLOCK_SIZE.
    kv_block_size: int | None = None
    # The most KV-cache bytes a rank allocates when the user caps nothing (`--kv-cache-blocks`): a host platform
    # keeps the cache from taking most of the machine's memory up front; None: what the memory plan leaves.
    kv_cache_bytes: int | None = None
    # The environment variable this platform's users set compute threads per rank with, when the user set it (the
    # one its math libraries read): the plan reads it when --threads is not given (contract 1.2). None: none.
    threads_env: str | None = None
    # The decode batch sizes its graph backend captures (contract 1.2): a decode step is padded up to the next one and
    # runs eagerly above the largest. Empty: fd's, powers of two up to the run's max batch.
    capture_sizes: tuple[int, ...] = ()
    # Defaults for what the user did not set (contract 1.2; the option wins; None: fd's default): the most sequences
    # decoded together (--max-batch; fd: 8), prompt tokens prefilled in one step (--max-prefill-tokens; fd: 512) and
    # prompts prefilled in one step (--max-prefill-prompts; fd: no limit; a device that prefills one prompt a step
    # says 1).
    max_batch: int | None = None
    max_prefill_tokens: int | None = None
    max_prefill_prompts: int | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes is not None:
            # Warned where the platform builds its answer: __post_init__, then the dataclass's __init__, then it.
            deprecated("Detection.memory_bytes", "device_memory=(DeviceMemory(total=..., free=...), ...), one a device",
                       "2.0", stacklevel=3)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def problem(self) -> str | None:
        """What is wrong with this answer's fields (a third party filled them in), or None."""
        from fd_core.config import COMPUTE_DTYPES

        if not isinstance(self.detected, bool):
            return f"detected={self.detected!r}, expected True or False"
        if not isinstance(self.dist_backend, str):
            return f"dist_backend={self.dist_backend!r}, expected a paddle.distributed backend name (a string)"
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            return f"priority={self.priority!r}, expected an integer"
        if self.max_ranks is not None and (
            isinstance(self.max_ranks, bool) or not isinstance(self.max_ranks, int) or self.max_ranks < 1
        ):
            return f"max_ranks={self.max_ranks!r}, expected None or a positive integer"
        for name in ("kv_block_size", "kv_cache_bytes", "max_batch", "max_prefill_tokens", "max_prefill_prompts"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                return f"{name}={value!r}, expected None or a positive integer"
        if not isinstance(self.capture_sizes, (tuple, list)) or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.capture_sizes
        ):
            return f"capture_sizes={self.capture_sizes!r}, expected a tuple of positive integers (batch sizes)"
        if self.threads_env is not None and (not isinstance(self.threads_env, str) or not self.threads_env):
            return f"threads_env={self.threads_env!r}, expected None or an environment variable's name"
        if self.host_cores is not None and (
            isinstance(self.host_cores, bool) or not isinstance(self.host_cores, int) or self.host_cores < 1
        ):
            return f"host_cores={self.host_cores!r}, expected None or a positive integer"
        if self.memory_bytes is not None and (
            isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes < 0
        ):
            return f"memory_bytes={self.memory_bytes!r}, expected None or a non-negative integer"
        if not isinstance(self.device_memory, (tuple, list)) or any(
            not isinstance(d, DeviceMemory) for d in self.device_memory
        ):
            return f"device_memory={self.device_memory!r}, expected a tuple of fd_core.DeviceMemory"
        for index, device in enumerate(self.device_memory):
            wrong = device.problem()
            if wrong is not None:
                return f"device_memory[{index}] has {wrong}"
        if (
            not isinstance(self.dtypes, (tuple, list))
            or not self.dtypes
            or any(d not in COMPUTE_DTYPES for d in self.dtypes)
        ):
            return f"dtypes={self.dtypes!r}, expected a non-empty tuple of {', '.join(COMPUTE_DTYPES)}"
        return None


def affinity_cores() -> int:
    """Cores in this process's affinity mask (the online processors where the OS has no masks): a platform's
    starting point for `Detection.host_cores`, and what fd assumes when a platform reports none."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        try:
            return max(1, os.sysconf("SC_NPROCESSORS_ONLN"))
        except (AttributeError, ValueError, OSError):
            return 1
