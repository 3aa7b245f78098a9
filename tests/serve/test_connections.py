"""What one connection may hold of `fd serve` (issue 38, slow and idle clients): a request's headers within
--header-timeout, its body within --body-timeout, at most --max-connections open. A real uvicorn (fd's Http, on a
socket of its own) in this process over a stand-in engine, spoken to with raw sockets, as a slow client would; limits
lowered to fractions of a second so that each case takes about one."""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Iterator

import pytest

pytest.importorskip("uvicorn", reason="fd serve needs the serve extra (pip install -e '.[cpu,test]' brings it)")

from fd_core.serve.app import Http, ServeOptions, Server, bind  # noqa: E402
from fd_core.serve.connections import (  # noqa: E402
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
)
from stand_in import Engine  # noqa: E402

HEADER_S, BODY_S, MAX_CONNECTIONS = 0.6, 0.6, 3
# Longer than any limit above and their checks' slack: a connection the server should have ended by then and did not
# fails the test instead of hanging it.
PATIENCE_S = 6.0


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    sock = bind("127.0.0.1", 0)
    options = ServeOptions(header_timeout=HEADER_S, body_timeout=BODY_S, max_connections=MAX_CONNECTIONS)
    http = Http(Server(Engine(), name="tiny", body_timeout=BODY_S), sock, options)
    http.start()
    try:
        yield int(sock.getsockname()[1])
    finally:
        http.close()
        sock.close()


def connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE_S)
    return conn


def reply(conn: socket.socket) -> tuple[int, dict[str, str], Any]:
    """The whole response on `conn` (read until the server closes it, or one response's worth): status, headers and
    JSON body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = conn.recv(65536)
        assert chunk, "the connection closed inside the body"
        body += chunk
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


def closed(conn: socket.socket) -> bool:
    """Whether the server has closed the connection (EOF within the patience)."""
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def health(port: int) -> int:
    with connect(port) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        return reply(conn)[0]


def test_a_connection_that_sends_nothing_gets_408_and_is_closed(port: int) -> None:
    with connect(port) as conn:
        start = time.monotonic()
        status, headers, body = reply(conn)
        waited = time.monotonic() - start
        assert status == 408 and headers["connection"] == "close", (status, headers)
        assert body["error"]["code"] == "request_timeout"
        assert body["error"]["message"] == (f"the request's headers did not arrive within --header-timeout {HEADER_S:g} "
                                            f"s; send the whole request at once")
        assert closed(conn)
    assert HEADER_S * 0.9 <= waited < HEADER_S + 2.0, waited


def test_headers_trickled_a_byte_at_a_time_are_cut_at_the_deadline(port: int) -> None:
    """Each byte arriving before the last would renew a per-read timeout: the deadline is for the whole headers."""
    request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 200 + b"\r\n\r\n"
    with connect(port) as conn:
        start = time.monotonic()
        conn.settimeout(0.1)
        sent = 0
        answer = b""
        while sent < len(request) and time.monotonic() - start < PATIENCE_S:
            try:
                conn.sendall(request[sent:sent + 1])
                sent += 1
                answer = conn.recv(65536)
                if answer:
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert time.monotonic() - start < HEADER_S + 2.0
        assert sent < len(request), "the whole request went through at one byte per 0.1 s"


def test_a_kept_alive_connection_has_the_deadline_for_each_request(port: int) -> None:
    with connect(port) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert reply(conn)[0] == 200
        time.sleep(HEADER_S * 1.5)  # idle between requests: kept alive (--header-timeout starts with the next one)
        conn.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert reply(conn)[0] == 200
        conn.sendall(b"GET /health HTTP/1.1\r\n")  # then one that stops halfway
        status, _, body = reply(conn)
        assert status == 408 and body["error"]["code"] == "request_timeout"
        assert closed(conn)


def test_a_body_that_does_not_arrive_gets_408_naming_the_flag(port: int) -> None:
    with connect(port) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{\"prompt\": ")
        status, headers, body = reply(conn)
        assert status == 408 and headers["connection"] == "close"
        assert body["error"] == {
            "message": f"the request body was not whole {BODY_S:g} s after its headers (11 bytes came); send it at "
                       f"once, or start fd serve with a larger --body-timeout",
            "type": "invalid_request_error", "param": None, "code": "request_timeout"}
        assert closed(conn)


def test_connections_past_the_limit_get_503_and_the_limit_frees_as_they_close(port: int) -> None:
    held = [connect(port) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)  # accepted
        with connect(port) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            status, headers, body = reply(extra)
            assert status == 503 and headers["retry-after"] == "1", (status, headers)
            assert body["error"]["code"] == "too_many_connections"
            assert f"--max-connections {MAX_CONNECTIONS}" in body["error"]["message"]
            assert closed(extra)
    finally:
        for conn in held:
            conn.close()
    deadline = time.monotonic() + PATIENCE_S
    while health(port) != 200:  # the server sees the closes at its next loop turn
        assert time.monotonic() < deadline, "the held connections' slots were never freed"
        time.sleep(0.05)


def test_a_refusal_before_the_body_is_read_closes_the_connection(port: int) -> None:
    """A 413 from the declared length leaves the body unread: the connection ends with the answer, and the body's
    bytes that follow are never taken for a next request (which would earn a second, unasked-for 408)."""
    with connect(port) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 999999999\r\n\r\n{\"prompt\": ")
        status, headers, body = reply(conn)
        assert status == 413 and headers["connection"] == "close", (status, headers)
        assert body["error"]["code"] == "request_too_large"
        try:
            conn.sendall(b"x" * 100)  # more of the body, after the answer
        except OSError:
            pass
        time.sleep(HEADER_S * 1.5)
        rest = b""
        try:
            while chunk := conn.recv(65536):
                rest += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        assert b"408" not in rest, rest


def test_a_whole_request_within_the_limits_is_served(port: int) -> None:
    with connect(port) as conn:
        conn.sendall(b'POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n'
                     b'content-length: 15\r\n\r\n{"prompt": "a"}')
        status, _, body = reply(conn)
        assert status == 200 and body["object"] == "text_completion", body


def test_the_cli_defaults_are_the_servers() -> None:
    from fd_core.cli import build_parser
    from fd_core.serve.app import DEFAULT_MAX_PIXELS

    args = build_parser().parse_args(["serve"])
    assert (args.header_timeout, args.body_timeout, args.max_connections, args.max_pixels) == (
        DEFAULT_HEADER_TIMEOUT_S, DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PIXELS)
    assert ServeOptions().header_timeout == DEFAULT_HEADER_TIMEOUT_S


CHUNKED = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"transfer-encoding: chunked\r\n")


@pytest.mark.parametrize("size, data", [(2**63, b'{"prompt": "a"}\r\n0\r\n\r\n'), (2**64 + 15, b'{"prompt": "a"}'),
                                        (2**79, b"")], ids=["2^63-with-data", "2^64+15", "2^79-header-alone"])
def test_a_chunk_size_past_2_63_is_a_400_and_the_connection_closes(port: int, size: int, data: bytes) -> None:
    """h11 takes chunk sizes of up to 20 hex digits (2^80) and waited for that many bytes (until --body-timeout);
    RFC 9112 section 7.1: a numeral past what the parser's integers hold is an error."""
    with connect(port) as conn:
        start = time.monotonic()
        conn.sendall(CHUNKED + b"\r\n" + b"%x\r\n" % size + data)
        status, headers, body = reply(conn)
        assert status == 400 and headers["connection"] == "close", (status, headers, body)
        assert body["error"] == {
            "message": "a chunk of the request's body declares more than 9223372036854775807 bytes (2^63 - 1, the "
                       "most a 64-bit length holds); send the body in smaller chunks",
            "type": "invalid_request_error", "param": None, "code": "invalid_http"}
        assert closed(conn)
        assert time.monotonic() - start < BODY_S, "refused at the chunk's size, not at --body-timeout"


