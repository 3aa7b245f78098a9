"""Registers the Qwen3-VL architecture and its graph-clear hook (no paddle import here)."""

from __future__ import annotations

from typing import Any, Callable

from fd_core import Architecture, hookimpl
from fd_models._plugin import clear_graphs, lazy_build
from fd_models.presets import vl_preset

_MODULE = "fd_models.qwen3_vl.model"
# Untied LM head (its own column-parallel `lm_head.weight`), unlike ERNIE.
TINY_PRESET: dict[str, Any] = vl_preset(image_token_id=510, tie_word_embeddings=False, rope_theta=1000000.0)
build = lazy_build(_MODULE)


@hookimpl
def fd_clear_graphs(model: Any) -> bool | None:
    """Drop a Qwen3-VL model's graphs, which its language model holds; None for other models."""
    return clear_graphs(model, _MODULE, "Qwen3VLForConditionalGeneration", via="language_model")


ARCHITECTURE = Architecture(
    name="qwen3_vl", aliases=("Qwen3VLForConditionalGeneration",),
    build=build, preset=TINY_PRESET, graph_capable=True, multimodal=True,
    description="Qwen3-VL: replicated ViT + merger + decoder with per-head q/k RMSNorm")


@hookimpl
def fd_register_models(register: Callable[[Architecture], None]) -> None:
    """Provide `qwen3_vl` (alias Qwen3VLForConditionalGeneration)."""
    register(ARCHITECTURE)
