"""`fd save-random`: seeded random weights written in the published layout, one tensor at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from fd_core.config import ParallelConfig, read_config_json
from fd_core.errors import ConfigError
from fd_core.host.backend import load_backend
from fd_core.host.loading import PluginSet, load_plugins
from fd_core.models import Architecture
from fd_core.runtime.checkpoint import architecture_of
from fd_core.runtime.engine.runner import init_std
from fd_core.runtime.files import regular_file
from fd_core.runtime.weights import check_new_directory, random_state_dict, save_checkpoint


def save_random_checkpoint(
    model: str, directory: str, seed: int = 0, config_path: str | None = None, dtype: str = "float32",
    overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Write seeded random weights in the published layout (config.json + model.safetensors, tensors as `dtype`).

    The config is `model`'s tiny preset, or the config.json at `config_path` (a published model's
    own, say), which then names the architecture; `overrides` replace its top-level keys (a tokenizer's token ids).
    """
    check_new_directory(Path(directory))  # before paddle is imported or a tensor drawn
    plugins = load_plugins()
    arch, data, files = random_config(plugins, model, config_path)
    data = {**data, **(overrides or {})}
    config = arch.config_from(data, source=config_path or f"preset of {arch.name}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {dtype}: checkpoints are written as float32, bfloat16 or float16")
    backend = load_backend(ParallelConfig(), plugins=plugins)
    built = arch.build_model(config, backend)
    specs = built.weight_specs()
    built.release_weights()  # only the specs are needed: the zero parameters would double the peak
    tensors = random_state_dict(specs, seed, std=init_std(config))
    return save_checkpoint(
        directory, {**data, "architectures": data.get("architectures") or [arch.name]}, tensors, dtype, files
    )


def random_config(plugins: PluginSet, model: str, config_path: str | None) -> tuple[Architecture, dict[str, Any],
                                                                                   dict[str, Any]]:
    """(architecture, config data, files beside config.json) of what save-random writes: `model`'s tiny preset, or
    the config.json at `config_path`, which names the architecture."""
    if config_path is None:
        arch = plugins.registry.get(model)  # an unknown name raises, listing the registered architectures
        return arch, dict(arch.preset), dict(arch.preset_files)
    if Path(config_path).exists():  # a FIFO or device would block the read or never end
        regular_file(config_path, f"--config {config_path}", error=ConfigError, fix="pass a model's config.json")
    data = read_config_json(Path(config_path))
    found = architecture_of(data)
    if found is None:
        raise ConfigError(f"{config_path} names no architecture; add \"architectures\": [\"<name>\"]")
    return plugins.registry.get(found), data, {}
