"""Rotary tables from a positions tensor, graph-safe; applying them is the Backend's `rotary_embedding` op, in
the two layouts the published models use:

- "half" (Llama, Qwen): dimension i pairs with i + d/2 (`rotate_half`).
- "interleaved" (ERNIE-4.5): dimension 2i pairs with 2i + 1 ("rotate every two").

Multimodal (M-RoPE) positions are [3, S] (temporal, height, width); `mrope_section` says how many
frequencies each axis drives, and the style how they are laid out:
- "qwen3" (Qwen3-VL, interleaved M-RoPE): frequency j follows h if j % 3 == 1, w if j % 3 == 2
  (each within its section), else t;
- "ernie" (ERNIE-4.5-VL): the first h + w frequencies alternate h, w, h, w, ...; the last t follow t.
For a text token the three positions are equal and either reduces to the 1-D rope.
"""

from __future__ import annotations

import math
from typing import Sequence

import paddle


def rope_tables(
    positions: paddle.Tensor, head_dim: int, theta: float, mrope_section: Sequence[int] | None = None,
    mrope_style: str = "qwen3",
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """float32 cos and sin of shape [S, head_dim / 2] for int64 `positions` [S] (or [3, S] with `mrope_section`)."""
    # Built from ops rather than a numpy constant, so a traced graph holds no captured buffer.
    exponents = paddle.arange(0, head_dim, 2, dtype="float32") / head_dim
    inv_freq = paddle.exp(exponents * -math.log(theta))
    freqs = positions.astype("float32").unsqueeze(-1) * inv_freq
    if mrope_section is not None:
        # freqs [3, S, d/2] for the t, h and w positions; pick each frequency's axis.
        j = paddle.arange(0, head_dim // 2, dtype="int64")
        if mrope_style == "ernie":
            spatial = j < mrope_section[0] + mrope_section[1]
            use_h, use_w = paddle.logical_and(spatial, j % 2 == 0), paddle.logical_and(spatial, j % 2 == 1)
        else:
            use_h = paddle.logical_and(j % 3 == 1, j < 3 * mrope_section[1])
            use_w = paddle.logical_and(j % 3 == 2, j < 3 * mrope_section[2])
        freqs = paddle.where(use_h, freqs[1], paddle.where(use_w, freqs[2], freqs[0]))
    return paddle.cos(freqs), paddle.sin(freqs)
