"""Releasing device memory after weights load: shared by the CUDA-like platforms."""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

from fd_core import DeviceMemory


def release_state_dict(state_dict: Mapping[str, Any] | None) -> None:
    """Free the loaded tensors' storage now: the parameters hold their own copies.

    A read-only mapping (seeded random weights: each tensor is drawn when read) holds nothing staged,
    and reading it would draw every tensor again: it is left alone.
    """
    if not state_dict or not isinstance(state_dict, MutableMapping):
        return
    for value in state_dict.values():
        clear = getattr(value, "_clear_data", None)
        if clear is not None:
            clear()
    state_dict.clear()


def empty_device_cache() -> None:
    """Return the caching allocator's free blocks to the driver, then wait for the device."""
    import paddle

    paddle.device.cuda.empty_cache()
    paddle.device.synchronize()


def empty_custom_device_cache() -> None:
    """The device-generic release of cached blocks (custom-device builds, where the CUDA call is a no-op), then wait."""
    import paddle
    from paddle.device import custom_device

    custom_device.empty_cache()
    paddle.device.synchronize()


def device_memory(count: int) -> tuple[DeviceMemory, ...]:
    """Each CUDA device's total bytes and what is free of it for this process: its total less what paddle's
    allocator holds (paddle's public API does not see other processes' use). Device i is local rank i's."""
    import paddle

    cuda = paddle.device.cuda
    return tuple(_memory(cuda.get_device_properties(i).total_memory, cuda.memory_reserved(i)) for i in range(count))


def custom_device_memory(device_type: str, count: int) -> tuple[DeviceMemory, ...]:
    """The same for a custom device type (paddle.device.custom_device), device `device_type:i` for local rank i."""
    from paddle.device import custom_device

    names = [f"{device_type}:{i}" for i in range(count)]
    return tuple(
        _memory(custom_device.get_device_properties(n).total_memory, custom_device.memory_reserved(n)) for n in names
    )


def _memory(total: Any, reserved: Any) -> DeviceMemory:
    total = int(total)
    return DeviceMemory(total=total, free=max(0, total - int(reserved)))
