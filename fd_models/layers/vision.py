"""The ViT vision tower and projector shared by the VL architectures, with options for their differences.

Vision weights are replicated on every tp rank (split_axis None) and the tower runs whole on each
rank, with no communication: it is small next to the decoder, and sharding it would add an
all-reduce per block for little memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fd_core.weights import WeightSpec
from fd_models.layers.attention import attend, merge_heads
from fd_models.layers.norm import LayerNorm
from fd_models.layers.params import new_param
from fd_models.layers.parallel import ReplicatedLinear

_EPS = 1e-6


@dataclass(frozen=True)
class VisionOptions:
    """What differs between the vision towers of the VL architectures."""

    act: str = "gelu"  # "gelu", "gelu_tanh" (Qwen3-VL) or "quick_gelu" (ERNIE-4.5-VL)
    pos_embed: bool = False  # learned absolute patch position embeddings (Qwen3-VL)


def _activate(x: paddle.Tensor, act: str) -> paddle.Tensor:
    if act == "quick_gelu":
        return x * F.sigmoid(1.702 * x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate=True)
    if act == "gelu":
        return F.gelu(x)
    raise ValueError(f"unknown vision activation {act!r}; use gelu, gelu_tanh or quick_gelu")


class FeedForward(nn.Layer):
    """fc2(act(fc1(x))), replicated."""

    def __init__(self, in_size: int, hidden: int, out_size: int, act: str, ctx: Any, dtype: str = "float32") -> None:
        super().__init__()
        self.act = act
        self.fc1 = ReplicatedLinear(in_size, hidden, ctx, True, dtype)
        self.fc2 = ReplicatedLinear(hidden, out_size, ctx, True, dtype)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc2(_activate(self.fc1(x), self.act))


class Projector(FeedForward):
    """LayerNorm then a two-layer MLP from the vision width to the text hidden size."""

    def __init__(self, vision_size: int, text_size: int, act: str, ctx: Any, dtype: str = "float32") -> None:
        super().__init__(vision_size, text_size, text_size, act, ctx, dtype)
        self.norm = LayerNorm(vision_size, _EPS, dtype)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return super().forward(self.norm(x))


class VisionAttention(nn.Layer):
    """Bidirectional multi-head self-attention over the patches, with a fused qkv projection."""

    def __init__(self, size: int, heads: int, ctx: Any, dtype: str = "float32") -> None:
        super().__init__()
        self.heads, self.head_dim = heads, size // heads
        self.qkv = ReplicatedLinear(size, 3 * size, ctx, True, dtype)
        self.proj = ReplicatedLinear(size, size, ctx, True, dtype)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        qkv = self.qkv(x).reshape([0, 0, 3, self.heads, self.head_dim]).transpose([2, 0, 3, 1, 4])
        return self.proj(merge_heads(attend(qkv[0], qkv[1], qkv[2], None)))


class VisionBlock(nn.Layer):
    """Pre-norm ViT block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, size: int, heads: int, intermediate: int, act: str, ctx: Any, dtype: str = "float32") -> None:
        super().__init__()
        self.norm1 = LayerNorm(size, _EPS, dtype)
        self.attn = VisionAttention(size, heads, ctx, dtype)
        self.norm2 = LayerNorm(size, _EPS, dtype)
        self.mlp = FeedForward(size, intermediate, size, act, ctx, dtype)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Layer):
    """Non-overlapping p x p patches, flattened (C, p, p) and projected by a Linear (a Conv2D in matrix form)."""

    def __init__(self, in_channels: int, patch_size: int, size: int, ctx: Any, dtype: str = "float32") -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = ReplicatedLinear(in_channels * patch_size * patch_size, size, ctx, True, dtype)

    def forward(self, image: paddle.Tensor) -> paddle.Tensor:
        """image [B, C, H, W] -> [B, (H/p) * (W/p), size], patches in row-major order."""
        b, c, h, w = image.shape
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(f"image {h}x{w} is not a multiple of the patch size {p}")
        patches = image.reshape([b, c, h // p, p, w // p, p]).transpose([0, 2, 4, 1, 3, 5])
        return self.proj(patches.reshape([b, (h // p) * (w // p), c * p * p]))


class VisionEncoder(nn.Layer):
    """Patch embedding, optional learned positions and ViT blocks; replicated on every rank."""

    def __init__(self, vision_config: Mapping[str, Any], options: VisionOptions, ctx: Any, dtype: str = "float32") -> None:
        super().__init__()
        size, patch = vision_config["hidden_size"], vision_config["patch_size"]
        self.num_patches = (vision_config["image_size"] // patch) ** 2
        self.patch_embed = PatchEmbed(vision_config.get("in_channels", 3), patch, size, ctx, dtype)
        self.pos_embed = None
        if options.pos_embed:
            new_param(self, WeightSpec((self.num_patches, size), None, dtype), 1, attr="pos_embed")
        intermediate = vision_config.get("intermediate_size", 4 * size)
        self.blocks = nn.LayerList(
            [VisionBlock(size, vision_config["num_heads"], intermediate, options.act, ctx, dtype) for _ in range(vision_config["num_layers"])]
        )

    def forward(self, image: paddle.Tensor) -> paddle.Tensor:
        """image [B, C, H, W] float32 -> patch features [B, num_patches, vision hidden]."""
        x = self.patch_embed(image)
        if self.pos_embed is not None:
            if x.shape[1] != self.num_patches:
                raise ValueError(f"image gives {x.shape[1]} patches; learned positions need {self.num_patches}")
            x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return x


def splice_image(ids: np.ndarray, text: paddle.Tensor, image: paddle.Tensor, image_token_id: int | None) -> paddle.Tensor:
    """Text embeds [B, S, H] with image embeds [B, P, H] at the placeholder tokens, else prepended.

    A prompt either holds exactly P `image_token_id` placeholders in every row (each is replaced, in
    order, by one image embedding) or none at all (the image embeddings go before the text).
    """
    batch, length = ids.shape
    patches = image.shape[1]
    slots = ids == image_token_id if image_token_id is not None else np.zeros(ids.shape, dtype=bool)
    counts = slots.sum(axis=1)
    if not counts.any():
        return paddle.concat([image, text], axis=1)
    if not (counts == patches).all():
        raise ValueError(f"every prompt needs {patches} image placeholder tokens ({image_token_id}) or none; got {counts.tolist()}")
    # Gather from [text | image]: row s takes text s, or image k for the k-th placeholder.
    index = np.tile(np.arange(length), (batch, 1))
    index[slots] = length + np.tile(np.arange(patches), batch)
    gather = paddle.to_tensor(index).unsqueeze(-1).expand([batch, length, text.shape[-1]])
    return paddle.take_along_axis(paddle.concat([text, image], axis=1), gather, axis=1)
