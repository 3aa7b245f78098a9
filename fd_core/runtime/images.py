"""Pictures read and checked for a VL prompt: PNG or JPEG decoded to RGB, or a .npy array [C, H, W] in [0, 1]."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fd_core.errors import ConfigError

# Pictures above this many pixels are refused before decoding (the processors downscale to far fewer anyway).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


def load_image(path: str) -> Any:
    """A picture as float32 [C, H, W] with values in [0, 1]: a PNG or JPEG file (decoded to RGB), or a .npy array.

    Resizing and normalisation are the model's (its processor's settings); this only reads and checks.
    """
    import numpy as np

    file = Path(path)
    if not file.is_file():
        what = "no such file" if not file.exists() else "not a regular file"
        raise ConfigError(f"--image {path}: {what}; pass a PNG or JPEG picture or a .npy array [C, H, W]")
    if file.suffix.lower() == ".npy":
        try:
            array = np.load(path, allow_pickle=False, mmap_mode="r")
        except (OSError, ValueError, EOFError) as exc:
            raise ConfigError(f"--image {path}: not a numpy .npy array ({exc or 'empty file'}); save one with numpy.save") from None
        if array.ndim == 4 and array.shape[0] == 1:
            array = array[0]
        if array.ndim != 3 or 0 in array.shape or not np.issubdtype(array.dtype, np.number):
            raise ConfigError(f"--image {path}: expected a numeric array [C, H, W], got shape {list(array.shape)}")
        if array.shape[1] * array.shape[2] > MAX_IMAGE_PIXELS:
            raise ConfigError(f"--image {path}: {array.shape[1]}x{array.shape[2]} is above the {MAX_IMAGE_PIXELS} pixels fd reads; downscale it")
        picture = np.asarray(array, dtype=np.float32)
        if not np.isfinite(picture).all() or picture.min() < 0.0 or picture.max() > 1.0:
            raise ConfigError(f"--image {path}: pixel values must be finite and within [0, 1] (divide 8-bit pixels by 255)")
        return picture
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError(f"--image {path}: reading pictures needs Pillow (pip install pillow), or pass a .npy array [C, H, W]") from None
    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
    except Image.DecompressionBombError:
        raise ConfigError(f"--image {path}: above the {MAX_IMAGE_PIXELS} pixels fd reads; downscale it") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ConfigError(f"--image {path}: not a readable picture ({exc.__class__.__name__}: {exc}); pass a PNG or JPEG file") from None
    return pixels.transpose(2, 0, 1).astype(np.float32) / np.float32(255.0)
