"""Tiny presets as published `config.json` files (plain dicts, no paddle): seconds on 2 CPU cores, divisible by tp=2.

Each is what `fd save-random --model NAME` writes and what transformers' config class reads.
"""

from __future__ import annotations

from typing import Any

# Sizes shared by the tiny decoders.
_TINY_DECODER: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    # Wider than the usual 0.02 so that a random tiny model's greedy tokens vary from step to step.
    "initializer_range": 0.2,
}

TINY_TEXT: dict[str, Any] = {
    "architectures": ["Ernie4_5ForCausalLM"],
    "model_type": "ernie4_5",
    **_TINY_DECODER,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "tie_word_embeddings": True,
    "use_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# ERNIE-4.5-VL: a dense first layer, then two mixture-of-experts layers (4 text and 4 vision experts,
# top-2, one shared expert). A 32x32 image gives a 4x4 grid of 8x8 patches, merged 2x2 into 4 tokens.
TINY_ERNIE_VL: dict[str, Any] = {
    "architectures": ["Ernie4_5_VLMoeForConditionalGeneration"],
    "model_type": "ernie4_5_vl_moe",
    "image_token_id": 500,
    "image_start_token_id": 501,
    "image_end_token_id": 502,
    "video_token_id": 503,
    "video_start_token_id": 504,
    "video_end_token_id": 505,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "ernie4_5_vl_moe_text",
        **{k: v for k, v in _TINY_DECODER.items() if k != "head_dim"},
        "num_hidden_layers": 3,
        "use_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]},
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "moe_num_experts": 4,
        "moe_k": 2,
        "moe_intermediate_size": [32, 16],
        "moe_num_shared_experts": 1,
        "moe_norm_min": 1e-12,
    },
    "vision_config": {
        "model_type": "ernie4_5_vl_moe_vision",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_merge_size": 2,
        "hidden_act": "quick_gelu",
        "rms_norm_eps": 1e-6,
    },
}

# Qwen3-VL: a nested text_config and vision_config, as transformers writes them. A 32x32 image
# gives a 4x4 grid of 8x8 patches, merged 2x2 into 4 image tokens.
TINY_QWEN3_VL: dict[str, Any] = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "image_token_id": 510,
    "video_token_id": 511,
    "vision_start_token_id": 508,
    "vision_end_token_id": 509,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_vl_text",
        **_TINY_DECODER,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3],
                            "mrope_interleaved": True},
    },
    "vision_config": {
        "model_type": "qwen3_vl_vision",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 8,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0, 1],
        "hidden_act": "gelu_pytorch_tanh",
        "initializer_range": 0.2,
    },
}

# The tiny models' preprocessor_config.json: small images stay small (the published limits would
# upscale a 32x32 picture to 65536 pixels).
TINY_QWEN3_VL_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 8, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 256, "longest_edge": 16384},
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
TINY_ERNIE_VL_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Ernie4_5_VLMoeImageProcessor",
    "patch_size": 8, "merge_size": 2,
    "size": {"shortest_edge": 256, "longest_edge": 16384},
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
}
