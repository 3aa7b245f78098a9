"""Grouped-query attention over a preallocated KV cache, with shapes fixed by the caller; rotary embedding and
attention itself are the Backend's named ops (fd_core.kernels), resolved once per layer.

The cache of one layer is [B, kv_h, max_len, d]: head-major, the layout attention reads, so a step
attends over a slice of it (`cache[:, :, :L]`) and never transposes it. Writing the new keys and
values is one in-place `index_put_` at (row, kv head, slot) triples that the decoder computes once
per step for every layer (`cache_index`): a cost that does not grow with max_len, and an op a
Paddle static graph captures. Queries attend over the first L positions only, where `slots` =
arange(L) is an input: eagerly L is the positions in use; a captured graph takes L from the bucket
it was traced for (its input shape), and the mask hides the positions past the query.

Without biases q, k and v are one [hidden, (heads + 2 kv_heads) x d / tp] matrix and o is stored
[heads x d / tp, hidden] (as the MLP's gate/up and down: one product instead of three, in the layout
Paddle's CPU product reads fastest); the checkpoint names and layout are unchanged.

A decode step (one token a row) reshapes between [B, 1, heads, d] and [B, heads, 1, d] instead of
transposing: the same memory order. Paddle's CPU kernels copy a transposed view element by element
(measured far slower than the product that reads it; docs/benchmarks.md has the figures).
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle import nn

from fd_core import WeightSpec
from fd_models.layers.norm import RMSNorm
from fd_models.layers.parallel import ColumnParallelLinear, RowParallelLinear
from fd_models.layers.params import new_columns_param

CacheIndex = tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]


def cache_index(positions: paddle.Tensor, batch: int, kv_heads: int) -> CacheIndex:
    """The (row, kv head, slot) index triples, each [B * kv_h * S] in (row, head, position) order, of writing
    S new positions per row: `positions` [S] (every row at the same slots, a prefill) or [B, S] (row b at its own)."""
    length = positions.shape[-1]
    rows = paddle.arange(batch, dtype="int64").reshape([-1, 1, 1]).expand([batch, kv_heads, length]).reshape([-1])
    heads = paddle.arange(kv_heads, dtype="int64").reshape([1, -1, 1]).expand([batch, kv_heads, length]).reshape([-1])
    per_row = positions.reshape([-1, 1, length]) if len(positions.shape) == 2 else positions.reshape([1, 1, length])
    slots = per_row.expand([batch, kv_heads, length]).reshape([-1])
    return rows, heads, slots


def write_cache(cache: paddle.Tensor, new: paddle.Tensor, index: CacheIndex) -> None:
    """cache [B, kv_h, T, d] := new [B, kv_h, S, d] at `index` (see cache_index), in place."""
    paddle.index_put_(cache, index, new.reshape([-1, new.shape[-1]]))


def to_heads(x: paddle.Tensor, heads: int, head_dim: int) -> paddle.Tensor:
    """[B, S, heads * head_dim] -> [B, heads, S, head_dim]; a reshape when S is 1 (the same memory order)."""
    if x.shape[1] == 1:
        return x.reshape([0, heads, 1, head_dim])
    return x.reshape([0, 0, heads, head_dim]).transpose([0, 2, 1, 3])


def merge_heads(x: paddle.Tensor) -> paddle.Tensor:
    """[B, heads, S, head_dim] -> [B, S, heads * head_dim]; a reshape when S is 1."""
    if x.shape[2] == 1:
        return x.reshape([0, 1, -1])
    return x.transpose([0, 2, 1, 3]).reshape([0, 0, -1])


class Attention(nn.Layer):
    """GQA with q/k/v column-parallel by heads (one fused `qkv` without biases) and o row-parallel;
    optional per-head q/k RMSNorm."""

    def __init__(
        self, hidden_size: int, heads: int, kv_heads: int, head_dim: int, ctx: Any, qk_norm_eps: float | None,
        *, bias: bool = False, rope_layout: str = "half", dtype: str = "float32",
    ) -> None:
        super().__init__()
        tp = ctx.parallel.tp_size
        self.heads, self.kv_heads, self.head_dim = heads // tp, kv_heads // tp, head_dim
        self.rope_layout = rope_layout
        self.ctx = ctx
        self.fused = not bias
        if self.fused:
            # Checkpoint names relative to this layer: `self_attn.q_proj.weight` and so on.
            parts = [(f"{name}_proj.weight", WeightSpec((n * head_dim, hidden_size), 0, dtype))
                     for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))]
            new_columns_param(self, parts, tp, attr="qkv")
            new_columns_param(self, [("o_proj.weight", WeightSpec((hidden_size, heads * head_dim), 1, dtype))],
                              tp, attr="o")
            self.widths = [self.heads * head_dim, self.kv_heads * head_dim, self.kv_heads * head_dim]
        else:
            self.q_proj = ColumnParallelLinear(hidden_size, heads * head_dim, ctx, bias, dtype)
            self.k_proj = ColumnParallelLinear(hidden_size, kv_heads * head_dim, ctx, bias, dtype)
            self.v_proj = ColumnParallelLinear(hidden_size, kv_heads * head_dim, ctx, bias, dtype)
            self.o_proj = RowParallelLinear(heads * head_dim, hidden_size, ctx, bias, dtype)
        # Qwen3 normalises each head's q and k before rope; the weights are per head_dim, replicated.
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, ctx, dtype) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, ctx, dtype) if qk_norm_eps is not None else None
        self.rotary_embedding, self.attention, self.matmul = ctx.ops.rotary_embedding, ctx.ops.attention, ctx.ops.matmul

    def project(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """x [B, S, H] -> this rank's q, k and v, [B, S, heads x d] and [B, S, kv_heads x d] twice."""
        if self.fused:
            q, k, v = paddle.split(self.matmul(x, self.qkv, False), self.widths, axis=-1)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def output(self, x: paddle.Tensor) -> paddle.Tensor:
        """The attention's merged heads [B, S, heads x d] -> [B, S, H], summed over the ranks."""
        if self.fused:
            return self.ctx.all_reduce(self.matmul(x, self.o, False))
        return self.o_proj(x)

    def forward(
        self, x: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor], index: CacheIndex,
        mask: paddle.Tensor, cache_k: paddle.Tensor, cache_v: paddle.Tensor,
    ) -> paddle.Tensor:
        """x [B, S, H] written into the caches at `index` (cache_index), attending over the first
        mask.shape[-1] positions -> [B, S, H].

        Writes this step's keys and values into cache_k / cache_v in place.
        """
        q, k, v = self.project(x)
        q, k, v = (to_heads(q, self.heads, self.head_dim), to_heads(k, self.kv_heads, self.head_dim),
                   to_heads(v, self.kv_heads, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm_eps)
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rotary_embedding(q, *rope, self.rope_layout)
        k = self.rotary_embedding(k, *rope, self.rope_layout)
        write_cache(cache_k, k, index)
        write_cache(cache_v, v, index)
        length = mask.shape[-1]
        out = self.attention(q, cache_k[:, :, :length], cache_v[:, :, :length], mask)
        return self.output(merge_heads(out))
