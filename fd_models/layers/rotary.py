"""Rotary position embedding from a positions tensor, graph-safe, in the two layouts the published models use.

- "half" (Llama, Qwen): dimension i pairs with i + d/2 (`rotate_half`).
- "interleaved" (ERNIE-4.5): dimension 2i pairs with 2i + 1 ("rotate every two").

Multimodal (M-RoPE) positions are [3, S] (temporal, height, width); `mrope_section` says how many
frequencies each axis drives, interleaved t, h, w, t, h, w, ... as Qwen3-VL does. For a text
token the three positions are equal and the result is the 1-D rope.
"""

from __future__ import annotations

import math
from typing import Sequence

import paddle


def rope_tables(
    positions: paddle.Tensor, head_dim: int, theta: float, mrope_section: Sequence[int] | None = None
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """float32 cos and sin of shape [S, head_dim / 2] for int64 `positions` [S] (or [3, S] with `mrope_section`)."""
    # Built from ops rather than a numpy constant, so a traced graph holds no captured buffer.
    exponents = paddle.arange(0, head_dim, 2, dtype="float32") / head_dim
    inv_freq = paddle.exp(exponents * -math.log(theta))
    freqs = positions.astype("float32").unsqueeze(-1) * inv_freq
    if mrope_section is not None:
        # freqs [3, S, d/2]: frequency j follows axis h if j % 3 == 1 (within its section), w if j % 3 == 2, else t.
        j = paddle.arange(0, head_dim // 2, dtype="int64")
        use_h = paddle.logical_and(j % 3 == 1, j < 3 * mrope_section[1])
        use_w = paddle.logical_and(j % 3 == 2, j < 3 * mrope_section[2])
        freqs = paddle.where(use_h, freqs[1], paddle.where(use_w, freqs[2], freqs[0]))
    return paddle.cos(freqs), paddle.sin(freqs)


def apply_rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, layout: str = "half") -> paddle.Tensor:
    """Rotate x [B, heads, S, head_dim] by the tables [S, head_dim / 2], in float32; returns x's dtype."""
    x32 = x.astype("float32")
    if layout == "interleaved":
        pairs = x32.reshape([0, 0, 0, -1, 2])
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = paddle.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        return rotated.reshape([0, 0, 0, -1]).astype(x.dtype)
    half = x.shape[-1] // 2
    first, second = x32[..., :half], x32[..., half:]
    return paddle.concat([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)
