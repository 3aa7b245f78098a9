"""The cpu platform's own kernels for fd's named ops, where Paddle's CPU build has a faster fused op."""

from __future__ import annotations

import functools
from typing import Any, Callable


@functools.cache
def _fused_rms_norm() -> Callable[..., Any]:
    """Paddle's fused op, looked up on the first call: importing it at module level would import paddle in `fd plugins`."""
    from paddle.incubate.nn.functional import fused_rms_norm

    return fused_rms_norm


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """Paddle's fused RMSNorm (one CPU kernel instead of six ops); about 4x faster per call at the 0.3B hidden size here."""
    return _fused_rms_norm()(x, weight, None, eps, x.ndim - 1)[0]
