"""Rotary position embedding (rotate-half layout) computed from a positions tensor, graph-safe."""

from __future__ import annotations

import math

import paddle


def rope_tables(positions: paddle.Tensor, head_dim: int, theta: float) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos and sin of shape [S, head_dim] for int64 `positions` [S]."""
    # Built from ops rather than a numpy constant, so a traced graph holds no captured buffer.
    exponents = paddle.arange(0, head_dim, 2, dtype="float32") / head_dim
    inv_freq = paddle.exp(exponents * -math.log(theta))
    freqs = positions.astype("float32").unsqueeze(-1) * inv_freq.unsqueeze(0)
    angles = paddle.concat([freqs, freqs], axis=-1)
    return paddle.cos(angles), paddle.sin(angles)


def apply_rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """Rotate x [B, heads, S, head_dim] by the tables [S, head_dim]."""
    half = x.shape[-1] // 2
    rotated = paddle.concat([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
