"""fd_register_kernels: rms_norm and silu_and_mul, each computed another way than fd's native ops."""

from __future__ import annotations

import os
from typing import Any, Callable

from fd_core import hookimpl

_seen: set[str] = set()


def _note(op: str) -> None:
    """The first call of `op` in this process, noted in FD_EXAMPLE_KERNELS_TRACE (a directory) when it is set."""
    _seen.add(op)
    trace = os.environ.get("FD_EXAMPLE_KERNELS_TRACE")
    if trace:
        with open(os.path.join(trace, f"{op}.{os.getpid()}"), "w"):
            pass


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """x * (mean(x^2) + eps)^-1/2 in float32, cast back to x's dtype, times weight."""
    import paddle

    if "rms_norm" not in _seen:
        _note("rms_norm")
    x32 = x.astype("float32")
    scale = paddle.pow(paddle.mean(paddle.square(x32), axis=-1, keepdim=True) + eps, -0.5)
    return (x32 * scale).astype(x.dtype) * weight


def silu_and_mul(gate: Any, up: Any) -> Any:
    """Paddle's fused SwiGLU: silu(gate) * up in one kernel."""
    import paddle.nn.functional as F

    if "silu_and_mul" not in _seen:
        _note("silu_and_mul")
    return F.swiglu(gate, up)


@hookimpl
def fd_register_kernels(register: Callable[..., None]) -> None:
    register("rms_norm", rms_norm)
    register("silu_and_mul", silu_and_mul)
