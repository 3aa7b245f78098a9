"""Registers qwen3 and its graph-clear hook (no paddle import here)."""

import importlib
import sys

from fd_core import Architecture, hookimpl

FD_CONTRACT = "1.5"

PRESET = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "initializer_range": 0.2,
}

# Odd sizes the model suite checks too: three queries a key head, untied output head, three layers, another theta.
ODD_PRESET = {
    **PRESET, "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
    "head_dim": 8, "intermediate_size": 96, "tie_word_embeddings": False, "rope_theta": 5000000.0,
}

# transformers' Qwen3Config defaults for every key the decoder read, as the docs said to copy them (it has no
# mlp_bias: Qwen3's MLP has no bias).
QWEN3_DEFAULTS = {
    "num_key_value_heads": 32, "head_dim": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768, "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
}


def build(config, ctx):
    return importlib.import_module("fd_qwen3.model").build(config, ctx)


@hookimpl
def fd_clear_graphs(model):
    """Drop a qwen3 model's captured decode graphs; None for other models."""
    module = sys.modules.get("fd_qwen3.model")
    if module is None or not isinstance(model, module.Qwen3ForCausalLM):
        return None
    model.clear_graph_opt_backend()
    return True


@hookimpl
def fd_register_models(register):
    register(Architecture(
        name="qwen3", aliases=("Qwen3ForCausalLM",), build=build, preset=PRESET,
        graph_capable=True, config_defaults=QWEN3_DEFAULTS, reference="Qwen3ForCausalLM", odd_preset=ODD_PRESET,
        description="Qwen3 text models from fd's layers",
    ))
