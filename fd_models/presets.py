"""Tiny Hugging-Face-style presets (plain dicts, no paddle): seconds on 2 CPU cores, divisible by tp=2."""

from __future__ import annotations

from typing import Any

TINY_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    # Wider than the usual 0.02 so that a random tiny model's greedy tokens vary from step to step.
    "initializer_range": 0.2,
}

# A 3x32x32 image in 8x8 patches: 16 patch embeddings, i.e. 16 image tokens in the prompt.
TINY_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "intermediate_size": 64,
    "patch_size": 8,
    "image_size": 32,
    "in_channels": 3,
}


def vl_preset(image_token_id: int, **overrides: Any) -> dict[str, Any]:
    """The tiny text preset plus a vision tower and the prompt's image placeholder token id."""
    return {**TINY_TEXT, "vision_config": dict(TINY_VISION), "image_token_id": image_token_id, **overrides}
