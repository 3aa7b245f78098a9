"""What one connection may hold of `fd serve`: a deadline for each request's headers (--header-timeout) and a cap on
open connections (--max-connections), enforced in uvicorn's HTTP protocol, where connections are seen before any
request exists; both answered in the OpenAI error format and closed. The body's own deadline (--body-timeout) is the
application's (BodyLimit in fd_core/serve/middleware.py), which reads the body."""

from __future__ import annotations

import asyncio
import json
import logging
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
# The largest chunk size a chunked body may declare: what a signed 64-bit length holds. RFC 9112 section 7.1 warns that
# larger numerals overflow parsers; h11 takes up to 20 hex digits (2^80) and would wait for that many bytes.
MAX_CHUNK_SIZE = 2**63 - 1
# How much of h11's own reason a 400 repeats (it may quote the client's bytes).
SHOWN_REASON = 120
# uvicorn's warning for a request h11 refused, which fd's own line (with the reason) replaces.
UVICORN_400 = "Invalid HTTP request received."


def _not_uvicorns_400(record: logging.LogRecord) -> bool:
    return record.getMessage() != UVICORN_400


# The logger fd's connections log through: uvicorn's, less the warning above (one line per refusal, fd's).
_LOGGER = logging.getLogger("uvicorn.error.fd_serve")
_LOGGER.addFilter(_not_uvicorns_400)


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
    kept alive, after it started its next request) gets 408 and is closed. A request RFC 9112 says to refuse (both
    Content-Length and Transfer-Encoding, a chunk size past MAX_CHUNK_SIZE), and any other h11 cannot parse, gets 400 in
    the OpenAI format and the connection is closed."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Strict(h11.Connection):
        """h11's server side, refusing what h11 takes but RFC 9112 says to refuse; `refusal` says why a request was."""

        refusal: str | None = None

        def next_event(self) -> Any:
            try:
                event = super().next_event()
            except h11.RemoteProtocolError as exc:
                reason = " ".join(str(exc).split())[:SHOWN_REASON] or "malformed"
                self.refusal = self.refusal or (f"the request is not valid HTTP/1.1 ({reason}); send a well-formed "
                                                "request")
                raise
            if isinstance(event, h11.Request):
                names = {name for name, _ in event.headers}  # h11 gives them in lower case
                if b"content-length" in names and b"transfer-encoding" in names:
                    # RFC 9112 section 6.3: the two disagree on where the body ends, the way one request is smuggled
                    # inside another through a proxy; an error, and the connection must close.
                    raise self.refuse("the request has both Content-Length and Transfer-Encoding, which RFC 9112 "
                                      "section 6.3 makes an error; send one of them")
            # h11 keeps what is left of the chunk being read; at the chunk's first data, that data came off it too.
            left = getattr(getattr(self, "_reader", None), "_bytes_in_chunk", 0)
            started = len(event.data) if isinstance(event, h11.Data) and event.chunk_start else 0
            if isinstance(left, int) and left + started > MAX_CHUNK_SIZE:
                raise self.refuse(f"a chunk of the request's body declares more than {MAX_CHUNK_SIZE} bytes (2^63 - 1, "
                                  f"the most a 64-bit length holds); send the body in smaller chunks")
            return event

        def refuse(self, message: str) -> Exception:
            self.refusal = message
            return h11.RemoteProtocolError(message)

    class LimitedH11(H11Protocol):
        # The request cycle whose successor's headers are awaited (None: the first), and its deadline.
        awaited: Any = None
        deadline: asyncio.TimerHandle | None = None
        over: bool = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _LOGGER.setLevel(self.logger.getEffectiveLevel())  # as uvicorn's --log-level set it
            self.logger = _LOGGER
            size = self.config.h11_max_incomplete_event_size
            self.conn = Strict(h11.SERVER, *(() if size is None else (size,)))

        def send_400_response(self, msg: str) -> None:
            """A request h11 (or Strict) refused: 400 saying why, in the OpenAI format, and the connection closed."""
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                if cycle.response_started:  # the application is answering already: nothing more can be said
                    self.transport.close()
                    return
                # Its application sees the client gone (and so answers nothing after this 400).
                cycle.disconnected = True
                cycle.message_event.set()
            reason = getattr(self.conn, "refusal", None) or f"the request is not valid HTTP/1.1 ({msg})"
            self.refuse(400, "Bad Request", reason, "invalid_http")

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
