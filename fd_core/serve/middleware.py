"""The ASGI middleware in front of the routes: the API key and the loading state (ApiGate), then the request body's
size and time (BodyLimit)."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response

from fd_core.errors import speaking
from fd_core.serve.protocol import ApiError
from fd_core.serve.submissions import still_loading
from fd_core.serve.tokenizer_routes import TOKENIZER_PATHS


class GateHost(Protocol):
    """What the middleware needs of the server: its key, its bounds on a body, its state, its answer to an error."""

    api_key: str | None
    loading: bool
    draining: str | None
    max_request_bytes: int
    body_timeout: float

    def answer(self, request: Request, error: ApiError) -> Response: ...


class ApiGate:
    """The API (/v1/... and the tokenizer's routes) needs the key, then a loaded model (503 while it loads, before the
    body is read or checked); /health and /metrics stay open for probes and scrapers. Plain ASGI (not
    BaseHTTPMiddleware), so that a route still sees its client disconnect."""

    def __init__(self, app: Any, server: GateHost) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] == "http" and (path.startswith("/v1") or path in TOKENIZER_PATHS):
            request = Request(scope, receive)
            refused = self.refusal(request)
            if refused is not None:
                if _has_body(scope):  # left unread: the connection ends with the answer
                    refused.headers.setdefault("Connection", "close")
                response = self.server.answer(request, refused)
                await response(scope, receive, send)
                return
            # What the engine says about the request (in worker threads, which copy this context) is said in the
            # client's terms: its fields, never the server's paths or flags meant for fd run.
            with speaking("http"):
                await self.app(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, request: Request) -> ApiError | None:
        """Why an API request is refused before its route (no key, the model loading), or None."""
        key = self.server.api_key
        if key is not None:
            # The scheme is case-insensitive (RFC 9110 section 11.1: "bearer" is "Bearer"), the key is not.
            scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
            given = credentials.strip(" ") if scheme.lower() == "bearer" else ""
            if not hmac.compare_digest(given.encode(), key.encode()) or not given:
                return ApiError(401, "a valid API key is needed: send the header Authorization: Bearer KEY",
                                kind="authentication_error", code="invalid_api_key",
                                headers={"WWW-Authenticate": 'Bearer realm="fd serve"'})
        if self.server.loading:
            return still_loading()
        return None


class BodyLimit:
    """Request bodies of at most --max-request-bytes, refused with 413 before the JSON is parsed: one whose
    Content-Length is above the limit before a byte of it is read; any other counted as it arrives and refused once it
    passes the limit. A body not whole within --body-timeout seconds of its headers gets 408 (a client trickling it
    would hold its connection and its buffer for as long as it liked). The body is read here, then handed on to the
    route as it came. Plain ASGI, as ApiGate."""

    def __init__(self, app: Any, server: GateHost) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.server.max_request_bytes
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await self.refuse(scope, receive, send, int(declared))
            return
        messages: list[Any] = []
        size = 0

        async def read() -> str:
            # The body's messages into `messages`: "whole", "gone" (the client left before it was whole) or "large".
            nonlocal size
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return "gone"
                messages.append(message)
                size += len(message.get("body", b""))
                if size > limit:
                    return "large"
                if not message.get("more_body", False):
                    return "whole"

        try:
            outcome = await asyncio.wait_for(read(), self.server.body_timeout)
        except asyncio.TimeoutError:
            timeout = self.server.body_timeout
            error = ApiError(408, f"the request body was not whole {timeout:g} s after its headers ({size} bytes "
                                  f"came); send it at once, or start fd serve with a larger --body-timeout",
                             code="request_timeout", headers={"Connection": "close"})
            await self.server.answer(Request(scope), error)(scope, receive, send)
            return
        except asyncio.CancelledError:
            # The server is ending (a second signal, or past its graceful shutdown) before the body came: the client
            # is told so, where uvicorn would log the cancellation as a crash (a traceback) and answer a bare 500.
            error = ApiError(503, f"the server is {self.server.draining or 'stopping'} and the request body was not "
                                  f"whole ({size} bytes came); retry once the server is back", kind="server_error",
                             code="unavailable", headers={"Connection": "close"})
            await self.server.answer(Request(scope), error)(scope, receive, send)
            return
        if outcome == "large":
            await self.refuse(scope, receive, send, None)
        if outcome != "whole":  # refused, or nobody to answer
            return
        pending = iter(messages)

        async def replay() -> Any:
            # The body's messages as they came, then the connection's own (a disconnect, for a route watching).
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)

    async def refuse(self, scope: Any, receive: Any, send: Any, declared: int | None) -> None:
        limit = self.server.max_request_bytes
        size = "" if declared is None else f"{declared} bytes, "
        error = ApiError(413, f"the request body is {size}more than --max-request-bytes {limit} ({sized(limit)}) "
                              f"admits; send a smaller request (pictures as files under --image-root rather than data "
                              f"URLs), or start fd serve with a larger --max-request-bytes", code="request_too_large",
                         # The body is left unread: the connection ends with the answer.
                         headers={"Connection": "close"})
        response = self.server.answer(Request(scope), error)
        await response(scope, receive, send)


def _has_body(scope: Any) -> bool:
    """Whether the request sends a body (a Content-Length above 0, or chunked)."""
    headers = dict(scope.get("headers") or ())
    length = headers.get(b"content-length", b"0")
    return b"transfer-encoding" in headers or (length.isdigit() and int(length) > 0)


def sized(count: int) -> str:
    """A byte count as people read it: 16 MiB, 512 KiB, 1000 bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift} {unit}"
    return f"{count} bytes"
