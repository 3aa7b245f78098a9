"""Replicated normalisation layers whose weights carry checkpoint specs (weight init "ones")."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from fd_core import WeightSpec
from fd_models.layers.params import new_param


class RMSNorm(nn.Layer):
    """weight * (x / rms(x)), the normalisation in float32 and cast back before the weight, as the references do."""

    def __init__(self, size: int, eps: float, dtype: str = "float32") -> None:
        super().__init__()
        self.eps = eps
        new_param(self, WeightSpec((size,), None, dtype, init="ones"), 1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x32 = x.astype("float32")
        x32 = x32 * paddle.rsqrt(paddle.mean(x32 * x32, axis=-1, keepdim=True) + self.eps)
        return x32.astype(x.dtype) * self.weight


class LayerNorm(nn.Layer):
    """Standard LayerNorm with weight ("ones") and bias ("zeros"), as ViT blocks use."""

    def __init__(self, size: int, eps: float, dtype: str = "float32") -> None:
        super().__init__()
        self.size, self.eps = size, eps
        new_param(self, WeightSpec((size,), None, dtype, init="ones"), 1)
        new_param(self, WeightSpec((size,), None, dtype, init="zeros"), 1, attr="bias")

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return F.layer_norm(x, [self.size], self.weight, self.bias, self.eps)
