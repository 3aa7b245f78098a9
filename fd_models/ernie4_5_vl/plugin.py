"""Registers the ERNIE-4.5-VL architecture and its graph-clear hook (no paddle import here)."""

from __future__ import annotations

from typing import Any, Callable

from fd_core import Architecture, hookimpl
from fd_models._plugin import clear_graphs, lazy_build
from fd_models.ernie4_5_vl.config import (
    check_config,
    check_prompt,
    image_tokens,
    sharded_sizes,
)
from fd_models.presets import TINY_ERNIE_VL, TINY_ERNIE_VL_PREPROCESSOR

# The version of fd's plugin contract this plugin was written for (fd_core.contract).
FD_CONTRACT = "1.1"

_MODULE = "fd_models.ernie4_5_vl.model"
TINY_PRESET: dict[str, Any] = TINY_ERNIE_VL
# transformers' Ernie4_5_VLMoeTextConfig / Ernie4_5_VLMoeConfig defaults, for keys a config.json may omit.
CONFIG_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 4, "head_dim": None, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True, "use_bias": False, "hidden_act": "silu",
}
build = lazy_build(_MODULE)


@hookimpl
def fd_clear_graphs(model: Any) -> bool | None:
    """Drop an ERNIE-4.5-VL model's graphs, which its language model holds; None for other models."""
    return clear_graphs(model, _MODULE, "Ernie4_5_VLMoeForConditionalGeneration", via="language_model")


ARCHITECTURE = Architecture(
    name="ernie4_5_vl", aliases=("Ernie4_5_VLMoeForConditionalGeneration",),
    build=build, preset=TINY_PRESET, graph_capable=True, quantizable=True, multimodal=True,
    config_defaults=CONFIG_DEFAULTS,
    preset_files={"preprocessor_config.json": TINY_ERNIE_VL_PREPROCESSOR},
    check_config=check_config, check_prompt=check_prompt, image_tokens=image_tokens, sharded_sizes=sharded_sizes,
    description="ERNIE-4.5-VL as published: ViT with 2-D rope, resampler, 3-D rope, "
                "text and vision experts with shared experts")


@hookimpl
def fd_register_models(register: Callable[[Architecture], None]) -> None:
    """Provide `ernie4_5_vl` (alias Ernie4_5_VLMoeForConditionalGeneration)."""
    register(ARCHITECTURE)
