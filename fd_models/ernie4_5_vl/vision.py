"""ERNIE-4.5-VL's vision tower and resampler as published (patches come from layers.vision.patchify).

Tower: a bias-free linear patch embedding, ViT blocks with 2-D rotary attention and quick-GELU,
a final LayerNorm (`model.vision_model.`). Resampler (`model.resampler_model.`): each 2x2 block of
patches concatenated through a spatial MLP, an image duplicated along time through the temporal
MLP, then a linear to the text width and an RMSNorm. Replicated on every rank; prefill only.
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle import nn

from fd_core import WeightSpec
from fd_models.ernie4_5_vl.config import VisionConfig
from fd_models.layers.norm import LayerNorm, RMSNorm
from fd_models.layers.parallel import ReplicatedLinear
from fd_models.layers.params import new_param
from fd_models.layers.vision import VisionBlock, axial_rope


class VisionTransformer(nn.Layer):
    """The tower (checkpoint prefix `model.vision_model.`)."""

    def __init__(self, config: VisionConfig, ctx: Any, dtype: str = "float32") -> None:
        super().__init__()
        self.config = config
        self.matmul = ctx.ops.matmul
        self.patch_embed = nn.Layer()
        self.patch_embed.proj = nn.Layer()
        new_param(self.patch_embed.proj,
                  WeightSpec((config.hidden_size, config.in_channels * config.patch_size**2), None, dtype), 1)
        self.blocks = nn.LayerList([
            VisionBlock(config.hidden_size, config.num_heads, config.intermediate_size, config.hidden_act,
                        config.rms_norm_eps, ctx, dtype, ("fc1", "fc2"))
            for _ in range(config.depth)
        ])
        self.ln = LayerNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, patches: paddle.Tensor, grid: tuple[int, int, int]) -> paddle.Tensor:
        """patches [N, C*p*p] of one image -> features [N, hidden]."""
        _, gh, gw = grid
        x = self.matmul(patches.astype(self.patch_embed.proj.weight.dtype), self.patch_embed.proj.weight, True)
        rope = axial_rope(gh, gw, self.config.spatial_merge_size, self.config.hidden_size // self.config.num_heads,
                          self.config.rope_theta)
        for block in self.blocks:
            x = block(x, rope)
        return self.ln(x)


class _ResamplerMLP(nn.Layer):
    """fc1 (`0`), GELU (erf), fc2 (`2`), LayerNorm (`3`): the published sequential's indices are its names."""

    def __init__(self, in_dim: int, out_dim: int, eps: float, ctx: Any, dtype: str) -> None:
        super().__init__()
        self.gelu = ctx.ops.gelu
        self.add_sublayer("0", ReplicatedLinear(in_dim, out_dim, ctx, True, dtype))
        self.add_sublayer("2", ReplicatedLinear(out_dim, out_dim, ctx, True, dtype))
        self.add_sublayer("3", LayerNorm(out_dim, eps, dtype))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        fc1, fc2, norm = (getattr(self, n) for n in ("0", "2", "3"))
        return norm(fc2(self.gelu(fc1(x), "none")))


class Resampler(nn.Layer):
    """Merges each 2x2 block of patch features into one text-width embedding (checkpoint
    prefix `model.resampler_model.`)."""

    def __init__(
        self, vision: VisionConfig, text_hidden: int, text_eps: float, ctx: Any, dtype: str = "float32",
    ) -> None:
        super().__init__()
        self.spatial_dim = vision.hidden_size * vision.spatial_merge_size**2
        self.spatial_linear = _ResamplerMLP(self.spatial_dim, self.spatial_dim, vision.rms_norm_eps, ctx, dtype)
        self.temporal_linear = _ResamplerMLP(self.spatial_dim * vision.temporal_merge_size, self.spatial_dim,
                                             vision.rms_norm_eps, ctx, dtype)
        self.mlp = ReplicatedLinear(self.spatial_dim, text_hidden, ctx, True, dtype)
        self.after_norm = RMSNorm(text_hidden, text_eps, ctx, dtype)

    def forward(self, features: paddle.Tensor) -> paddle.Tensor:
        """features [N, vision hidden] of one still image -> [N / 4, text hidden]."""
        x = self.spatial_linear(features.reshape([-1, self.spatial_dim]))
        # A still image is one frame: the temporal merge pairs it with itself.
        x = self.temporal_linear(paddle.concat([x, x], axis=-1))
        return self.after_norm(self.mlp(x))
