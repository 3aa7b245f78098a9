"""Files fd reads from a user or a checkpoint (prompts, pictures, JSON, templates, weights): refused unless
they are regular files, since reading a FIFO blocks until a writer comes and a device never ends."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fd_core.errors import CheckpointError, FdError


def regular_file(
    path: str | Path, label: str, *, error: type[FdError] = CheckpointError, fix: str = "replace it with the real file"
) -> int:
    """The size of `path` if it is a regular file (symlinks followed); else `error`, one line starting with `label`.

    Checked from the file's metadata only, so a FIFO or a device is refused without being opened.
    """
    try:
        info = os.stat(path)
    except OSError as exc:
        raise error(f"{label} cannot be read ({exc.strerror}); check the file") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{label} is not a regular file; {fix}")
    return info.st_size


def read_text(
    path: str | Path,
    label: str,
    limit: int,
    *,
    error: type[FdError] = CheckpointError,
    fix: str = "replace it with the real file",
) -> str:
    """A regular file of at most `limit` bytes as UTF-8 text; a special file, a larger one or bytes that are not UTF-8
    is `error`."""
    size = regular_file(path, label, error=error, fix=fix)
    if size > limit:
        raise error(f"{label} holds {size} bytes, more than the {limit} fd reads; {fix}")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)  # the file may have grown since it was measured
    except OSError as exc:
        raise error(f"{label} cannot be read ({exc.strerror}); check the file") from None
    if len(data) > limit:
        raise error(f"{label} holds more than the {limit} bytes fd reads; {fix}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{label} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); save it as UTF-8"
        ) from None
