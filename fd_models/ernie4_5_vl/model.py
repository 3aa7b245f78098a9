"""ERNIE-4.5-VL as published: vision tower, resampler, and the ERNIE-4.5 decoder whose sparse layers are
modality-isolated mixtures of experts, with 3-D rotary positions.

A prompt without an image is the text alone (1-D interleaved rope, which the 3-D rope reduces to,
and every token through the text experts). With an image, its placeholder tokens take the
resampler's embeddings, those tokens and the image start/end tokens go to the vision experts, and
the rotary positions follow the reference's `get_rope_index`; decode then continues at slot + delta.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from paddle import nn

from fd_core.config import ModelConfig
from fd_core.kvcache import KVBatch
from fd_core.models import host_tensor
from fd_models.ernie4_5_vl.config import MoEConfig, VisionConfig, image_settings
from fd_models.ernie4_5_vl.vision import Resampler, VisionTransformer
from fd_models.layers.decoder import CausalLM, DecoderOptions
from fd_models.layers.images import preprocess
from fd_models.layers.mlp import SwiGLUMLP
from fd_models.layers.moe import MoEBlock
from fd_models.layers.vision import patchify
from fd_models.layers.vl_model import PictureTextModel


def _mlp(moe: MoEConfig) -> Any:
    """The feed-forward of decoder layer i: dense SwiGLU or the mixture of experts, as `mlp_layer_types` says."""

    def make(config: ModelConfig, ctx: Any, index: int) -> nn.Layer:
        if moe.layer_types[index] == "dense":
            return SwiGLUMLP(config.hidden_size, config.intermediate_size, ctx, config.mlp_bias, config.dtype)
        return MoEBlock(
            config.hidden_size, moe.intermediate, moe.experts, moe.top_k, moe.shared, moe.norm_min, ctx, config.dtype,
            config.mlp_bias
        )

    return make


class Ernie4_5_VLMoeForConditionalGeneration(PictureTextModel):  # noqa: N801 - the Hugging Face class name
    """ERNIE-4.5-VL (mixture of experts); `image=None` means a text-only prompt."""

    # (internal prefix, checkpoint prefix): the published names.
    renames = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_model.", "model.vision_model."),
        ("resampler_model.", "model.resampler_model."),
    )

    def __init__(self, config: ModelConfig, ctx: Any) -> None:
        super().__init__()
        self.config = config
        self.vision_config = VisionConfig.from_dict(config.extra["vision_config"])
        self.image_token_id: int = config.extra["image_token_id"]
        self.image_settings = image_settings(config, self.vision_config)
        # Tokens the reference routes to the vision experts: the placeholders and the image's start and end.
        self.vision_tokens = [config.extra[k] for k in ("image_token_id", "image_start_token_id", "image_end_token_id")]
        self.vision_model = VisionTransformer(self.vision_config, ctx, config.dtype)
        self.resampler_model = Resampler(self.vision_config, config.hidden_size, config.rms_norm_eps, ctx, config.dtype)
        options = DecoderOptions(qk_norm=False, rope_layout="interleaved", mrope_style="ernie",
                                 mlp=_mlp(MoEConfig.from_config(config)))
        self.language_model = CausalLM(config, ctx, options)

    def _prefill_pictures(
        self, host_ids: np.ndarray, embeds: paddle.Tensor, rows: list[list[paddle.Tensor]], slots: np.ndarray,
        positions: Any, batch: KVBatch,
    ) -> paddle.Tensor:
        """The decoder over the spliced prompt: picture tokens and the image start/end tokens go to the
        vision experts."""
        vision_mask = np.isin(host_ids, self.vision_tokens)
        return self.language_model.prefill_embeds(embeds, batch, positions, (), vision_mask)

    def _encode(self, picture: np.ndarray) -> tuple[tuple[int, int, int], list[paddle.Tensor]]:
        """One picture -> (its grid, [resampled embeddings])."""
        patches, grid = patchify(preprocess(picture, self.image_settings), self.vision_config)
        return grid, [self.resampler_model(self.vision_model(host_tensor(patches), grid))]


def build(config: ModelConfig, ctx: Any) -> Ernie4_5_VLMoeForConditionalGeneration:
    """Construct the model for this rank (weights are zero until load_weights)."""
    return Ernie4_5_VLMoeForConditionalGeneration(config, ctx)
