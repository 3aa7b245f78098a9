"""Replicated normalisation layers whose weights carry checkpoint specs (weight init "ones")."""

from __future__ import annotations

from typing import Any

import paddle
import paddle.nn.functional as F
from paddle import nn

from fd_core import WeightSpec
from fd_models.layers.params import new_param


class RMSNorm(nn.Layer):
    """weight * (x / rms(x)) through the Backend's `rms_norm` op (fd_core.kernels: float32 statistics,
    cast back before the weight); `add_and_norm` adds a residual first, through `add_rms_norm`."""

    def __init__(self, size: int, eps: float, ctx: Any, dtype: str = "float32") -> None:
        super().__init__()
        self.eps = eps
        # Resolved once: the calls below are direct calls of the kernels the Backend chose.
        self.rms_norm, self.add_rms_norm = ctx.ops.rms_norm, ctx.ops.add_rms_norm
        new_param(self, WeightSpec((size,), None, dtype, init="ones"), 1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: paddle.Tensor, residual: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(this norm of x + residual, x + residual): a sublayer's output added to the residual stream, and the
        next sublayer's input, in one op."""
        return self.add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Layer):
    """Standard LayerNorm with weight ("ones") and bias ("zeros"), as ViT blocks use."""

    def __init__(self, size: int, eps: float, dtype: str = "float32") -> None:
        super().__init__()
        self.size, self.eps = size, eps
        new_param(self, WeightSpec((size,), None, dtype, init="ones"), 1)
        new_param(self, WeightSpec((size,), None, dtype, init="zeros"), 1, attr="bias")

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return F.layer_norm(x, [self.size], self.weight, self.bias, self.eps)
