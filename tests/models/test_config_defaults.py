"""No config key the decoder reads is filled silently: per built-in architecture, the declared defaults equal the
reference config class's, and a config.json lacking a key with no default is refused by name before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fd_core.config import DECODER_KEYS
from fd_core.errors import ConfigError
from fd_core.host.loading import load_plugins

# architecture -> the transformers config class that holds its decoder settings
TEXT_CONFIGS = {"ernie4_5": "Ernie4_5Config", "ernie4_5_vl": "Ernie4_5_VLMoeTextConfig",
                "qwen3_vl": "Qwen3VLTextConfig"}
TOP_CONFIGS = {"ernie4_5": "Ernie4_5Config", "ernie4_5_vl": "Ernie4_5_VLMoeConfig", "qwen3_vl": "Qwen3VLConfig"}


@pytest.mark.parametrize("name", sorted(TEXT_CONFIGS))
def test_declared_defaults_equal_the_reference_config_class(name: str) -> None:
    transformers = pytest.importorskip("transformers", reason="the reference config classes need transformers")
    arch = load_plugins({}).registry.get(name)
    text = getattr(transformers, TEXT_CONFIGS[name])().to_dict()
    top = getattr(transformers, TOP_CONFIGS[name])().to_dict()
    rope = (text.get("rope_parameters") or {}).get("rope_theta")
    for key in DECODER_KEYS:
        assert (key in arch.config_defaults
                or key in ("attention_bias", "mlp_bias") and "use_bias" in arch.config_defaults), (
            f"{name} declares no default for {key}")
        declared = arch.config_defaults.get(key, arch.config_defaults.get("use_bias"))
        if key == "rope_theta":
            want = rope
        elif key == "tie_word_embeddings":
            want = top.get(key, text.get(key))
        elif key in text:
            want = text[key]
        elif key in ("attention_bias", "mlp_bias"):
            want = text.get("use_bias", False)  # the published model has no such bias
        else:
            want = None  # absent from the class: transformers derives it (head_dim = hidden / heads)
        assert declared == want, f"{name}: declared default {key}={declared!r}, transformers' {TEXT_CONFIGS[name]} has {want!r}"


@pytest.mark.parametrize("name", sorted(TEXT_CONFIGS))
def test_a_key_without_a_default_is_refused_by_name_before_any_rank_starts(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dataclasses import replace

    from fd_core.runtime.plan import RunConfig, plan_run
    from fd_core.runtime.save_random import save_random_checkpoint

    plugins = load_plugins({})
    arch = plugins.registry.get(name)
    directory = save_random_checkpoint(name, str(tmp_path / "ckpt"))
    data = json.loads((directory / "config.json").read_text())
    section = data.get("text_config", data)
    section.pop("rms_norm_eps")
    (directory / "config.json").write_text(json.dumps(data))
    # A declared default covers a key config.json omits ...
    plan_run(RunConfig(model=None, checkpoint=str(directory), progress=False), plugins)
    # ... and a key without one is refused, naming the key and the fix, in the parent.
    section.pop("num_key_value_heads")
    (directory / "config.json").write_text(json.dumps(data))
    stripped = replace(arch, config_defaults={k: v for k, v in arch.config_defaults.items()
                                              if k != "num_key_value_heads"})
    monkeypatch.setattr(plugins.registry, "get", lambda key: stripped)
    with pytest.raises(ConfigError, match=r"does not set num_key_value_heads and architecture '\w+' declares no default for it; add it to config.json"):
        plan_run(RunConfig(model=None, checkpoint=str(directory), progress=False), plugins)
    section.pop("hidden_size")
    (directory / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"does not set hidden_size"):
        plan_run(RunConfig(model=None, checkpoint=str(directory), progress=False), plugins)


@pytest.mark.parametrize(("setting", "named"), [
    ({"sliding_window": 64}, "sliding_window=64"),
    ({"sliding_window": 64, "use_sliding_window": True}, "sliding-window attention"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "'sliding_attention'"),
])
def test_config_features_the_decoder_lacks_are_refused_by_name(setting: dict, named: str) -> None:
    arch = load_plugins({}).registry.get("ernie4_5")
    with pytest.raises(ConfigError, match=named):
        arch.config_from({**arch.preset, **setting})
    arch.config_from(
        {**arch.preset, "sliding_window": 64, "use_sliding_window": False, "layer_types": ["full_attention"] * 2}
    )


def test_a_check_config_that_raises_is_one_line_naming_the_package_and_hook() -> None:
    from dataclasses import replace

    arch = load_plugins({}).registry.get("ernie4_5")

    def broken(config, source):
        raise KeyError("moe_k")

    with pytest.raises(ConfigError, match=r"model package 'ernie4_5': check_config raised KeyError: 'moe_k'; fix the package \(its traceback is in (\S+)\)") as caught:
        replace(arch, check_config=broken).config_from(arch.preset)
    path = str(caught.value).rsplit("traceback is in ", 1)[1].rstrip(")")
    assert "raise KeyError" in Path(path).read_text()


def test_fd_plugins_json_lists_the_architectures() -> None:
    from fakedist import run_fd

    done = run_fd(["plugins", "--json"])
    assert done.returncode == 0, done.stderr
    archs = {a["name"]: a for a in json.loads(done.stdout)["architectures"]}
    assert archs["qwen3_vl"] == {
        "name": "qwen3_vl", "aliases": ["Qwen3VLForConditionalGeneration"], "package": "qwen3_vl",
        "graph_capable": True, "quantizable": True,
        "multimodal": True, "reference": "Qwen3VLForConditionalGeneration",
        "description": archs["qwen3_vl"]["description"],
    }
    assert set(archs) == {"ernie4_5", "ernie4_5_vl", "qwen3_vl"}
