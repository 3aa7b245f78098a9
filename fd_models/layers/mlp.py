"""SwiGLU feed-forward: gate/up column-parallel, down row-parallel (one all-reduce per block)."""

from __future__ import annotations

from typing import Any

import paddle
from paddle import nn

from fd_models.layers.parallel import ColumnParallelLinear, RowParallelLinear


class SwiGLUMLP(nn.Layer):
    """down(silu(gate(x)) * up(x)); each rank holds intermediate_size / tp of the hidden units."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx: Any, bias: bool = False, dtype: str = "float32") -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, ctx, bias, dtype)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, ctx, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, ctx, bias, dtype)
        self.silu_and_mul = ctx.ops.silu_and_mul

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_proj(x), self.up_proj(x)))
