"""Vision-transformer pieces the published VL towers share: 2-D rotary positions in merge-block order,
bidirectional attention with a fused qkv projection, the MLP and the pre-norm block.

Vision weights are replicated on every tp rank (split_axis None) and the tower runs whole on each
rank, eagerly at prefill, with no communication: it is small next to the decoder, and sharding it
would add an all-reduce per block for little memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from paddle import nn

from fd_core.models import host_tensor
from fd_models.activations import GELU_FORMS, VISION_ACTIVATIONS
from fd_models.layers.norm import LayerNorm
from fd_models.layers.parallel import ReplicatedLinear


def patchify(image: np.ndarray, config: Any, temporal: int = 1) -> tuple[np.ndarray, tuple[int, int, int]]:
    """A normalised image [C, H, W] -> (patches [N, C*T*p*p], grid (1, h, w)) as the published processors order them.

    `temporal` is T, the frames a patch spans: a still image is repeated over them (Qwen3-VL's two; ERNIE's
    one). Patches are listed merge-block by merge-block (each merge x merge block of patches is contiguous).
    `config` is a VisionConfig (in_channels, patch_size, spatial_merge_size, unit).
    """
    channels, height, width = image.shape
    p, m, t = config.patch_size, config.spatial_merge_size, temporal
    if channels != config.in_channels:
        raise ValueError(f"image has {channels} channels, expected {config.in_channels}")
    if height % config.unit or width % config.unit or height == 0 or width == 0:
        raise ValueError(
            f"image {height}x{width} is not a multiple of {config.unit} (patch {p} x merge {m}) on each side; resize it"
        )
    frames = np.repeat(image.astype(np.float32)[None], t, axis=0)  # [T, C, H, W]
    gh, gw = height // p, width // p
    blocks = frames.reshape(1, t, channels, gh // m, m, p, gw // m, m, p)
    blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # grid_t, bh, bw, mh, mw, C, T, p, p
    return np.ascontiguousarray(blocks.reshape(gh * gw, channels * t * p * p)), (1, gh, gw)


def activate(x: paddle.Tensor, act: str, gelu: Any) -> paddle.Tensor:
    """The activations the published vision configs name, each a form of the Backend's `gelu` op (`ctx.ops.gelu`,
    passed as `gelu`)."""
    if act in GELU_FORMS:
        return gelu(x, GELU_FORMS[act])
    raise ValueError(f"vision hidden_act {act!r} is not supported; use one of {', '.join(sorted(VISION_ACTIVATIONS))}")


def block_order_positions(gh: int, gw: int, merge: int) -> np.ndarray:
    """(row, col) of each patch [gh * gw, 2] in the merge-block order processors list patches in.

    Each merge x merge block of patches is contiguous, blocks row-major, so that merging is a reshape.
    """
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    shape = (gh // merge, merge, gw // merge, merge)
    return np.stack([a.reshape(shape).transpose(0, 2, 1, 3).reshape(-1) for a in (rows, cols)], axis=-1)


def axial_rope(gh: int, gw: int, merge: int, head_dim: int, theta: float) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos, sin [N, head_dim / 2] of the axial 2-D rope: the first half of the frequencies follow the
    row, the second the column."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim // 2, 2, dtype=np.float32) / (head_dim // 2)))
    pos = block_order_positions(gh, gw, merge).astype(np.float32)
    freqs = np.concatenate([pos[:, :1] * inv_freq[:quarter], pos[:, 1:] * inv_freq[:quarter]], axis=-1)
    return host_tensor(np.cos(freqs)), host_tensor(np.sin(freqs))


class VisionAttention(nn.Layer):
    """Bidirectional attention over one image's patches, rotary on q and k (rotate-half layout)."""

    def __init__(self, size: int, heads: int, ctx: Any, dtype: str) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, size // heads
        self.rotary_embedding, self.attention = ctx.ops.rotary_embedding, ctx.ops.attention
        self.qkv = ReplicatedLinear(size, 3 * size, ctx, True, dtype)
        self.proj = ReplicatedLinear(size, size, ctx, True, dtype)

    def forward(self, x: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor]) -> paddle.Tensor:
        """x [N, size] -> [N, size]."""
        qkv = self.qkv(x).reshape([1, -1, 3, self.heads, self.head_dim]).transpose([2, 0, 3, 1, 4])
        q, k = self.rotary_embedding(qkv[0], *rope, "half"), self.rotary_embedding(qkv[1], *rope, "half")
        out = self.attention(q, k, qkv[2], None)  # [1, heads, N, head_dim]
        return self.proj(out.transpose([0, 2, 1, 3]).reshape([x.shape[0], -1]))


class VisionMLP(nn.Layer):
    """fc2(act(fc1(x))), its two linears named as the checkpoint names them."""

    def __init__(
        self, size: int, hidden: int, act: str, ctx: Any, dtype: str, names: tuple[str, str] = ("fc1", "fc2"),
    ) -> None:
        super().__init__()
        self.act, self.names = act, names
        self.gelu = ctx.ops.gelu
        self.add_sublayer(names[0], ReplicatedLinear(size, hidden, ctx, True, dtype))
        self.add_sublayer(names[1], ReplicatedLinear(hidden, size, ctx, True, dtype))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        first, second = (getattr(self, n) for n in self.names)
        return second(activate(first(x), self.act, self.gelu))


class VisionBlock(nn.Layer):
    """Pre-norm ViT block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(
        self, size: int, heads: int, intermediate: int, act: str, eps: float, ctx: Any, dtype: str,
        mlp_names: tuple[str, str],
    ) -> None:
        super().__init__()
        self.norm1 = LayerNorm(size, eps, dtype)
        self.norm2 = LayerNorm(size, eps, dtype)
        self.attn = VisionAttention(size, heads, ctx, dtype)
        self.mlp = VisionMLP(size, intermediate, act, ctx, dtype, mlp_names)

    def forward(self, x: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor]) -> paddle.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))
