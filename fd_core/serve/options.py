"""How `fd serve` listens and admits (ServeOptions), and the defaults of its bounds on a request."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fd_core.serve.connections import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS

# --max-request-bytes' default: the longest contexts' text (a million tokens is a few MB) and a few pictures as data
# URLs (base64, 4/3 of the file) fit with room to spare; a larger picture goes as a file under --image-root. The body
# is held whole and parsed into Python strings on the event loop, so the bound is also on that time and memory.
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
# --max-images' default: pictures one chat request may hold. Each is decoded whole before the model's processor
# resizes it (a 2000x2000 one is 48 MB as float32, a tenth to a quarter of a second to decode).
DEFAULT_MAX_IMAGES = 16
# --max-pixels' default: the pixels one request's pictures may hold together, as fd's bound on one picture (64 Mi
# pixels; 768 MB decoded as float32 RGB): sixteen pictures of 2048x2048, or one of 8192x8192.
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024


@dataclass
class ServeOptions:
    """How `fd serve` listens and admits."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 64
    shutdown_timeout: float = 30.0
    image_roots: tuple[Path, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_images: int = DEFAULT_MAX_IMAGES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_pixels: int = DEFAULT_MAX_PIXELS
