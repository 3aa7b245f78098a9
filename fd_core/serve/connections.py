"""What one connection may hold of `fd serve`: a deadline for each request's headers (--header-timeout) and a cap on
open connections (--max-connections), enforced in uvicorn's HTTP protocol, where connections are seen before any
request exists; both answered in the OpenAI error format and closed. The body's own deadline (--body-timeout) is the
application's (BodyLimit in fd_core/serve/app.py), which reads the body."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from fd_core.serve.protocol import error_body

# Their defaults. A client on a working network sends its headers in well under a second; ten leave room for a slow
# one and still free a socket held by one that never sends them (slowloris) within seconds.
DEFAULT_HEADER_TIMEOUT_S = 10.0
# From the headers to the last byte of the body: 16 MiB (--max-request-bytes' default, 134 Mbit) at 2.5 Mbit/s.
DEFAULT_BODY_TIMEOUT_S = 60.0
# Far above what one host's clients open (the API is one queue of --max-queue requests), far below the 1024 file
# descriptors a process gets by default.
DEFAULT_MAX_CONNECTIONS = 256
# How long an idle kept-alive connection is held between requests (uvicorn's timeout_keep_alive).
KEEP_ALIVE_S = 5


@dataclass(frozen=True)
class ConnectionLimits:
    """The per-connection limits of one server."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS


def raw_reply(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error body that closes the connection, written before (or instead of)
    any request the protocol parsed."""
    body = json.dumps(error_body(message, "invalid_request_error" if status < 500 else "server_error",
                                 None, code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode("ascii") + body


def protocol_class(limits: ConnectionLimits, log: Any) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with `limits` enforced: a connection past --max-connections gets 503 at its first bytes
    and is closed; one that has not sent a whole request's headers --header-timeout seconds after it connected (or,
    kept alive, after it started its next request) gets 408 and is closed."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class LimitedH11(H11Protocol):
        # The request cycle whose successor's headers are awaited (None: the first), and its deadline.
        awaited: Any = None
        deadline: asyncio.TimerHandle | None = None
        over: bool = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.over = len(self.connections) > limits.max_connections
            self.arm()

        def data_received(self, data: bytes) -> None:
            if self.over:
                # At its first bytes rather than at connect: answered after the client has sent its request, the
                # reply is read (closing with nothing received, the client could see a reset instead).
                self.refuse(503, "Service Unavailable",
                            f"the server holds --max-connections {limits.max_connections} connections already; retry "
                            f"shortly, or reuse a connection", "too_many_connections", "retry-after: 1\r\n")
                return
            waiting = self.conn.their_state is h11.IDLE  # for a request's headers (not an answered one's body)
            if self.deadline is None and waiting and (self.cycle is None or self.cycle.response_complete):
                self.arm()  # a kept-alive connection starts its next request
            super().data_received(data)
            if self.cycle is not self.awaited:
                self.disarm()  # its headers are whole: the request is the application's now

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            super().connection_lost(exc)

        def arm(self) -> None:
            self.disarm()
            self.awaited = self.cycle
            self.deadline = self.loop.call_later(limits.header_timeout, self.late)

        def disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def late(self) -> None:
            self.deadline = None
            if self.cycle is self.awaited and not self.transport.is_closing():
                self.refuse(408, "Request Timeout",
                            f"the request's headers did not arrive within --header-timeout {limits.header_timeout:g} "
                            f"s; send the whole request at once", "request_timeout")

        def refuse(self, status: int, reason: str, message: str, code: str, extra: str = "") -> None:
            log(f"{status} (connection from {self.client[0] if self.client else 'unknown'}): {message}")
            self.transport.write(raw_reply(status, reason, message, code, extra))
            self.transport.close()

    return LimitedH11
