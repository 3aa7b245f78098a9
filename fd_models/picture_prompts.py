"""The prompt side of a VL architecture, shared by both: how its pictures are resized and normalised,
whether a prompt's placeholders fit them, and how many placeholders a picture takes.

No numpy or paddle at import: the plugins import this when `fd plugins` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from fd_core.errors import ConfigError

if TYPE_CHECKING:
    from fd_models.layers.images import ImageSettings


@dataclass(frozen=True)
class PicturePrompts:
    """One architecture's picture defaults (its published image processor's) and its VisionConfig class."""

    vision_config: Any  # a class with from_dict(dict), and .unit and .patch_size on the instance
    min_pixels: int
    max_pixels: int
    mean: Sequence[float]
    std: Sequence[float]

    def image_settings(self, config: Any, vision: Any = None) -> "ImageSettings":
        """How pictures are resized and normalised: the checkpoint's preprocessor_config.json
        over the published defaults."""
        from fd_models.layers.images import ImageSettings  # numpy: imported on use

        vision = vision or self.vision_config.from_dict(config.extra["vision_config"])
        return ImageSettings.from_config(config.extra.get("preprocessor_config"), vision.unit, self.min_pixels,
                                         self.max_pixels, self.mean, self.std)

    def check_prompt(self, config: Any, prompt: Any, shapes: Any) -> None:
        """Raise ConfigError unless the prompt holds a run of placeholders of the right length
        for each picture [C, H, W]."""
        from fd_models.layers.images import check_prompt as check

        vision = self.vision_config.from_dict(config.extra["vision_config"])
        try:
            check(prompt, config.extra["image_token_id"], shapes, self.image_settings(config, vision),
                  vision.patch_size)
        except ValueError as exc:
            raise ConfigError(f"{exc}; put one run of image tokens per --image in the prompt") from None

    def image_tokens(self, config: Any, shape: Any) -> int:
        """How many placeholder tokens the picture [C, H, W] takes in a prompt (what the
        reference processor expands it to)."""
        from fd_models.layers.images import placeholder_count

        vision = self.vision_config.from_dict(config.extra["vision_config"])
        return placeholder_count(shape, self.image_settings(config, vision), vision.patch_size)
