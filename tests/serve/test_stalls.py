"""One expensive request stalls nobody (issue 38), against a real `fd serve` (the tiny preset, text only): while a body
past --max-request-bytes, a prompt far too long for the context, or pictures to a text-only model are answered,
GET /health and a small completion answer at once. Before, the prompt was tokenized whole and the pictures decoded one
by one while the event loop waited (holding the GIL): here several seconds of silence for everyone."""

from __future__ import annotations

import base64
import io
import random
import string
import threading
import time
from typing import Any, Iterator

import pytest

from serving import Served, finish, start_server

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx (pip install -e '.[cpu,test]')")

LIMIT = 3 << 20  # --max-request-bytes lowered to 3 MiB: the payloads stay small
# Generous on a busy 2-core machine (they take a tenth of a second), far below what the same requests cost before
# (6 s or more each, measured on it).
PROMPT_S = 3.0


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server(["--tp", "1", "--name", "tiny", "--max-request-bytes", str(LIMIT)])
    # The first completion pays for the batch's KV cache and graph (seconds): paid here, not counted as a wait.
    httpx.post(served.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=120)
    yield served
    finish(served)


def printable(size: int) -> str:
    """Text the tiny tokenizer is slowest on (about 2.5 s a megabyte, a token a byte), seeded."""
    rng = random.Random(38)
    return "".join(rng.choices(string.ascii_letters + string.digits + string.punctuation + " ", k=size))


def pictures(count: int) -> list[dict[str, Any]]:
    """`count` 2800x2800 PNG data URLs (32 KB each: one colour), half a second each to decode."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (2800, 2800), (10, 20, 30)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return [{"type": "image_url", "image_url": {"url": url}}] * count


# (what, endpoint, body, the status it gets): each cost the old server 6 s or more of silence.
EXPENSIVE = [
    ("a body just past --max-request-bytes", "/v1/completions", lambda: {"prompt": printable(LIMIT)}, 413),
    ("a prompt under it, far past the context", "/v1/completions",
     lambda: {"prompt": printable(LIMIT - 300_000), "max_tokens": 2}, 400),
    # As many as --max-images admits by default: refused for the model, not their number.
    ("16 pictures to a text-only model", "/v1/chat/completions",
     lambda: {"messages": [{"role": "user", "content": [*pictures(16), {"type": "text", "text": "Hi"}]}]}, 400),
    # Issue 44: a grammar compiled, and a body of many small values checked, on the event loop.
    ("a 200k-string enum schema", "/v1/completions",
     lambda: {"prompt": "Hi", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
         "name": "e", "schema": {"enum": [f"s{i}" for i in range(200_000)]}}}}, 400),
    ("700k small objects where stop strings go", "/v1/completions",
     lambda: {"prompt": "Hi", "max_tokens": 2, "stop": [{}] * 700_000}, 400),
]


@pytest.mark.parametrize(("what", "endpoint", "body", "status"), EXPENSIVE, ids=[e[0] for e in EXPENSIVE])
def test_an_expensive_request_stalls_nobody(server: Served, what: str, endpoint: str, body: Any, status: int) -> None:
    payload = body()
    answered: dict[str, Any] = {}

    def send() -> None:
        start = time.monotonic()
        reply = httpx.post(server.url + endpoint, json=payload, timeout=120)
        answered.update(status=reply.status_code, seconds=time.monotonic() - start, text=reply.text)

    expensive = threading.Thread(target=send)
    expensive.start()
    time.sleep(0.3)  # its body is sent (loopback) and being handled: before, the tokenizer or the decoder ran here
    waits = []
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for _ in range(3):
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            small = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
            assert small.status_code == 200, small.text
            waits.append(time.monotonic() - start)
    expensive.join(120)
    assert answered["status"] == status, answered["text"]
    assert answered["seconds"] < PROMPT_S, f"{what} took {answered['seconds']:.1f} s to refuse"
    assert max(waits) < PROMPT_S, f"/health and a small completion waited {max(waits):.1f} s beside {what}"
    assert "\n" not in answered["text"] and len(answered["text"]) < 600, answered["text"]


# A schema whose references never bottom out, and a regex whose lexer takes seconds to build (issue 44).
LOOPING = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}
CATASTROPHIC = "(a{1000}){1000}"


def stream(server: Served, body: dict[str, Any], out: dict[str, Any]) -> None:
    """A streamed completion: its events' arrival times and texts, and whether it ended with [DONE]."""
    times, events = [], []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
        out["status"] = reply.status_code
        for line in reply.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
                events.append(line[len("data: "):])
    out.update(times=times, events=events)


def test_a_bad_grammar_ends_nobody_elses_stream(server: Served) -> None:
    """Three streams beside a looping-$ref request and a catastrophic regex at n=8: each ends with [DONE] and no gap
    over 5 s; the looping one is a 400 naming response_format in the client's words (before, every stream of the
    batch ended with its error, and the regex stopped them all for 7-17 s)."""
    outs: list[dict[str, Any]] = [{} for _ in range(3)]
    threads = [threading.Thread(target=stream, args=(server, {"prompt": f"Hello {i}", "max_tokens": 24,
                                                              "ignore_eos": True}, outs[i])) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    looping = httpx.post(server.url + "/v1/completions", timeout=120,
                         json={"prompt": "Hi", "max_tokens": 4, "response_format": LOOPING, "stream": True})
    regex = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": "Hi", "max_tokens": 4, "n": 8, "guided_regex": CATASTROPHIC})
    for t in threads:
        t.join(120)
    assert looping.status_code == 400, looping.text
    error = looping.json()["error"]
    assert error["param"] == "response_format" and "admits no output at all" in error["message"], error
    assert "NoExtensionBias" not in looping.text and "Some(" not in looping.text
    # Refused past its compile budget (1 s), or failing its own choices past llguidance's limits, or run: never at
    # the others' expense.
    assert regex.status_code in (200, 400), regex.text
    if regex.status_code == 400:
        assert regex.json()["error"]["param"] == "guided_regex", regex.text
    for out in outs:
        assert out["status"] == 200 and out["events"][-1] == "[DONE]", out["events"][-3:]
        gaps = [b - a for a, b in zip(out["times"], out["times"][1:], strict=False)]
        assert max(gaps) < 5.0, f"a stream waited {max(gaps):.1f} s beside the bad grammars"
