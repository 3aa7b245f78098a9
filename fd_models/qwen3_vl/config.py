"""Qwen3-VL's vision settings and the config checks that need no paddle (run before any rank starts)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from fd_core.errors import ConfigError
from fd_models.activations import VISION_ACTIVATIONS
from fd_models.picture_prompts import PicturePrompts

# The published image processor's defaults, used when a checkpoint has no preprocessor_config.json.
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
MIN_PIXELS, MAX_PIXELS = 65536, 16777216


@dataclass(frozen=True)
class VisionConfig:
    """The `vision_config` of a Qwen3-VL config.json, with the published defaults."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "VisionConfig":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if "deepstack_visual_indexes" in known:
            known["deepstack_visual_indexes"] = tuple(known["deepstack_visual_indexes"])
        rope = data.get("rope_parameters") or {}
        if isinstance(rope, dict) and "rope_theta" in rope:
            known["rope_theta"] = rope["rope_theta"]
        return cls(**known)

    @property
    def unit(self) -> int:
        """Side of the square an image's height and width must be multiples of: patch x merge."""
        return self.patch_size * self.spatial_merge_size


def check_vision_config(config: VisionConfig, text_hidden: int, source: str) -> None:
    """Raise ConfigError naming the first inconsistent vision setting."""
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                 "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{source}: vision_config.{name} must be a positive integer, got {value!r}")
    if config.hidden_size % config.num_heads or (config.hidden_size // config.num_heads) % 4:
        raise ConfigError(f"{source}: vision_config.hidden_size / num_heads must be a multiple of 4 (2-D rotary)")
    if math.isqrt(config.num_position_embeddings) ** 2 != config.num_position_embeddings:
        raise ConfigError(
            f"{source}: vision_config.num_position_embeddings must be a square, got {config.num_position_embeddings}"
        )
    if config.hidden_act not in VISION_ACTIVATIONS:
        raise ConfigError(f"{source}: vision_config.hidden_act {config.hidden_act!r} is not supported; "
                          f"use one of {', '.join(VISION_ACTIVATIONS)}")
    if config.out_hidden_size != text_hidden:
        raise ConfigError(f"{source}: vision_config.out_hidden_size={config.out_hidden_size} "
                          f"differs from the text hidden_size={text_hidden}")
    bad = [i for i in config.deepstack_visual_indexes if not 0 <= i < config.depth]
    if bad:
        raise ConfigError(
            f"{source}: vision_config.deepstack_visual_indexes {bad} lie outside the {config.depth} blocks"
        )



def check_config(config: Any, source: str = "config") -> None:
    """The Qwen3-VL parts of a checked ModelConfig: the vision tower, the image token, the M-RoPE sections."""
    vision = config.extra.get("vision_config")
    if not isinstance(vision, dict):
        raise ConfigError(
            f"{source}: a Qwen3-VL config needs a \"vision_config\" object; use the checkpoint's own config.json"
        )
    try:
        parsed = VisionConfig.from_dict(vision)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: vision_config is malformed ({exc})") from None
    check_vision_config(parsed, config.hidden_size, source)
    if len(parsed.deepstack_visual_indexes) > config.num_hidden_layers:
        raise ConfigError(f"{source}: {len(parsed.deepstack_visual_indexes)} DeepStack features "
                          f"for {config.num_hidden_layers} text layers")
    token = config.extra.get("image_token_id")
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < config.vocab_size:
        raise ConfigError(
            f"{source}: image_token_id must be a token id below vocab_size={config.vocab_size}, got {token!r}"
        )
    rope = config.extra.get("rope_parameters") or config.extra.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if section is not None:
        if not (isinstance(section, list) and len(section) == 3
                and all(isinstance(s, int) and s >= 0 for s in section)):
            raise ConfigError(f"{source}: mrope_section must be three non-negative integers, got {section!r}")
        if sum(section) != config.resolved_head_dim // 2:
            raise ConfigError(
                f"{source}: mrope_section {section} must sum to head_dim / 2 = {config.resolved_head_dim // 2}"
            )


# The picture side of a prompt: resizing and normalising, the placeholder check and count.
PROMPTS = PicturePrompts(VisionConfig, MIN_PIXELS, MAX_PIXELS, IMAGE_MEAN, IMAGE_STD)
image_settings, check_prompt, image_tokens = PROMPTS.image_settings, PROMPTS.check_prompt, PROMPTS.image_tokens
