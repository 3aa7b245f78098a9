"""The native implementations of fd's named ops (fd_core.kernels.OPS): Paddle's public API, the default
kernels and the reference a plugin's kernel is checked against. Loaded when a Backend is built."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import paddle
import paddle.nn.functional as F


def matmul(x: paddle.Tensor, weight: paddle.Tensor, transpose_weight: bool) -> paddle.Tensor:
    """x @ weight, or x @ weight^T when transpose_weight (Paddle's own product)."""
    return paddle.matmul(x, weight, transpose_y=transpose_weight)


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """weight * (x / rms(x)): the statistics in float32, cast back to x's dtype before the weight, as the references
    do."""
    x32 = x.astype("float32")
    x32 = x32 * paddle.rsqrt(paddle.mean(x32 * x32, axis=-1, keepdim=True) + eps)
    return x32.astype(x.dtype) * weight


def silu_and_mul(gate: paddle.Tensor, up: paddle.Tensor) -> paddle.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def rotary_embedding(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, layout: str) -> paddle.Tensor:
    """x [B, heads, S, d] rotated by the tables [S, d/2] (or [B, 1, S, d/2], a row's own) in float32, in the 'half'
    or 'interleaved' layout."""
    x32 = x.astype("float32")
    if layout == "interleaved":
        pairs = x32.reshape([0, 0, 0, -1, 2])
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = paddle.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        return rotated.reshape([0, 0, 0, -1]).astype(x.dtype)
    half = x.shape[-1] // 2
    first, second = x32[..., :half], x32[..., half:]
    return paddle.concat([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


def attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor | None) -> paddle.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v with grouped-query heads.

    The query heads of one kv head are folded into its rows ([B, kv_h, g * S, d]), so k and v are
    read once, not repeated g times.
    """
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    q = q.reshape([batch, kv_heads, groups * length, dim])
    scores = paddle.matmul(q, k, transpose_y=True).astype("float32") * (1.0 / math.sqrt(dim))
    if mask is not None:
        scores = (scores.reshape([batch, kv_heads, groups, length, -1]) + mask).reshape(
            [batch, kv_heads, groups * length, -1]
        )
    out = paddle.matmul(F.softmax(scores, axis=-1).astype(v.dtype), v)
    return out.reshape([batch, heads, length, dim])


def _host(logits: Any) -> np.ndarray:
    values = logits.astype("float32").numpy() if isinstance(logits, paddle.Tensor) else logits
    return np.asarray(values, dtype=np.float64)


def sample(logits: Any, temperature: float, top_k: int, top_p: float, uniform: Sequence[float]) -> list[int]:
    """Greedy (temperature 0) or the inverse-CDF draw at each row's uniform number, after temperature, top-k, top-p."""
    rows = _host(logits)
    if temperature == 0:
        return [int(i) for i in rows.argmax(axis=-1)]
    return [_draw(row, temperature, top_k, top_p, float(u)) for row, u in zip(rows, uniform, strict=True)]


def _draw(row: np.ndarray, temperature: float, top_k: int, top_p: float, uniform: float) -> int:
    scores = row / temperature
    if 0 < top_k < scores.size:
        kth = np.partition(scores, -top_k)[-top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # Keep the smallest prefix whose mass reaches top_p (at least one token).
        keep = order[: int(np.searchsorted(cumulative, top_p)) + 1]
        mask = np.zeros_like(probs)
        mask[keep] = 1.0
        probs = probs * mask
        probs /= probs.sum()
    cumulative = np.cumsum(probs)
    return int(min(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"), probs.size - 1))
