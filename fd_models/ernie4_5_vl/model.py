"""ERNIE-4.5-VL: quick-GELU ViT, projector (`model.resampler_model`) and the dense ERNIE-4.5 decoder."""

from __future__ import annotations

from typing import Any

from fd_core.config import ModelConfig
from fd_models.layers.decoder import DecoderOptions
from fd_models.layers.multimodal import VisionLanguageModel
from fd_models.layers.vision import VisionOptions


class Ernie4_5_VLMoeForConditionalGeneration(VisionLanguageModel):  # noqa: N801 - the Hugging Face class name
    """ERNIE-4.5-VL with a dense decoder standing in for the MoE one; `image=None` means text only."""

    renames = (("language_model.", ""), ("vision.", "vision_model."), ("projector.", "model.resampler_model."))

    def __init__(self, config: ModelConfig, ctx: Any) -> None:
        super().__init__(config, ctx, VisionOptions(act="quick_gelu"), DecoderOptions(qk_norm=False, rope_layout="interleaved"))


def build(config: ModelConfig, ctx: Any) -> Ernie4_5_VLMoeForConditionalGeneration:
    """Construct the model for this rank (weights are zero until load_weights)."""
    return Ernie4_5_VLMoeForConditionalGeneration(config, ctx)
