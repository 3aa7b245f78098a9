"""ERNIE-4.5-VL's vision and mixture-of-experts settings, and the config checks that need no paddle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fd_core.errors import ConfigError
from fd_models.activations import VISION_ACTIVATIONS
from fd_models.picture_prompts import PicturePrompts

# The published image processor's defaults, used when a checkpoint has no preprocessor_config.json.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 6177


@dataclass(frozen=True)
class VisionConfig:
    """The `vision_config` of an ERNIE-4.5-VL config.json, with the published defaults."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_merge_size: int = 2
    hidden_act: str = "quick_gelu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "VisionConfig":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        rope = data.get("rope_parameters") or {}
        if isinstance(rope, dict) and "rope_theta" in rope:
            known["rope_theta"] = rope["rope_theta"]
        return cls(**known)

    @property
    def unit(self) -> int:
        """Side of the square an image's height and width must be multiples of: patch x merge."""
        return self.patch_size * self.spatial_merge_size


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts settings of the text config (transformers' Ernie4_5_VLMoeTextConfig names)."""

    layer_types: tuple[str, ...]
    experts: int
    top_k: int
    intermediate: tuple[int, int]  # (text experts, vision experts)
    shared: int
    norm_min: float

    @classmethod
    def from_config(cls, config: Any) -> "MoEConfig":
        extra = config.extra
        layers = config.num_hidden_layers
        types = extra.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        return cls(
            layer_types=tuple(types),
            experts=extra.get("moe_num_experts", 64),
            top_k=extra.get("moe_k", 6),
            intermediate=tuple(extra.get("moe_intermediate_size") or (1536, 512)),
            shared=extra.get("moe_num_shared_experts", 2),
            norm_min=extra.get("moe_norm_min", 1e-12),
        )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_config(config: Any, source: str = "config") -> None:
    """The ERNIE-4.5-VL parts of a checked ModelConfig: experts, layer pattern, vision tower, image tokens, 3-D rope."""
    try:
        moe = MoEConfig.from_config(config)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: malformed mixture-of-experts settings ({exc})") from None
    if len(moe.layer_types) != config.num_hidden_layers or set(moe.layer_types) - {"dense", "sparse"}:
        raise ConfigError(f"{source}: mlp_layer_types must give \"dense\" or \"sparse\" "
                          f"for each of the {config.num_hidden_layers} layers")
    if not (_positive_int(moe.experts) and _positive_int(moe.top_k) and moe.top_k <= moe.experts):
        raise ConfigError(
            f"{source}: moe_k={moe.top_k!r} must be a positive integer no larger than moe_num_experts={moe.experts!r}"
        )
    if len(moe.intermediate) != 2 or not all(_positive_int(i) for i in moe.intermediate):
        raise ConfigError(f"{source}: moe_intermediate_size must be two positive integers (text, vision), "
                          f"got {list(moe.intermediate)}")
    if not (isinstance(moe.shared, int) and moe.shared >= 0):
        raise ConfigError(f"{source}: moe_num_shared_experts must be a non-negative integer, got {moe.shared!r}")
    vision = config.extra.get("vision_config")
    if not isinstance(vision, dict):
        raise ConfigError(
            f"{source}: an ERNIE-4.5-VL config needs a \"vision_config\" object; use the checkpoint's own config.json"
        )
    try:
        parsed = VisionConfig.from_dict(vision)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: vision_config is malformed ({exc})") from None
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                 "spatial_merge_size"):
        if not _positive_int(getattr(parsed, name)):
            raise ConfigError(
                f"{source}: vision_config.{name} must be a positive integer, got {getattr(parsed, name)!r}"
            )
    if parsed.hidden_size % parsed.num_heads or (parsed.hidden_size // parsed.num_heads) % 4:
        raise ConfigError(f"{source}: vision_config.hidden_size / num_heads must be a multiple of 4 (2-D rotary)")
    if parsed.hidden_act not in VISION_ACTIVATIONS:
        raise ConfigError(f"{source}: vision_config.hidden_act {parsed.hidden_act!r} is not supported; "
                          f"use one of {', '.join(VISION_ACTIVATIONS)}")
    if parsed.temporal_merge_size != 2:
        raise ConfigError(f"{source}: vision_config.temporal_merge_size must be 2, as the published resampler assumes")
    for key in ("image_token_id", "image_start_token_id", "image_end_token_id"):
        token = config.extra.get(key)
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < config.vocab_size:
            raise ConfigError(f"{source}: {key} must be a token id below vocab_size={config.vocab_size}, got {token!r}")
    rope = config.extra.get("rope_parameters") or {}
    section = rope.get("mrope_section") if isinstance(rope, dict) else None
    if section is None:
        raise ConfigError(f"{source}: rope_parameters.mrope_section is required for ERNIE-4.5-VL's 3-D rope")
    if not (isinstance(section, list) and len(section) == 3 and all(isinstance(s, int) and s >= 0 for s in section)):
        raise ConfigError(f"{source}: mrope_section must be three non-negative integers, got {section!r}")
    if section[0] != section[1] or sum(section) != config.resolved_head_dim // 2:
        raise ConfigError(
            f"{source}: mrope_section {section} must give h and w the same share "
            f"and sum to head_dim / 2 = {config.resolved_head_dim // 2}"
        )


def sharded_sizes(config: Any) -> dict[str, int]:
    """The expert sizes tensor parallel splits, by name: tp must divide each."""
    moe = MoEConfig.from_config(config)
    sizes = {"moe_intermediate_size[0]": moe.intermediate[0], "moe_intermediate_size[1]": moe.intermediate[1]}
    if moe.shared:
        sizes["moe_intermediate_size[0] * moe_num_shared_experts"] = moe.intermediate[0] * moe.shared
    return sizes


# The picture side of a prompt: resizing and normalising, the placeholder check and count.
PROMPTS = PicturePrompts(VisionConfig, MIN_PIXELS, MAX_PIXELS, IMAGE_MEAN, IMAGE_STD)
image_settings, check_prompt, image_tokens = PROMPTS.image_settings, PROMPTS.check_prompt, PROMPTS.image_tokens
