"""Registers the ERNIE-4.5-VL architecture and its graph-clear hook (no paddle import here)."""

from __future__ import annotations

from typing import Any, Callable

from fd_core import Architecture, hookimpl
from fd_models._plugin import clear_graphs, lazy_build
from fd_models.presets import vl_preset

_MODULE = "fd_models.ernie4_5_vl.model"
TINY_PRESET: dict[str, Any] = vl_preset(
    image_token_id=500, architectures=["Ernie4_5_VLMoeForConditionalGeneration"], model_type="ernie4_5_vl_stand_in"
)
build = lazy_build(_MODULE)


@hookimpl
def fd_clear_graphs(model: Any) -> bool | None:
    """Drop an ERNIE-4.5-VL model's graphs, which its language model holds; None for other models."""
    return clear_graphs(model, _MODULE, "Ernie4_5_VLMoeForConditionalGeneration", via="language_model")


ARCHITECTURE = Architecture(
    name="ernie4_5_vl", aliases=("Ernie4_5_VLMoeForConditionalGeneration",),
    build=build, preset=TINY_PRESET, graph_capable=True, multimodal=True,
    description="ERNIE-4.5-VL: replicated ViT + projector + dense ERNIE-4.5 decoder")


@hookimpl
def fd_register_models(register: Callable[[Architecture], None]) -> None:
    """Provide `ernie4_5_vl` (alias Ernie4_5_VLMoeForConditionalGeneration)."""
    register(ARCHITECTURE)
