"""The request side of `fd serve` without a server: pictures from data URLs and from the
directories the server may read."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pydantic", reason="fd serve needs the serve extra (pip install -e '.[cpu,test]' brings it)")

from fd_core.serve.protocol import ApiError, read_image  # noqa: E402 - after the skip


def png(path: Path | None = None) -> tuple[bytes, np.ndarray]:
    from PIL import Image

    pixels = (np.arange(4 * 6 * 3) * 7 % 256).astype("uint8").reshape(4, 6, 3)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    if path is not None:
        path.write_bytes(buffer.getvalue())
    return buffer.getvalue(), pixels.transpose(2, 0, 1).astype("float32") / 255.0


def test_a_data_url_is_decoded_to_the_pictures_pixels() -> None:
    data, want = png()
    got = read_image("data:image/png;base64," + base64.b64encode(data).decode(), ())
    assert got.shape == (3, 4, 6) and np.allclose(got, want)
    for bad, words in (("data:image/png,abc", "must be base64"), ("data:image/png;base64,!!!", "not a PNG or JPEG"),
                       ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "not a PNG or JPEG")):
        with pytest.raises(ApiError, match=words) as refused:
            read_image(bad, ())
        assert refused.value.status == 400


def test_a_path_is_read_only_under_an_image_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "pictures", tmp_path / "private"
    root.mkdir()
    outside.mkdir()
    _, want = png(root / "a.png")
    png(outside / "b.png")
    assert np.allclose(read_image(str(root / "a.png"), (root.resolve(),)), want)
    assert np.allclose(read_image(f"file://{root / 'a.png'}", (root.resolve(),)), want)
    for path in (str(outside / "b.png"), str(root / ".." / "private" / "b.png")):
        with pytest.raises(ApiError, match="outside the directories the server may read"):
            read_image(path, (root.resolve(),))
    with pytest.raises(ApiError, match=r"none \(start fd serve with --image-root DIR\)"):
        read_image(str(root / "a.png"), ())
    with pytest.raises(ApiError, match="is not a file the server can read"):
        read_image(str(root / "missing.png"), (root.resolve(),))
