"""ERNIE-4.5 dense causal LM as published: RMSNorm, interleaved rope, GQA, SwiGLU, tied embeddings, optional biases."""

from __future__ import annotations

from typing import Any

from fd_core.config import ModelConfig
from fd_models.layers.decoder import CausalLM, DecoderOptions


class Ernie4_5ForCausalLM(CausalLM):  # noqa: N801 - the Hugging Face class name
    """ERNIE-4.5 text model; word embeddings are tied to the LM head when the config says so."""

    def __init__(self, config: ModelConfig, ctx: Any) -> None:
        super().__init__(config, ctx, DecoderOptions(qk_norm=False, rope_layout="interleaved"))


def build(config: ModelConfig, ctx: Any) -> Ernie4_5ForCausalLM:
    """Construct the model for this rank (weights are zero until load_weights)."""
    return Ernie4_5ForCausalLM(config, ctx)
