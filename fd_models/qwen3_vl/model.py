"""Qwen3-VL as published: the vision tower, DeepStack, interleaved M-RoPE and the Qwen3 decoder with q/k norm.

A prompt without an image is the text alone (1-D rope, which M-RoPE reduces to). With an image, its
placeholder tokens (`image_token_id`, one per merged 2x2 patch block) take the tower's embeddings,
the DeepStack features are added after the first decoder layers at those tokens, and the rotary
positions follow the reference's `get_rope_index`; decode then continues at slot + rope delta.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle

from fd_core.config import ModelConfig
from fd_core.kvcache import KVBatch
from fd_core.models import host_tensor
from fd_models.layers.decoder import CausalLM, DecoderOptions
from fd_models.layers.images import preprocess
from fd_models.layers.multimodal import scatter_rows
from fd_models.layers.vision import patchify
from fd_models.layers.vl_model import PictureTextModel
from fd_models.qwen3_vl.config import VisionConfig, image_settings
from fd_models.qwen3_vl.vision import Qwen3VLVisionModel


class Qwen3VLForConditionalGeneration(PictureTextModel):
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
        self.image_settings = image_settings(config, self.vision_config)
        self.visual = Qwen3VLVisionModel(self.vision_config, ctx, config.dtype)
        self.language_model = CausalLM(config, ctx, DecoderOptions(qk_norm=True, rope_layout="half"))

    def _prefill_pictures(
        self, host_ids: np.ndarray, embeds: paddle.Tensor, rows: list[list[paddle.Tensor]], slots: np.ndarray,
        positions: Any, batch: KVBatch,
    ) -> paddle.Tensor:
        """The decoder over the spliced prompt: the DeepStack features join after the first
        layers at the picture tokens."""
        zeros = paddle.zeros_like(embeds)
        deepstack = [scatter_rows(zeros, paddle.stack([row[i] for row in rows]), slots) for i in range(1, len(rows[0]))]
        return self.language_model.prefill_embeds(embeds, batch, positions, deepstack)

    def _encode(self, picture: np.ndarray) -> tuple[tuple[int, int, int], list[paddle.Tensor]]:
        """One picture -> (its grid, [merged embeddings, DeepStack features...])."""
        patches, grid = patchify(preprocess(picture, self.image_settings), self.vision_config,
                                 self.vision_config.temporal_patch_size)
        merged, deepstack = self.visual(host_tensor(patches), grid)
        return grid, [merged, *deepstack]


def build(config: ModelConfig, ctx: Any) -> Qwen3VLForConditionalGeneration:
    """Construct the model for this rank (weights are zero until load_weights)."""
    return Qwen3VLForConditionalGeneration(config, ctx)
