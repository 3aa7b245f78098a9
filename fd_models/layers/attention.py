"""Grouped-query attention over a preallocated KV cache, with shapes fixed by the caller; rotary embedding and
attention itself are the Backend's named ops (fd_core.kernels), resolved once per layer.

The cache of one layer is [max_len, B, kv_h, d]: position-major, so that writing the new keys and
values is one in-place `index_put_` at their positions (a cost that does not grow with max_len, and
an op a Paddle static graph captures). Queries attend over the first L positions only, where
`slots` = arange(L) is an input: eagerly L is the positions in use; a captured graph takes L from
the bucket it was traced for (its input shape), and the mask hides the positions past the query.
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle import nn

from fd_models.layers.norm import RMSNorm
from fd_models.layers.parallel import ColumnParallelLinear, RowParallelLinear


def write_cache(cache: paddle.Tensor, new: paddle.Tensor, positions: paddle.Tensor) -> None:
    """cache [T, B, kv_h, d] at `positions` [S] := new [B, S, kv_h, d], in place; with `positions` [B, 1] (a decode
    step, each row at its own slot), cache[positions[b], b] := new[b, 0]."""
    if len(positions.shape) == 2:
        rows = paddle.arange(new.shape[0], dtype="int64")
        paddle.index_put_(cache, (positions.reshape([-1]), rows), new[:, 0])
        return
    paddle.index_put_(cache, (positions,), new.transpose([1, 0, 2, 3]))


def cached(cache: paddle.Tensor, length: int) -> paddle.Tensor:
    """The first `length` positions of a cache [T, B, kv_h, d] as [B, kv_h, length, d]."""
    return cache[:length].transpose([1, 2, 0, 3])


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
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, ctx, dtype) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, ctx, dtype) if qk_norm_eps is not None else None
        self.rotary_embedding, self.attention = ctx.ops.rotary_embedding, ctx.ops.attention

    def forward(
        self, x: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor], positions: paddle.Tensor,
        mask: paddle.Tensor, cache_k: paddle.Tensor, cache_v: paddle.Tensor,
    ) -> paddle.Tensor:
        """x [B, S, H] at cache `positions` [S] (or [B, 1], each row's own), attending over the first mask.shape[-1] positions -> [B, S, H].

        Writes this step's keys and values into cache_k / cache_v in place.
        """
        q = self.q_proj(x).reshape([0, 0, self.heads, self.head_dim])
        k = self.k_proj(x).reshape([0, 0, self.kv_heads, self.head_dim])
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm_eps)
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rotary_embedding(q.transpose([0, 2, 1, 3]), *rope, self.rope_layout)
        k = self.rotary_embedding(k.transpose([0, 2, 1, 3]), *rope, self.rope_layout)
        v = self.v_proj(x).reshape([0, 0, self.kv_heads, self.head_dim])
        write_cache(cache_k, k.transpose([0, 2, 1, 3]), positions)
        write_cache(cache_v, v, positions)
        length = mask.shape[-1]
        out = self.attention(q, cached(cache_k, length), cached(cache_v, length), mask)
        return self.o_proj(merge_heads(out))
