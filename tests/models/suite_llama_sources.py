"""A Llama model package written as a third party would (fd's shared decoder), and deliberately broken variants of it.

Each variant breaks one thing the model suite checks; tests/models/test_model_suite_catches.py proves
that the check fails on it, by name.
"""

PLUGIN = '''
import importlib
import sys

from fd_core import Architecture, hookimpl

PRESET = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.2,
}
# transformers' LlamaConfig defaults (null: as many kv heads as heads; head_dim hidden / heads).
DEFAULTS = {
    "num_key_value_heads": None, "head_dim": None, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "hidden_act": "silu",
}
VARIANTS = ("good", "bad_rope", "no_reduce", "graph_drift", "clear_noop", "reload_drift", "one_position", "prefix_blind")


def _build(variant):
    return lambda config, ctx: importlib.import_module("fd_suite_llama_model").build(variant, config, ctx)


@hookimpl
def fd_clear_graphs(model):
    module = sys.modules.get("fd_suite_llama_model")
    if module is None or not isinstance(model, module.SuiteLlama):
        return None
    if model.variant != "clear_noop":  # the broken variant says it cleared and did not
        model.clear_graph_opt_backend()
    return True


@hookimpl
def fd_register_models(register):
    for variant in VARIANTS:
        register(Architecture(
            name="suite_llama" if variant == "good" else f"suite_llama_{variant}",
            aliases=("LlamaForCausalLM",) if variant == "good" else (), reference="LlamaForCausalLM",
            build=_build(variant), preset=PRESET, config_defaults=DEFAULTS, graph_capable=True,
            description=f"Llama from fd's decoder ({variant})",
        ))
'''

MODEL = '''
from types import SimpleNamespace

import numpy as np

from fd_models.layers.decoder import CausalLM, DecoderOptions


class _Negated:
    """A graph backend whose replays give the negated logits: a captured step that differs from eager."""

    def __init__(self, inner):
        self.inner, self.mode = inner, inner.mode

    def capture(self, key, fn, inputs):
        self.inner.capture(key, fn, inputs)

    def replay(self, key, inputs):
        return -self.inner.replay(key, inputs)

    def has(self, key):
        return self.inner.has(key)

    def clear(self):
        self.inner.clear()


class SuiteLlama(CausalLM):
    def __init__(self, variant, config, ctx):
        self.variant, self.loads = variant, 0
        if variant == "no_reduce":  # forgets the all-reduce: each rank keeps its partial sums
            ctx = SimpleNamespace(parallel=ctx.parallel, ops=ctx.ops, all_reduce=lambda t: t)
        layout = "interleaved" if variant == "bad_rope" else "half"  # Llama's is "half"
        super().__init__(config, ctx, DecoderOptions(qk_norm=False, rope_layout=layout))

    def capture(self, graph_backend, batch_size, table_width):
        super().capture(_Negated(graph_backend) if self.variant == "graph_drift" else graph_backend, batch_size,
                        table_width)

    def decode_step(self, token_ids, batch):
        if self.variant == "one_position":  # written for static batches: every row at one position and table
            batch.starts = np.full_like(batch.starts, batch.starts.max())
            batch.block_tables = np.repeat(batch.block_tables[:1], len(batch.starts), axis=0)
            batch.slot_mapping = np.repeat(batch.slot_mapping[:1], len(batch.starts), axis=0)
        return super().decode_step(token_ids, batch)

    def prefill(self, input_ids, image=None, batch=None):
        if self.variant == "prefix_blind" and batch is not None:  # written for whole prompts: attends from position 0
            import dataclasses

            inner = dataclasses.replace(batch, starts=np.zeros_like(batch.starts))
            inner.slot_mapping = batch.slot_mapping  # the writes still land where the runtime said
            logits = super().prefill(input_ids, image, inner)
            return logits
        return super().prefill(input_ids, image, batch)

    def load_weights(self, shards):
        super().load_weights(shards)
        self.loads += 1
        if self.variant == "reload_drift" and self.loads > 1:  # a reload that does not restore the same weights
            import paddle

            weight = self.model.embed_tokens.weight
            paddle.assign(paddle.flip(weight, [0]), output=weight)


def build(variant, config, ctx):
    return SuiteLlama(variant, config, ctx)
'''
