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
    cast back before the weight)."""

    def __init__(self, size: int, eps: float, ctx: Any, dtype: str = "float32") -> None:
        super().__init__()
        self.eps = eps
        # Resolved once: the call below is a direct call of the kernel the Backend chose.
        self.rms_norm = ctx.ops.rms_norm
        new_param(self, WeightSpec((size,), None, dtype, init="ones"), 1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Layer):
    """Standard LayerNorm with weight ("ones") and bias ("zeros"), as ViT blocks use."""

    def __init__(self, size: int, eps: float, dtype: str = "float32") -> None:
        super().__init__()
        self.size, self.eps = size, eps
        new_param(self, WeightSpec((size,), None, dtype, init="ones"), 1)
        new_param(self, WeightSpec((size,), None, dtype, init="zeros"), 1, attr="bias")

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return F.layer_norm(x, [self.size], self.weight, self.bias, self.eps)
