"""The cpu platform's own kernels for fd's named ops, where Paddle's CPU build has a faster formulation."""

from __future__ import annotations

import functools
from typing import Any, Callable

from fd_plugins.cpu.views import eager_float32, new_tensor


@functools.cache
def _fused_rms_norm() -> Callable[..., Any]:
    """Paddle's fused op, looked up on the first call: importing it at module level would
    import paddle in `fd plugins`."""
    from paddle.incubate.nn.functional import fused_rms_norm

    return fused_rms_norm


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """Paddle's fused RMSNorm (one CPU kernel instead of six ops); measured faster per call at the 0.3B hidden size
    (`fd bench --rows kernels`; docs/benchmarks.md has the figures)."""
    return _fused_rms_norm()(x, weight, None, eps, x.ndim - 1)[0]


def add_rms_norm(x: Any, residual: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """The residual add and RMSNorm in Paddle's one fused kernel (its `residual` input), returning (normed, summed):
    one kernel instead of the add and the fused norm (`fd bench --rows kernels` measures it)."""
    normed, summed = _fused_rms_norm()(x, weight, None, eps, x.ndim - 1, residual=residual)
    return normed, summed


def rotary_embedding(x: Any, cos: Any, sin: Any, layout: str) -> Any:
    """Each pair of dimensions as one complex number, turned by cos + i sin: one product instead of four broadcast ones.

    Paddle's CPU build has no fused rotary kernel, and a broadcast elementwise op costs several times
    a same-shaped one; for x[1, 16, 1, 128] this measured faster than the native op in both layouts
    (`fd bench --rows kernels`; docs/benchmarks.md has the figures), with the same float32 result. An eager float32
    call of several positions a row runs in numpy instead, on views of x's memory (a prefill's x is a transposed view,
    which Paddle's ops copy element by element): two to three times faster again at a 64-token chunk.
    """
    import paddle

    # Several positions a row (a prefill): numpy on x's view. One (a decode step): a numpy call's fixed cost (the
    # checks, the views, the result's tensor: about 100 us) measured above the complex product's 40 us a call.
    if x.shape[2] > 1 and eager_float32(x, cos, sin):
        return _rotary_numpy(x, cos, sin, layout)
    x32 = x if x.dtype == paddle.float32 else x.astype("float32")
    turn = paddle.complex(cos, sin)
    if layout == "interleaved":  # dimensions 2i, 2i + 1 are the real and imaginary parts: as_complex's own layout
        out = paddle.as_real(paddle.as_complex(x32.reshape([0, 0, 0, -1, 2])) * turn).reshape([0, 0, 0, -1])
    else:  # "half": dimension i pairs with i + d/2
        half = x.shape[-1] // 2
        z = paddle.complex(x32[..., :half], x32[..., half:]) * turn
        out = paddle.concat([paddle.real(z), paddle.imag(z)], axis=-1)
    return out if out.dtype == x.dtype else out.astype(x.dtype)


def _rotary_numpy(x: Any, cos: Any, sin: Any, layout: str) -> Any:
    """rotary_embedding on numpy views: (a, b) -> (a cos - b sin, b cos + a sin) for each pair of the layout."""
    import numpy as np

    host: Any = np.from_dlpack(x)
    c: Any = np.from_dlpack(cos)
    s: Any = np.from_dlpack(sin)
    half = host.shape[-1] // 2
    pairs = (slice(0, half), slice(half, None)) if layout == "half" else (slice(0, None, 2), slice(1, None, 2))
    a, b = host[..., pairs[0]], host[..., pairs[1]]
    out = np.empty(host.shape, dtype=np.float32)
    np.multiply(a, c, out=out[..., pairs[0]])
    out[..., pairs[0]] -= b * s
    np.multiply(b, c, out=out[..., pairs[1]])
    out[..., pairs[1]] += a * s
    return new_tensor(out)
