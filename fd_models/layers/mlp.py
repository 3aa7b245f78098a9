"""SwiGLU feed-forward: gate/up column-parallel, down row-parallel (one all-reduce per block).

Without biases the gate and up projections are one [hidden, 2 x intermediate / tp] matrix and the down
projection is stored [intermediate / tp, hidden]: one matrix-vector product instead of two, in the
layout Paddle's CPU product reads fastest (x @ W, not x @ W^T: measured faster for the block's
weights at batch 1 on the 0.3B shapes; docs/benchmarks.md has the figures). The checkpoint names and
their [out, in] layout are unchanged: loading transposes each shard into place.
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle import nn

from fd_core import WeightSpec
from fd_models.layers.parallel import ColumnParallelLinear, RowParallelLinear
from fd_models.layers.params import new_columns_param
from fd_models.layers.products import Product


class SwiGLUMLP(nn.Layer):
    """down(silu(gate(x)) * up(x)); each rank holds intermediate_size / tp of the hidden units."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, ctx: Any, bias: bool = False, dtype: str = "float32",
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.fused = not bias
        if self.fused:
            tp = ctx.parallel.tp_size
            gate, up = (WeightSpec((intermediate_size, hidden_size), 0, dtype) for _ in range(2))
            # Checkpoint names relative to this layer: `mlp.gate_proj.weight` and so on.
            new_columns_param(self, [("gate_proj.weight", gate), ("up_proj.weight", up)], tp, attr="gate_up")
            new_columns_param(self, [("down_proj.weight", WeightSpec((hidden_size, intermediate_size), 1, dtype))], tp,
                              attr="down")
            self.gate_up_product = Product(self, "gate_up", False, ctx)
            self.down_product = Product(self, "down", False, ctx)
        else:
            self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, ctx, bias, dtype)
            self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, ctx, bias, dtype)
            self.down_proj = RowParallelLinear(intermediate_size, hidden_size, ctx, bias, dtype)
        self.silu_and_mul = ctx.ops.silu_and_mul

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if not self.fused:
            return self.down_proj(self.silu_and_mul(self.gate_proj(x), self.up_proj(x)))
        gate, up = paddle.split(self.gate_up_product(x), 2, axis=-1)
        return self.ctx.all_reduce(self.down_product(self.silu_and_mul(gate, up)))
