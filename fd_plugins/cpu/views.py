"""What the cpu kernels written in numpy share: whether a call may run on numpy views of Paddle's memory, and a new
tensor holding a result."""

from __future__ import annotations

from typing import Any


def eager_float32(*tensors: Any) -> bool:
    """Whether these tensors may be read through numpy here: float32 in host memory, in an eager call (a static
    program, or a graph being captured, cannot hold a numpy call: the native op runs there)."""
    import paddle

    from fd_core.graphs import capturing

    return (paddle.in_dynamic_mode() and not capturing()
            and all(t.dtype == paddle.float32 and t.place.is_cpu_place() for t in tensors))


def new_tensor(array: Any) -> Any:
    """A new float32 Paddle tensor holding `array`, written once through a DLPack view (not through Paddle 3.3.1's
    to_tensor, which keeps about 100 bytes of every call)."""
    import numpy as np
    import paddle

    out = paddle.empty(list(array.shape), dtype="float32")
    np.copyto(np.from_dlpack(out), array)
    return out
