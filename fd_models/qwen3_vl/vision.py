"""Qwen3-VL's vision tower as published: patch embedding, interpolated learned positions, 2-D rotary
attention blocks, the 2x2 patch merger and the DeepStack mergers (patches come from layers.vision.patchify).

The tower is replicated on every tp rank and runs only at prefill (eagerly), so shapes may depend
on the image. Weight names follow the published checkpoints under `model.visual.`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fd_core import WeightSpec
from fd_core.models import host_tensor
from fd_models.layers.norm import LayerNorm
from fd_models.layers.parallel import ReplicatedLinear
from fd_models.layers.params import new_param
from fd_models.layers.vision import VisionBlock, axial_rope, block_order_positions
from fd_models.qwen3_vl.config import VisionConfig

_EPS = 1e-6


def interpolation_taps(gh: int, gw: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices [N, 4] into the side x side learned position table and bilinear weights [N, 4] (align_corners=True)."""
    pos = block_order_positions(gh, gw, merge)

    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        src = index.astype(np.float32) * (side - 1) / max(size - 1, 1)
        floor = np.floor(src)
        taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
        weights = np.clip(1.0 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0.0, None)
        return taps, weights.astype(np.float32)

    h_taps, h_weights = axis(pos[:, 0], gh)
    w_taps, w_weights = axis(pos[:, 1], gw)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


class PatchMerger(nn.Layer):
    """Each 2x2 block of patches concatenated, normalised (before or after the concatenation),
    then an MLP to the text width."""

    def __init__(self, config: VisionConfig, ctx: Any, dtype: str, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = LayerNorm(self.merged if postshuffle_norm else config.hidden_size, _EPS, dtype)
        self.linear_fc1 = ReplicatedLinear(self.merged, self.merged, ctx, True, dtype)
        self.linear_fc2 = ReplicatedLinear(self.merged, config.out_hidden_size, ctx, True, dtype)
        self.gelu = ctx.ops.gelu

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = (self.norm(x.reshape([-1, self.merged])) if self.postshuffle_norm
             else self.norm(x).reshape([-1, self.merged]))
        return self.linear_fc2(self.gelu(self.linear_fc1(x), "none"))


class Qwen3VLVisionModel(nn.Layer):
    """The published Qwen3-VL vision tower (checkpoint prefix `model.visual.`)."""

    def __init__(self, config: VisionConfig, ctx: Any, dtype: str = "float32") -> None:
        super().__init__()
        self.config = config
        self.matmul = ctx.ops.matmul
        # A Conv3d whose stride equals its kernel is a matrix product over flattened patches;
        # the published weight keeps the Conv3d shape [hidden, C, T, p, p].
        conv = (config.hidden_size, config.in_channels, config.temporal_patch_size, config.patch_size,
                config.patch_size)
        self.patch_in = math.prod(conv[1:])
        self.patch_embed = nn.Layer()
        self.patch_embed.proj = nn.Layer()
        new_param(self.patch_embed.proj, WeightSpec(conv, None, dtype), 1)
        new_param(self.patch_embed.proj, WeightSpec((config.hidden_size,), None, dtype, init="zeros"), 1, attr="bias")
        self.pos_embed = nn.Layer()
        new_param(self.pos_embed, WeightSpec((config.num_position_embeddings, config.hidden_size), None, dtype), 1)
        self.side = math.isqrt(config.num_position_embeddings)
        self.blocks = nn.LayerList([
            VisionBlock(config.hidden_size, config.num_heads, config.intermediate_size, config.hidden_act, _EPS,
                        ctx, dtype, ("linear_fc1", "linear_fc2"))
            for _ in range(config.depth)
        ])
        self.merger = PatchMerger(config, ctx, dtype, postshuffle_norm=False)
        self.deepstack_merger_list = nn.LayerList(
            [PatchMerger(config, ctx, dtype, postshuffle_norm=True) for _ in config.deepstack_visual_indexes]
        )

    def forward(self, patches: paddle.Tensor, grid: tuple[int, int, int]) -> tuple[paddle.Tensor, list[paddle.Tensor]]:
        """patches [N, C*T*p*p] of one image -> (merged embeddings [N / 4, text hidden],
        DeepStack features, each the same shape)."""
        _, gh, gw = grid
        weight = self.patch_embed.proj.weight.reshape([self.config.hidden_size, self.patch_in])
        x = self.matmul(patches.astype(weight.dtype), weight, True) + self.patch_embed.proj.bias
        indices, weights = interpolation_taps(gh, gw, self.config.spatial_merge_size, self.side)
        table = F.embedding(host_tensor(indices), self.pos_embed.weight)  # [N, 4, hidden]
        x = x + paddle.sum(table * host_tensor(weights).astype(table.dtype).unsqueeze(-1), axis=1)
        head_dim = self.config.hidden_size // self.config.num_heads
        rope = axial_rope(gh, gw, self.config.spatial_merge_size, head_dim, self.config.rope_theta)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope)
            if i in self.config.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack
