"""Registers the ERNIE-4.5 dense architecture and its graph-clear hook (no paddle import here)."""

from __future__ import annotations

from typing import Any, Callable

from fd_core import Architecture, hookimpl
from fd_models._plugin import clear_graphs, lazy_build
from fd_models.presets import TINY_TEXT

# The version of fd's plugin contract this plugin was written for (fd_core.contract).
FD_CONTRACT = "1.1"

_MODULE = "fd_models.ernie4_5.model"
TINY_PRESET: dict[str, Any] = dict(TINY_TEXT)
# transformers' Ernie4_5Config defaults, for keys a config.json may omit.
CONFIG_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 2, "head_dim": 128, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "use_bias": False, "hidden_act": "silu",
}
build = lazy_build(_MODULE)


@hookimpl
def fd_clear_graphs(model: Any) -> bool | None:
    """Drop an ERNIE-4.5 model's captured decode graphs; None for other models."""
    return clear_graphs(model, _MODULE, "Ernie4_5ForCausalLM")


ARCHITECTURE = Architecture(
    name="ernie4_5", aliases=("Ernie4_5ForCausalLM",),
    build=build, preset=TINY_PRESET, graph_capable=True, quantizable=True, multimodal=False,
    config_defaults=CONFIG_DEFAULTS,
    description="ERNIE-4.5 dense decoder as published (ERNIE-4.5-0.3B): interleaved rope, GQA, SwiGLU, tied embeddings")


@hookimpl
def fd_register_models(register: Callable[[Architecture], None]) -> None:
    """Provide `ernie4_5` (alias Ernie4_5ForCausalLM)."""
    register(ARCHITECTURE)
