"""Grouped-query attention over a preallocated KV cache, written without data-dependent shapes.

Prefill and decode share one path: the new keys/values are placed into the cache by a one-hot
matrix `place` [S, max_len] (row i is one-hot at token i's position), and every query attends
over the whole cache under an additive mask (key index <= query position). Shapes depend only on
the batch size and max_len, so the decode step can be captured as a static graph.
"""

from __future__ import annotations

import math
from typing import Any

import paddle
import paddle.nn.functional as F
from paddle import nn

from fd_models.layers.norm import RMSNorm
from fd_models.layers.parallel import ColumnParallelLinear, RowParallelLinear
from fd_models.layers.rotary import apply_rope


def attend(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor | None) -> paddle.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for q [B, h, S, d] and k, v [B, kv_h, T, d] (h a multiple of kv_h)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = paddle.repeat_interleave(k, groups, axis=1)
        v = paddle.repeat_interleave(v, groups, axis=1)
    scores = paddle.matmul(q, k, transpose_y=True).astype("float32") * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores + mask
    return paddle.matmul(F.softmax(scores, axis=-1).astype(v.dtype), v)


def write_cache(cache: paddle.Tensor, new: paddle.Tensor, place: paddle.Tensor) -> paddle.Tensor:
    """cache [B, kv_h, T, d] with rows `place` [S, T] replaced by new [B, kv_h, S, d] (exact: a one-hot blend)."""
    keep = (1.0 - paddle.sum(place, axis=0)).reshape([1, 1, -1, 1])
    return cache * keep + paddle.matmul(place, new, transpose_x=True)


def split_heads(x: paddle.Tensor, heads: int, head_dim: int) -> paddle.Tensor:
    """[B, S, heads * head_dim] -> [B, heads, S, head_dim]."""
    return x.reshape([0, 0, heads, head_dim]).transpose([0, 2, 1, 3])


def merge_heads(x: paddle.Tensor) -> paddle.Tensor:
    """[B, heads, S, head_dim] -> [B, S, heads * head_dim]."""
    return x.transpose([0, 2, 1, 3]).reshape([0, 0, -1])


class Attention(nn.Layer):
    """GQA with q/k/v column-parallel by heads and o_proj row-parallel; optional per-head q/k RMSNorm."""

    def __init__(
        self, hidden_size: int, heads: int, kv_heads: int, head_dim: int, ctx: Any, qk_norm_eps: float | None,
        *, bias: bool = False, rope_layout: str = "half", dtype: str = "float32",
    ) -> None:
        super().__init__()
        tp = ctx.parallel.tp_size
        self.heads, self.kv_heads, self.head_dim = heads // tp, kv_heads // tp, head_dim
        self.rope_layout = rope_layout
        self.q_proj = ColumnParallelLinear(hidden_size, heads * head_dim, ctx, bias, dtype)
        self.k_proj = ColumnParallelLinear(hidden_size, kv_heads * head_dim, ctx, bias, dtype)
        self.v_proj = ColumnParallelLinear(hidden_size, kv_heads * head_dim, ctx, bias, dtype)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden_size, ctx, bias, dtype)
        # Qwen3 normalises each head's q and k before rope; the weights are per head_dim, replicated.
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype) if qk_norm_eps is not None else None

    def forward(
        self, x: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor], place: paddle.Tensor,
        mask: paddle.Tensor, cache_k: paddle.Tensor, cache_v: paddle.Tensor,
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """x [B, S, H] -> (output [B, S, H], updated cache_k, updated cache_v)."""
        q = self.q_proj(x).reshape([0, 0, self.heads, self.head_dim])
        k = self.k_proj(x).reshape([0, 0, self.kv_heads, self.head_dim])
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose([0, 2, 1, 3]), *rope, layout=self.rope_layout)
        k = apply_rope(k.transpose([0, 2, 1, 3]), *rope, layout=self.rope_layout)
        v = split_heads(self.v_proj(x), self.kv_heads, self.head_dim)
        cache_k, cache_v = write_cache(cache_k, k, place), write_cache(cache_v, v, place)
        out = attend(q, cache_k, cache_v, mask)
        return self.o_proj(merge_heads(out)), cache_k, cache_v
