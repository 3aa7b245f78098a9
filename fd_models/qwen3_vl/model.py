"""Qwen3-VL as published: the vision tower, DeepStack, interleaved M-RoPE and the Qwen3 decoder with q/k norm.

A prompt without an image is the text alone (1-D rope, which M-RoPE reduces to). With an image, its
placeholder tokens (`image_token_id`, one per merged 2x2 patch block) take the tower's embeddings,
the DeepStack features are added after the first decoder layers at those tokens, and the rotary
positions follow the reference's `get_rope_index`; decode then continues at slot + rope delta.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import paddle
from paddle import nn

from fd_core.config import ModelConfig
from fd_core.models import GraphBackend
from fd_core.weights import WeightSpec
from fd_models.layers import params
from fd_models.layers.decoder import CausalLM, DecoderOptions, as_int64
from fd_models.qwen3_vl.config import VisionConfig
from fd_models.qwen3_vl.vision import Qwen3VLVisionModel, patchify


def mrope_positions(ids: np.ndarray, image_token_id: int, grid: tuple[int, int, int], merge: int) -> tuple[np.ndarray, int]:
    """Rotary positions [3, S] of one prompt holding one image, and the decode delta (as `get_rope_index`)."""
    slots = np.flatnonzero(ids == image_token_id)
    _, gh, gw = grid
    rows, cols = gh // merge, gw // merge
    if len(slots) != rows * cols or (len(slots) and slots[-1] - slots[0] + 1 != len(slots)):
        raise ValueError(
            f"the prompt needs one run of {rows * cols} image placeholder tokens ({image_token_id}) for this image; "
            f"it has {len(slots)}{'' if len(slots) < 2 or slots[-1] - slots[0] + 1 == len(slots) else ', not contiguous'}"
        )
    start = int(slots[0])
    positions = np.broadcast_to(np.arange(len(ids)), (3, len(ids))).copy()
    h, w = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    positions[0, start : start + rows * cols] = start
    positions[1, start : start + rows * cols] = start + h.reshape(-1)
    positions[2, start : start + rows * cols] = start + w.reshape(-1)
    after = start + max(rows, cols)
    positions[:, start + rows * cols :] = np.arange(after, after + len(ids) - start - rows * cols)
    return positions, int(positions.max()) + 1 - len(ids)


class Qwen3VLForConditionalGeneration(nn.Layer):
    """Qwen3-VL; `image=None` means a text-only prompt."""

    # (internal prefix, checkpoint prefix): the published names.
    renames = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("visual.", "model.visual."),
    )

    def __init__(self, config: ModelConfig, ctx: Any) -> None:
        super().__init__()
        self.config = config
        self.vision_config = VisionConfig.from_dict(config.extra["vision_config"])
        self.image_token_id: int = config.extra["image_token_id"]
        self.visual = Qwen3VLVisionModel(self.vision_config, ctx, config.dtype)
        self.language_model = CausalLM(config, ctx, DecoderOptions(qk_norm=True, rope_layout="half"))

    # -- weights -------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, WeightSpec]:
        """Every checkpoint tensor (vision ones replicated) with its full shape and tp split axis."""
        return params.weight_specs(self, self.renames)

    def ignored_tensors(self) -> set[str]:
        """A tied head's copy of the embedding may be present and is not loaded."""
        return self.language_model.ignored_tensors()

    def load_weights(self, shards: Mapping[str, Any]) -> None:
        params.load_weights(self, shards, self.renames)

    def release_weights(self) -> None:
        params.release_weights(self)

    # -- prefill and decode --------------------------------------------------------------
    def prefill_length(self, input_ids: Any, image: Any = None) -> int:
        """The prompt length: image tokens are placeholders in the prompt, nothing is prepended."""
        return int(np.asarray(input_ids).shape[1])

    def prefill(self, input_ids: Any, image: Any = None) -> paddle.Tensor:
        """Run the prompt [B, S], with `image` [B or 1, C, H, W] (values in [0, 1]) at its placeholders; last-position logits [B, vocab]."""
        ids = as_int64(input_ids)
        embeds = self.language_model.model.embed_tokens(ids)
        if image is None:
            return self.language_model.prefill_embeds(embeds)
        host_ids = ids.numpy()
        batch, length = host_ids.shape
        pixels = np.asarray(image.numpy() if isinstance(image, paddle.Tensor) else image, dtype=np.float32)
        if pixels.ndim != 4 or pixels.shape[0] not in (1, batch):
            raise ValueError(f"image must be [1 or {batch}, C, H, W], got {list(pixels.shape)}")
        merge = self.vision_config.spatial_merge_size
        features, positions, delta = [], None, 0
        for row in range(batch):
            if row == 0 or pixels.shape[0] > 1:
                patches, grid = patchify(pixels[min(row, pixels.shape[0] - 1)], self.vision_config)
                merged, deep = self.visual(paddle.to_tensor(patches), grid)
            row_positions, delta = mrope_positions(host_ids[row], self.image_token_id, grid, merge)
            if positions is not None and not np.array_equal(row_positions, positions):
                raise ValueError("every prompt of a batch must hold its image placeholders at the same positions")
            positions = row_positions
            features.append((merged, deep))
        slots = np.flatnonzero(host_ids[0] == self.image_token_id)
        embeds = _scatter(embeds, [f[0] for f in features], slots)
        zeros = paddle.zeros_like(embeds)
        deepstack = [_scatter(zeros, [f[1][i] for f in features], slots) for i in range(len(features[0][1]))]
        return self.language_model.prefill_embeds(embeds, positions, deepstack, delta)

    def allocate_cache(self, batch_size: int, max_len: int) -> None:
        self.language_model.allocate_cache(batch_size, max_len)

    def decode_step(self, token_ids: Any, position: int) -> paddle.Tensor:
        """One text token per sequence at cache slot `position` (its rotary position is offset by the image's delta)."""
        return self.language_model.decode_step(token_ids, position)

    def capture(self, graph_backend: GraphBackend, batch_size: int) -> None:
        """Capture the language model's decode step (graphs live on `self.language_model`)."""
        self.language_model.capture(graph_backend, batch_size)


def _scatter(base: paddle.Tensor, rows: list[paddle.Tensor], slots: np.ndarray) -> paddle.Tensor:
    """base [B, S, H] with positions `slots` of row b replaced by rows[b] [len(slots), H] (or rows[0] for every b)."""
    batch, length, hidden = base.shape
    # Gather from [base | image rows]: position s takes base s, or image row k for the k-th slot.
    index = np.tile(np.arange(length), (batch, 1))
    index[:, slots] = length + np.arange(len(slots))
    image = paddle.stack([rows[min(b, len(rows) - 1)].astype(base.dtype) for b in range(batch)])
    gather = paddle.to_tensor(index).unsqueeze(-1).expand([batch, length, hidden])
    return paddle.take_along_axis(paddle.concat([base, image], axis=1), gather, axis=1)


def build(config: ModelConfig, ctx: Any) -> Qwen3VLForConditionalGeneration:
    """Construct the model for this rank (weights are zero until load_weights)."""
    return Qwen3VLForConditionalGeneration(config, ctx)
