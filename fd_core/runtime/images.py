"""Pictures read and checked for a VL prompt: PNG or JPEG decoded to RGB, or a .npy array [3, H, W] in [0, 1]."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from fd_core.errors import ConfigError
from fd_core.runtime.files import regular_file

# Pictures above this many pixels are refused before decoding (the processors downscale to far fewer anyway).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# The magic string every .npy file starts with.
NPY_MAGIC = b"\x93NUMPY"
# PIL modes of 16-bit greyscale pixels (a 16-bit PNG opens as one of these), read to [0, 1] by dividing by 65535:
# PIL's convert("RGB") would clip them at 255, making a picture white.
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")


def check_picture(array: Any, label: str) -> Any:
    """A picture as float32 [3, H, W] in [0, 1] (a leading batch axis of 1 dropped), or a one-line ConfigError
    starting with `label`: the layout the model's processor takes, checked here rather than in a rank."""
    import numpy as np

    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise ConfigError(
            f"{label}: expected a numpy array [3, H, W] (or a path to a picture), got {type(array).__name__}"
        )
    if array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    shape = list(array.shape)
    if not np.issubdtype(array.dtype, np.number) or np.issubdtype(array.dtype, np.complexfloating):
        raise ConfigError(f"{label}: expected a real numeric array [3, H, W], got dtype {array.dtype}")
    if array.ndim != 3 or 0 in shape:
        raise ConfigError(f"{label}: expected an array [3, H, W] (RGB, channels first), got shape {shape}")
    if shape[0] != 3:
        hint = "; it looks like [H, W, C]: use array.transpose(2, 0, 1)" if shape[2] == 3 else ""
        raise ConfigError(f"{label}: expected 3 channels first ([3, H, W], RGB), got shape {shape}{hint}")
    if shape[1] * shape[2] > MAX_IMAGE_PIXELS:
        raise ConfigError(
            f"{label}: {shape[1]}x{shape[2]} is above the {MAX_IMAGE_PIXELS} pixels fd reads; downscale it"
        )
    picture = np.asarray(array, dtype=np.float32)
    if not np.isfinite(picture).all() or picture.min() < 0.0 or picture.max() > 1.0:
        raise ConfigError(f"{label}: pixel values must be finite and within [0, 1] (divide 8-bit pixels by 255)")
    return picture


def load_image(path: str) -> Any:
    """A picture as float32 [3, H, W] with values in [0, 1]: a PNG or JPEG file (decoded once, to RGB), or a .npy array.

    Resizing and normalisation are the model's (its processor's settings); this only reads and checks.
    """
    import numpy as np

    label = f"--image {path}"
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"{label}: no such file; pass a PNG or JPEG picture or a .npy array [3, H, W]")
    regular_file(file, label, error=ConfigError, fix="pass a PNG or JPEG picture or a .npy array [3, H, W]")
    if file.suffix.lower() == ".npy":
        with open(file, "rb") as f:
            magic = f.read(len(NPY_MAGIC))
        if magic != NPY_MAGIC:
            raise ConfigError(
                f"{label}: not a numpy .npy array (no .npy header); save one with numpy.save, "
                f"or pass a PNG or JPEG file"
            )
        try:
            array = np.load(path, allow_pickle=False, mmap_mode="r")
        except (OSError, ValueError, EOFError) as exc:
            raise ConfigError(
                f"{label}: not a numpy .npy array ({exc or 'empty file'}); save one with numpy.save"
            ) from None
        return check_picture(array, label)
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError(
            f"{label}: reading pictures needs Pillow (pip install pillow), or pass a .npy array [3, H, W]"
        ) from None
    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            # Between the bound and twice it PIL only warns; fd refuses such a picture itself, just below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(path)
        with image:
            # The size is in the header: a picture above the bound is refused before a pixel is decoded.
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ConfigError(
                    f"{label}: {height}x{width} is above the {MAX_IMAGE_PIXELS} pixels fd reads; downscale it"
                )
            if image.mode in SIXTEEN_BIT_MODES or (image.mode == "I" and image.format == "PNG"):
                grey = np.asarray(image, dtype=np.float32) / np.float32(65535.0)
                return check_picture(np.broadcast_to(grey, (3, *grey.shape)), label)
            if image.mode in ("I", "F"):
                raise ConfigError(
                    f"{label}: its {image.mode} pixels (32-bit) are not a picture fd reads; "
                    f"save it as an 8- or 16-bit PNG"
                )
            pixels = np.asarray(image.convert("RGB"))
    except Image.DecompressionBombError:
        raise ConfigError(f"{label}: above the {MAX_IMAGE_PIXELS} pixels fd reads; downscale it") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ConfigError(
            f"{label}: not a readable picture ({exc.__class__.__name__}: {exc}); pass a PNG or JPEG file"
        ) from None
    picture = pixels.transpose(2, 0, 1).astype(np.float32)
    picture /= np.float32(255.0)  # in place: a large picture is not copied once more
    return picture


def header_pixels(path: str) -> int | None:
    """The pixels of the picture in the file at `path` as its header says, before any is decoded (a .npy array's
    H x W, a PNG's or JPEG's width x height); None when the header cannot say (load_image then reports why)."""
    try:
        with open(path, "rb") as f:
            npy = f.read(len(NPY_MAGIC)) == NPY_MAGIC
        if npy:
            import numpy as np

            shape = np.load(path, mmap_mode="r", allow_pickle=False).shape  # mapped: only the header is read
            return int(shape[-1] * shape[-2]) if len(shape) >= 2 else None
        from PIL import Image

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path, formats=["PNG", "JPEG"]) as image:
                width, height = image.size
        return int(width * height)
    except Exception:  # noqa: BLE001 - any unreadable header: load_image says what is wrong with it
        return None
