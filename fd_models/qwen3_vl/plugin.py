"""Registers the Qwen3-VL architecture and its graph-clear hook (no paddle import here)."""

from __future__ import annotations

from typing import Any, Callable

from fd_core import Architecture, hookimpl
from fd_models._plugin import clear_graphs, lazy_build
from fd_models.presets import TINY_QWEN3_VL, TINY_QWEN3_VL_PREPROCESSOR
from fd_models.qwen3_vl.config import check_config, check_prompt, image_tokens

# The version of fd's plugin contract this plugin was written for (fd_core.contract).
FD_CONTRACT = "1.1"

_MODULE = "fd_models.qwen3_vl.model"
# Untied LM head (its own vocab-parallel `lm_head.weight`) in the tiny preset, unlike ERNIE.
TINY_PRESET: dict[str, Any] = TINY_QWEN3_VL
# transformers' Qwen3VLTextConfig / Qwen3VLConfig defaults, for keys a config.json may omit (Qwen3-VL has no MLP bias).
CONFIG_DEFAULTS: dict[str, Any] = {
    "head_dim": 128, "num_key_value_heads": 32, "rope_theta": 500000.0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 128000, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "tie_word_embeddings": False,
}
build = lazy_build(_MODULE)


@hookimpl
def fd_clear_graphs(model: Any) -> bool | None:
    """Drop a Qwen3-VL model's graphs, which its language model holds; None for other models."""
    return clear_graphs(model, _MODULE, "Qwen3VLForConditionalGeneration", via="language_model")


ARCHITECTURE = Architecture(
    name="qwen3_vl", aliases=("Qwen3VLForConditionalGeneration",),
    build=build, preset=TINY_PRESET, graph_capable=True, quantizable=True, multimodal=True,
    config_defaults=CONFIG_DEFAULTS,
    preset_files={"preprocessor_config.json": TINY_QWEN3_VL_PREPROCESSOR},
    check_config=check_config, check_prompt=check_prompt, image_tokens=image_tokens,
    description="Qwen3-VL as published: ViT with 2-D rope, 2x2 merger, DeepStack, interleaved M-RoPE, "
                "decoder with q/k norm")


@hookimpl
def fd_register_models(register: Callable[[Architecture], None]) -> None:
    """Provide `qwen3_vl` (alias Qwen3VLForConditionalGeneration)."""
    register(ARCHITECTURE)