def test_a_chunk_of_2_63_minus_1_is_read_as_any_other(port: int) -> None:
    """The bound's edge: taken, then the body that does not come gets --body-timeout's 408."""
    with connect(port) as conn:
        conn.sendall(CHUNKED + b"\r\n" + b"%x\r\n" % (2**63 - 1) + b'{"prompt": ')
        status, _, body = reply(conn)
        assert status == 408 and body["error"]["code"] == "request_timeout", body


def test_content_length_with_transfer_encoding_is_a_400_and_the_connection_closes(port: int) -> None:
    """RFC 9112 section 6.3: both framings on one request is how a second request is smuggled past a proxy; h11 read
    the body as chunked and kept the connection open for the next (smuggled) request. Now neither is answered."""
    with connect(port) as conn:
        conn.sendall(CHUNKED + b"content-length: 15\r\n\r\nf\r\n{\"prompt\": \"a\"}\r\n0\r\n\r\n"
                     b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = reply(conn)
        assert status == 400 and headers["connection"] == "close", (status, headers, body)
        assert body["error"]["message"] == ("the request has both Content-Length and Transfer-Encoding, which RFC 9112 "
                                            "section 6.3 makes an error; send one of them"), body
        assert closed(conn)  # the request after it is never read
    # Chunked alone is served.
    with connect(port) as conn:
        conn.sendall(CHUNKED + b"\r\nf\r\n{\"prompt\": \"a\"}\r\n0\r\n\r\n")
        status, _, body = reply(conn)
        assert status == 200 and body["object"] == "text_completion", body


def test_a_request_h11_cannot_parse_gets_an_openai_error_saying_why(port: int) -> None:
    """uvicorn answered "Invalid HTTP request received." as plain text, whatever was wrong."""
    with connect(port) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n")
        status, headers, body = reply(conn)
        assert status == 400 and headers["content-type"] == "application/json", (status, headers)
        assert body["error"]["message"] == ("the request is not valid HTTP/1.1 (Only Transfer-Encoding: chunked is "
                                            "supported); send a well-formed request"), body
        assert closed(conn)
