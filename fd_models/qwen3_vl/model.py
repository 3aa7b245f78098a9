"""Qwen3-VL: tanh-GELU ViT with learned positions, merger, and the decoder with per-head q/k RMSNorm."""

from __future__ import annotations

from typing import Any

from fd_core.config import ModelConfig
from fd_models.layers.decoder import DecoderOptions
from fd_models.layers.multimodal import VisionLanguageModel
from fd_models.layers.vision import VisionOptions


class Qwen3VLForConditionalGeneration(VisionLanguageModel):
    """Qwen3-VL with 1-D rope standing in for M-RoPE; `image=None` means text only."""

    renames = (
        ("language_model.model.", "model.language_model."),
        ("language_model.", ""),
        ("vision.", "model.visual."),
        ("projector.", "model.visual.merger."),
    )

    def __init__(self, config: ModelConfig, ctx: Any) -> None:
        super().__init__(config, ctx, VisionOptions(act="gelu_tanh", pos_embed=True), DecoderOptions(qk_norm=True))


def build(config: ModelConfig, ctx: Any) -> Qwen3VLForConditionalGeneration:
    """Construct the model for this rank (weights are zero until load_weights)."""
    return Qwen3VLForConditionalGeneration(config, ctx)
