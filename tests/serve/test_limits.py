"""What one request may cost `fd serve` (issue 38), in this process (FastAPI's test client, a stand-in engine): the
body's size (--max-request-bytes, 413 before the JSON is parsed), pictures refused before any is read (a model that
takes none, more than --max-images), a data URL's pixels checked from its header, and pictures decoded off the event
loop. test_stalls.py shows the same against a real server: nobody else waits."""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
import zlib
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi", reason="fd serve needs the serve extra (pip install -e '.[cpu,test]' brings it)")
pytest.importorskip("httpx", reason="FastAPI's test client needs httpx (pip install -e '.[cpu,test]')")

from fastapi.testclient import TestClient  # noqa: E402 - after the skip

import fd_core.serve.app as app_module  # noqa: E402
from fd_core.runtime.images import MAX_IMAGE_PIXELS  # noqa: E402
from fd_core.serve.app import DEFAULT_MAX_IMAGES, DEFAULT_MAX_REQUEST_BYTES, Server  # noqa: E402
from stand_in import Engine, error_of  # noqa: E402

LIMIT = 64 << 10  # a lowered --max-request-bytes: 64 KiB
TOO_LARGE = ("the request body is {}more than --max-request-bytes 65536 (64 KiB) admits; send a smaller request "
             "(pictures as files under --image-root rather than data URLs), or start fd serve with a larger "
             "--max-request-bytes")


@pytest.fixture
def engine() -> Engine:
    return Engine()


@pytest.fixture
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(Server(engine, name="tiny", max_request_bytes=LIMIT, max_images=3).app) as client:
        yield client


def body_of(size: int) -> bytes:
    """A completion request of exactly `size` bytes of JSON."""
    empty = json.dumps({"prompt": ""}).encode()
    return json.dumps({"prompt": "x" * (size - len(empty))}).encode()


def chunks(data: bytes, size: int = 8192) -> Iterator[bytes]:
    """The body sent chunked (no Content-Length): the server counts it as it arrives."""
    for start in range(0, len(data), size):
        yield data[start:start + size]


def test_a_body_past_the_limit_is_a_413_before_its_json_is_parsed(client: TestClient, engine: Engine) -> None:
    headers = {"content-type": "application/json"}
    for data, said in ((body_of(LIMIT + 1), f"{LIMIT + 1} bytes, "), (b"{not json" + b" " * LIMIT, f"{LIMIT + 9} bytes, ")):
        reply = client.post("/v1/completions", content=data, headers=headers)
        error = error_of(reply, 413)
        assert error == {"message": TOO_LARGE.format(said), "type": "invalid_request_error", "param": None,
                         "code": "request_too_large"}, error
    # Without a Content-Length (chunked), counted as it arrives.
    error = error_of(client.post("/v1/completions", content=chunks(body_of(LIMIT + 1)), headers=headers), 413)
    assert error["message"] == TOO_LARGE.format("")
    assert engine.prompts == []
    # Up to the limit, whole or in chunks, the body reaches the route as it was sent.
    for content in (body_of(LIMIT), chunks(body_of(LIMIT))):
        assert client.post("/v1/completions", content=content, headers=headers).status_code == 200
    assert engine.prompts == ["x" * (LIMIT - len('{"prompt": ""}'))] * 2
    # The 413s are counted (under "unmatched": refused before routing), each with its line in the log.
    metrics = client.get("/metrics").text
    assert 'fd_requests_total{endpoint="unmatched",status="413"} 3.0' in metrics, metrics


def test_the_default_limit_is_16_mib() -> None:
    assert DEFAULT_MAX_REQUEST_BYTES == 16 << 20 and DEFAULT_MAX_IMAGES == 16
    server = Server(Engine(), name="tiny")
    assert (server.max_request_bytes, server.max_images) == (16 << 20, 16)


def test_the_api_key_and_loading_are_checked_before_the_body_is_read() -> None:
    """A client without the key cannot make the server read (or count) its body."""
    server = Server(Engine(), name="tiny", api_key="k", max_request_bytes=LIMIT)
    with TestClient(server.app) as client:
        refused = client.post("/v1/completions", content=chunks(body_of(LIMIT + 1)))
        assert error_of(refused, 401)["code"] == "invalid_api_key"


