"""Package-level rules: registration, Hugging-Face weight names and split axes,
no paddle at plugin import, no direct comm."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "ernie4_5": ("Ernie4_5ForCausalLM", False),
    "ernie4_5_vl": ("Ernie4_5_VLMoeForConditionalGeneration", True),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", True),
}


def test_each_package_registers_its_architecture(kit) -> None:
    archs = {a.name: a for a in kit.architectures()}
    assert set(archs) == set(EXPECTED)
    for name, (alias, multimodal) in EXPECTED.items():
        arch = archs[name]
        assert arch.aliases == (alias,) and arch.multimodal is multimodal and arch.graph_capable
        assert arch.preset["architectures"] == [alias]  # the published class name, as transformers writes it
        arch.preset_config().check_tensor_parallel(2)


def test_presets_put_vision_keys_in_extra(vl_arch) -> None:
    config = vl_arch.preset_config()
    assert {"vision_config", "image_token_id"} <= set(config.extra)


@pytest.mark.parametrize(
    "name, tensor, split",
    [
        # [out, in] as published: column-parallel splits rows (axis 0), row-parallel splits columns (axis 1).
        ("ernie4_5", "model.embed_tokens.weight", 0),
        ("ernie4_5", "model.layers.0.self_attn.q_proj.weight", 0),
        ("ernie4_5", "model.layers.1.self_attn.o_proj.weight", 1),
        ("ernie4_5", "model.layers.0.mlp.down_proj.weight", 1),
        ("ernie4_5", "model.layers.0.mlp.gate_proj.weight", 0),
        ("ernie4_5", "model.norm.weight", None),
        ("ernie4_5_vl", "model.layers.0.self_attn.k_proj.weight", 0),
        ("ernie4_5_vl", "model.vision_model.patch_embed.proj.weight", None),
        ("ernie4_5_vl", "model.vision_model.blocks.1.attn.qkv.weight", None),
        ("ernie4_5_vl", "model.resampler_model.spatial_linear.0.weight", None),
        ("ernie4_5_vl", "model.layers.0.mlp.gate_proj.weight", 0),  # the dense first layer
        # a text expert: split by its intermediate rows
        ("ernie4_5_vl", "model.layers.1.mlp.experts.0.gate_proj.weight", 0),
        # a vision expert: by its intermediate columns
        ("ernie4_5_vl", "model.layers.1.mlp.experts.7.down_proj.weight", 1),
        ("ernie4_5_vl", "model.layers.2.mlp.shared_experts.up_proj.weight", 0),
        ("ernie4_5_vl", "model.layers.2.mlp.gate.weight_1", None),  # the vision router, replicated
        ("ernie4_5_vl", "model.layers.2.mlp.moe_statics.e_score_correction_bias", None),
        ("qwen3_vl", "model.language_model.layers.0.self_attn.q_norm.weight", None),
        ("qwen3_vl", "model.language_model.embed_tokens.weight", 0),
        ("qwen3_vl", "lm_head.weight", 0),
        ("qwen3_vl", "model.visual.pos_embed.weight", None),
        ("qwen3_vl", "model.visual.patch_embed.proj.weight", None),
        ("qwen3_vl", "model.visual.merger.linear_fc2.weight", None),
        ("qwen3_vl", "model.visual.deepstack_merger_list.0.norm.weight", None),
    ],
)
def test_weight_names_and_split_axes(kit, name: str, tensor: str, split: int | None) -> None:
    arch = next(a for a in kit.architectures() if a.name == name)
    specs = kit.build_loaded(arch).weight_specs()
    assert specs[tensor].split_axis == split


def test_specs_are_full_published_layout_shapes_with_ones_for_norms(arch, kit) -> None:
    specs = kit.build_loaded(arch, kit.make_ctx(2, 1)).weight_specs()
    config = arch.preset_config()
    hidden, vocab = config.hidden_size, config.vocab_size
    heads_dim = config.num_attention_heads * config.resolved_head_dim
    q_proj = next(s for n, s in specs.items() if n.endswith("layers.0.self_attn.q_proj.weight"))
    assert q_proj.shape == (heads_dim, hidden)  # [out, in], unsharded even on rank 1 of 2
    assert next(s for n, s in specs.items() if n.endswith("embed_tokens.weight")).shape == (vocab, hidden)
    norms = [s for n, s in specs.items() if re.search(r"(norm\d?|layernorm)\.weight$", n)]
    assert norms and all(s.init == "ones" for s in norms)
    assert ("lm_head.weight" in specs) is (not config.tie_word_embeddings)


def test_plugin_modules_do_not_import_paddle() -> None:
    code = (
        "import sys\n"
        "import fd_models.ernie4_5.plugin, fd_models.ernie4_5_vl.plugin, fd_models.qwen3_vl.plugin\n"
        "assert 'paddle' not in sys.modules, 'a plugin module imported paddle'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
