"""The cpu platform's own kernels for fd's named ops, where Paddle's CPU build has a faster fused op."""

from __future__ import annotations

from typing import Any


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """Paddle's fused RMSNorm (one CPU kernel instead of six ops); about 2.5x faster per call at decode sizes here."""
    from paddle.incubate.nn.functional import fused_rms_norm

    return fused_rms_norm(x, weight, None, eps, x.ndim - 1)[0]