def picture(width: int = 4, height: int = 4) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def blank_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of any size, a few kilobytes: its pixels compress to almost nothing (an attacker's picture:
    11000x11000 is 15 KB here, 1.45 GB once decoded to float32 RGB)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" * (1 + (width + 7) // 8)
    packer = zlib.compressobj(9)
    pixels = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat_with(*urls: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": "What is this?"}]}]}


@pytest.fixture
def unread(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fails the test if a picture is read; the URLs it was asked for."""
    asked: list[str] = []

    def read_image(url: str, roots: Any, charge: Any = None) -> Any:
        asked.append(url)
        raise AssertionError("a picture was read")

    monkeypatch.setattr(app_module, "read_image", read_image)
    return asked


def test_a_text_only_model_refuses_pictures_before_reading_any(unread: list[str]) -> None:
    engine = Engine(multimodal=False)
    with TestClient(Server(engine, name="tiny").app) as client:
        error = error_of(client.post("/v1/chat/completions", json=chat_with(*[data_url(picture())] * 10)), 400)
    assert error["message"] == ("the model 'tiny' takes no image (its architecture reads text only); drop the "
                                "image_url parts, or serve a vision-language model"), error
    assert error["param"] == "messages" and unread == [] and engine.prompts == []


def test_more_pictures_than_max_images_are_refused_before_reading_any(
    client: TestClient, engine: Engine, unread: list[str],
) -> None:
    error = error_of(client.post("/v1/chat/completions", json=chat_with(*[data_url(picture())] * 4)), 400)
    assert error["message"] == ("the request has 4 pictures and --max-images 3 admits at most 3 per request; send "
                                "fewer, or start fd serve with a larger --max-images"), error
    assert unread == [] and engine.prompts == []


def test_a_data_url_past_the_body_limit_is_never_decoded(client: TestClient, unread: list[str]) -> None:
    """base64-decoding a data URL is bounded by --max-request-bytes: the body holds it."""
    error_of(client.post("/v1/chat/completions", json=chat_with(data_url(b"\x89PNG\r\n\x1a\n" + bytes(LIMIT)))), 413)
    assert unread == []


@pytest.mark.parametrize("side", [11000, 20000], ids=["11000x11000", "20000x20000"])
def test_a_data_url_above_the_pixel_bound_is_refused_from_its_header(
    monkeypatch: pytest.MonkeyPatch, side: int,
) -> None:
    """As a file's path is (load_image). 11000x11000 (121 Mi pixels) is below twice the bound, where PIL only warns:
    it was decoded whole (+3.7 GB) before the engine refused it."""
    from PIL import Image

    def load(self: Any) -> Any:
        raise AssertionError("the picture was decoded")

    monkeypatch.setattr(Image.Image, "load", load)
    engine = Engine()
    with TestClient(Server(engine, name="vl").app) as client:
        error = error_of(client.post("/v1/chat/completions", json=chat_with(data_url(blank_png(side, side)))), 400)
    size = f"{side}x{side}, " if side * side < 2 * MAX_IMAGE_PIXELS else ""
    assert error["message"] == f"the image data URL is {size}above the {MAX_IMAGE_PIXELS} pixels fd reads; downscale it"
    assert engine.prompts == []


def test_pictures_are_decoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
    """A picture takes a tenth of a second or more to decode: on the event loop, every other request waited."""
    threads: dict[str, int] = {}
    respond, read_image = Server.respond, app_module.read_image

    async def on_the_loop(self: Server, *args: Any, **kwargs: Any) -> Any:
        threads["loop"] = threading.get_ident()
        return await respond(self, *args, **kwargs)

    def reading(url: str, roots: Any, charge: Any = None, decode: bool = True) -> Any:
        threads["read"] = threading.get_ident()
        return read_image(url, roots, charge, decode)

    monkeypatch.setattr(Server, "respond", on_the_loop)
    monkeypatch.setattr(app_module, "read_image", reading)
    with TestClient(Server(engine, name="vl").app) as client:
        assert client.post("/v1/chat/completions", json=chat_with(data_url(picture(8, 6)))).status_code == 200
    assert threads["read"] != threads["loop"]
    assert [p.shape for p in engine.images[0]] == [(3, 6, 8)]


def test_a_requests_pictures_together_are_bounded_before_each_is_decoded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """--max-pixels: every picture's size is read from its header and added up before any is decoded, so a request
    refused for its pictures together decodes none (before: 16 pictures of 64 Mi pixels each, 12 GB as float32; then
    the first of three 8000x8000 ones, +1.9 GB, before the refusal), for data URLs and files (PNG and .npy) alike."""
    import numpy as np
    from PIL import Image

    from fd_core.serve.app import DEFAULT_MAX_PIXELS

    decoded: list[tuple[int, int]] = []
    convert = Image.Image.convert

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        decoded.append(self.size)
        return convert(self, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "convert", counted)
    (tmp_path / "a.png").write_bytes(picture(60, 50))
    np.save(tmp_path / "b.npy", np.zeros((3, 50, 60), dtype=np.float32))
    engine = Engine()
    message = ("the request's pictures hold more than --max-pixels 5000 pixels together (each is decoded to 12 bytes a "
               "pixel); send fewer or smaller pictures, or start fd serve with a larger --max-pixels")
    with TestClient(Server(engine, name="vl", max_pixels=5000, image_roots=[tmp_path]).app) as client:
        one = data_url(picture(60, 50))  # 3000 pixels
        assert client.post("/v1/chat/completions", json=chat_with(one)).status_code == 200
        assert decoded == [(60, 50)]
        for second in (one, str(tmp_path / "a.png"), str(tmp_path / "b.npy")):
            decoded.clear()
            error = error_of(client.post("/v1/chat/completions", json=chat_with(one, second)), 400)
            assert error["message"] == message and error["param"] == "messages", (second, error)
            assert decoded == [], second  # neither: the second was refused from its header before the first decoded
    assert len(engine.prompts) == 1
    assert Server(Engine(), name="vl").max_pixels == DEFAULT_MAX_PIXELS == MAX_IMAGE_PIXELS
