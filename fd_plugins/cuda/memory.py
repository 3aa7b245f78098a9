"""Releasing device memory after weights load: shared by the CUDA-like platforms."""

from __future__ import annotations

from typing import Any, MutableMapping


def release_state_dict(state_dict: MutableMapping[str, Any] | None) -> None:
    """Free the loaded tensors' storage now: the parameters hold their own copies."""
    if not state_dict:
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
