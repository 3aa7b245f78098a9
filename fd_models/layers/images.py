"""Image preprocessing shared by the VL models, as the published image processors do it (their PIL path).

A picture arrives as float [C, H, W] with values in [0, 1] (a decoded PNG or JPEG gives exactly
k / 255). It is resized so that both sides are multiples of patch x merge and its area lies within
[min_pixels, max_pixels] (the processors' `smart_resize`), with PIL's bicubic filter on 8-bit
pixels, then rescaled to [0, 1] and normalised with the checkpoint's mean and std. The settings
come from the checkpoint's `preprocessor_config.json` when it has one, else the model's defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class ImageSettings:
    """What the image processor of a checkpoint does before patches are cut."""

    factor: int  # patch x merge: both sides end up multiples of it
    min_pixels: int
    max_pixels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_config(
        cls, preprocessor: Mapping[str, Any] | None, factor: int, min_pixels: int, max_pixels: int,
        mean: Sequence[float], std: Sequence[float],
    ) -> "ImageSettings":
        """The model's defaults overridden by a `preprocessor_config.json` mapping (`size` or
        `min_pixels`/`max_pixels`, mean, std)."""
        data = dict(preprocessor or {})
        given = data.get("size")
        size: Mapping[str, Any] = given if isinstance(given, dict) else {}
        low = data.get("min_pixels", size.get("shortest_edge", min_pixels))
        high = data.get("max_pixels", size.get("longest_edge", max_pixels))
        return cls(
            factor=factor, min_pixels=int(low), max_pixels=int(high),
            mean=tuple(data.get("image_mean", mean)), std=tuple(data.get("image_std", std)),
        )


def smart_resize(height: int, width: int, settings: ImageSettings) -> tuple[int, int]:
    """The processors' target size: multiples of `factor`, area within [min_pixels, max_pixels], aspect ratio kept."""
    factor = settings.factor
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"image {height}x{width} has an aspect ratio above 200, which the model's processor refuses; crop it"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > settings.max_pixels:
        beta = math.sqrt((height * width) / settings.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < settings.min_pixels:
        beta = math.sqrt(settings.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(picture: np.ndarray, settings: ImageSettings) -> np.ndarray:
    """picture [C, H, W] in [0, 1] -> resized and normalised float32 [C, H', W'],
    as the reference's PIL processor gives it."""
    channels, height, width = picture.shape
    target = smart_resize(height, width, settings)
    if target != (height, width):
        from PIL import Image

        # The reference resizes 8-bit pixels with PIL (float input is first scaled to 0..255 and rounded).
        pixels = np.clip(np.round(picture * 255.0), 0, 255).astype(np.uint8).transpose(1, 2, 0)
        image = Image.fromarray(pixels[..., 0] if channels == 1 else pixels)
        resized = np.asarray(image.resize((target[1], target[0]), resample=Image.Resampling.BICUBIC))
        picture = (
            resized.reshape(target[0], target[1], channels).transpose(2, 0, 1).astype(np.float32) / np.float32(255.0)
        )
    mean = np.asarray(settings.mean[:channels], dtype=np.float32).reshape(-1, 1, 1)
    std = np.asarray(settings.std[:channels], dtype=np.float32).reshape(-1, 1, 1)
    return ((picture.astype(np.float32) - mean) / std).astype(np.float32)


def placeholder_runs(ids: Sequence[int] | np.ndarray, image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive placeholder tokens in one prompt."""
    slots = np.flatnonzero(np.asarray(ids) == image_token_id)
    if not len(slots):
        return []
    breaks = np.flatnonzero(np.diff(slots) > 1)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks + 1, [len(slots)]])
    return [(int(slots[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def placeholder_count(shape: Sequence[int], settings: ImageSettings, patch: int) -> int:
    """How many placeholder tokens a picture [C, H, W] takes: one per merged block of patches after resizing."""
    merge = settings.factor // patch
    h, w = smart_resize(int(shape[1]), int(shape[2]), settings)
    return (h // patch // merge) * (w // patch // merge)


def check_prompt(
    prompt: Sequence[int], image_token_id: int, shapes: Sequence[tuple[int, int, int]], settings: ImageSettings,
    patch: int,
) -> None:
    """Raise ValueError unless the prompt holds one run of placeholders per picture
    (shapes [C, H, W]), each of the right length."""
    runs = [length for _, length in placeholder_runs(prompt, image_token_id)]
    needed = [placeholder_count(shape, settings, patch) for shape in shapes]
    if runs != needed:
        have = ", ".join(map(str, runs)) or "none"
        want = ", ".join(map(str, needed)) or "none"
        raise ValueError(
            f"the prompt's runs of image placeholder tokens ({image_token_id}) have lengths {have}; "
            f"the {len(shapes)} picture(s) given need {want}, one run per picture in order"
        )
