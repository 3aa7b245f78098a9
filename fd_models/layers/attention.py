"""Grouped-query attention over the paged KV cache; rotary embedding, the cache write and attention itself are the
Backend's named ops (fd_core.kernels), resolved once per layer.

The cache's layout is the platform's (its `allocate_kv_cache`): this layer never indexes it. A step writes its
new keys and values with `write_kv_cache` at the slots the runtime chose, then attends with `paged_attention`
(a decode step: one query a row), `paged_prefill_attention` (new tokens, causally over their sequence's cached
prefix and themselves) or `paged_packed_attention` (rows of any lengths packed end to end: a mixed prefill and decode
step), each row through its block table.

Without biases q, k and v are one [hidden, (heads + 2 kv_heads) x d / tp] matrix and o is stored
[heads x d / tp, hidden] (as the MLP's gate/up and down: one product instead of three, in the layout
Paddle's CPU product reads fastest); the checkpoint names and layout are unchanged.

Queries stay token-major [B, S, heads, d], as the projection gives them and the paged ops take them; a decode
step (one token a row) reshapes between that and the rotary op's [B, heads, 1, d], the same memory order.
Paddle's CPU kernels copy a transposed view element by element (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle
from paddle import nn

from fd_core import WeightSpec
from fd_models.layers.norm import RMSNorm
from fd_models.layers.parallel import ColumnParallelLinear, RowParallelLinear
from fd_models.layers.params import new_columns_param
from fd_models.layers.products import Product


@dataclass
class KVStep:
    """One step's cache inputs as tensors, made once for every layer: where the new keys and values go
    (slot_mapping [B x S], or [T] packed), each row's blocks (block_tables [B, W]), and for a decode step each row's
    context (context_lens [B]) or for a prefill each row's cached prefix (prefix_lens [B]); a packed step (rows of new
    tokens end to end, x [1, T, H]) gives each row's first token (query_starts [B + 1]) and its context after the step
    (context_lens)."""

    slot_mapping: paddle.Tensor
    block_tables: paddle.Tensor
    context_lens: paddle.Tensor | None = None
    prefix_lens: paddle.Tensor | None = None
    query_starts: paddle.Tensor | None = None


def to_heads(x: paddle.Tensor, heads: int, head_dim: int) -> paddle.Tensor:
    """[B, S, heads * head_dim] -> [B, S, heads, head_dim] (a reshape)."""
    return x.reshape([0, 0, heads, head_dim])


def for_rotary(x: paddle.Tensor) -> paddle.Tensor:
    """[B, S, heads, d] as the rotary op takes it, [B, heads, S, d]: a reshape when S is 1, else a transposed view."""
    if x.shape[1] == 1:
        return x.reshape([0, x.shape[2], 1, x.shape[3]])
    return x.transpose([0, 2, 1, 3])


def from_rotary(x: paddle.Tensor) -> paddle.Tensor:
    """[B, heads, S, d] back to [B, S, heads, d]."""
    if x.shape[2] == 1:
        return x.reshape([0, 1, x.shape[1], x.shape[3]])
    return x.transpose([0, 2, 1, 3])


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
            self.qkv_product, self.o_product = Product(self, "qkv", False, ctx), Product(self, "o", False, ctx)
            self.widths = [self.heads * head_dim, self.kv_heads * head_dim, self.kv_heads * head_dim]
        else:
            self.q_proj = ColumnParallelLinear(hidden_size, heads * head_dim, ctx, bias, dtype)
            self.k_proj = ColumnParallelLinear(hidden_size, kv_heads * head_dim, ctx, bias, dtype)
            self.v_proj = ColumnParallelLinear(hidden_size, kv_heads * head_dim, ctx, bias, dtype)
            self.o_proj = RowParallelLinear(heads * head_dim, hidden_size, ctx, bias, dtype)
        # Qwen3 normalises each head's q and k before rope; the weights are per head_dim, replicated.
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, ctx, dtype) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, ctx, dtype) if qk_norm_eps is not None else None
        ops = ctx.ops
        self.rotary_embedding, self.write_kv_cache = ops.rotary_embedding, ops.write_kv_cache
        self.paged_attention, self.paged_prefill_attention = ops.paged_attention, ops.paged_prefill_attention
        self.paged_packed_attention = ops.paged_packed_attention

    def project(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """x [B, S, H] -> this rank's q, k and v, [B, S, heads x d] and [B, S, kv_heads x d] twice."""
        if self.fused:
            q, k, v = paddle.split(self.qkv_product(x), self.widths, axis=-1)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def output(self, x: paddle.Tensor) -> paddle.Tensor:
        """The attention's merged heads [B, S, heads x d] -> [B, S, H], summed over the ranks."""
        if self.fused:
            return self.ctx.all_reduce(self.o_product(x))
        return self.o_proj(x)

    def forward(
        self, x: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor], step: KVStep, cache_k: paddle.Tensor,
        cache_v: paddle.Tensor,
    ) -> paddle.Tensor:
        """x [B, S, H]: its keys and values written into the caches at step.slot_mapping, its queries attending
        through each row's blocks -> [B, S, H]."""
        batch, length = x.shape[0], x.shape[1]
        q, k, v = self.project(x)
        q, k, v = (to_heads(q, self.heads, self.head_dim), to_heads(k, self.kv_heads, self.head_dim),
                   to_heads(v, self.kv_heads, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm_eps)
            q, k = self.q_norm(q), self.k_norm(k)
        q = from_rotary(self.rotary_embedding(for_rotary(q), *rope, self.rope_layout))
        k = from_rotary(self.rotary_embedding(for_rotary(k), *rope, self.rope_layout))
        tokens = batch * length
        self.write_kv_cache(k.reshape([tokens, self.kv_heads, self.head_dim]),
                            v.reshape([tokens, self.kv_heads, self.head_dim]), cache_k, cache_v, step.slot_mapping)
        if step.query_starts is not None:
            out = self.paged_packed_attention(q.reshape([tokens, self.heads, self.head_dim]), cache_k, cache_v,
                                              step.block_tables, step.query_starts, step.context_lens)
        elif step.context_lens is not None:
            out = self.paged_attention(q.reshape([batch, self.heads, self.head_dim]), cache_k, cache_v,
                                       step.block_tables, step.context_lens)
        else:
            out = self.paged_prefill_attention(q, cache_k, cache_v, step.block_tables, step.prefix_lens)
        return self.output(out.reshape([batch, length, self.heads * self.head_dim]))
