"""`fd serve --role prefill`, `--role decode` and `--role router` as real processes on 127.0.0.1, handing requests over
through the `shm` transport: the router's answers equal the decode instance's own (streamed and whole, completions and
chat, greedy and seeded sampling with logprobs, 8 clients at once); a decode instance killed mid-stream gives the client
an error event naming it within 30 s, leaves the router up (503 naming the stage while none is left) and no block in
use on the prefill side; a prefill instance that hangs or dies is left out and its requests prefilled elsewhere."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any, Iterator

import pytest

from serving import Served, finish, left_over, metric, start_server, wait_for

httpx = pytest.importorskip("httpx")

COMPLETION = {"model": "ernie4_5-tiny", "prompt": "Once upon a time there was a", "max_tokens": 12, "temperature": 0}
CHAT = {"model": "ernie4_5-tiny", "messages": [{"role": "user", "content": "Hello there, how are you today"}],
        "max_tokens": 10, "temperature": 0.8, "seed": 4, "logprobs": True, "top_logprobs": 2}


@pytest.fixture(scope="module")
def roles() -> Iterator[tuple[Served, Served, Served]]:
    decode = start_server(["--role", "decode"])
    prefill = start_server(["--role", "prefill"])
    router = start_server(["--role", "router", "--prefill", prefill.url, "--decode", decode.url])
    try:
        yield prefill, decode, router
    finally:
        failures = []
        for served in (router, prefill, decode):  # every one stopped, whichever fails to stop cleanly
            if served.process.poll() is None:
                try:
                    finish(served)
                except AssertionError as exc:
                    failures.append(exc)
        assert not failures, failures[0]


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """The status and the answer: the JSON, or a stream's events (its `data:` objects, then "[DONE]" if it came)."""
    response = httpx.post(url + path, json=body, timeout=120)
    if not body.get("stream"):
        return response.status_code, response.json()
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return response.status_code, [e if e == "[DONE]" else json.loads(e) for e in events]


def _shown(answer: Any) -> Any:
    """What a client reads of an answer, without the ids and times each server makes up; logprobs to 5 decimals (the
    first token's comes from the prefill instance's step, whose sums may round differently in the last bits)."""
    if isinstance(answer, list):
        return [_shown(e) for e in answer]
    if isinstance(answer, dict):
        return {k: _shown(v) for k, v in answer.items() if k not in ("id", "created", "system_fingerprint")}
    if isinstance(answer, float):
        return round(answer, 5)
    return answer


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
                         ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_routers_answer_is_the_decode_instances_own(roles: tuple[Served, Served, Served], path: str,
                                                        body: dict[str, Any], stream: bool) -> None:
    prefill, decode, router = roles
    sent = httpx.get(prefill.url + "/metrics").text
    request = {**body, "stream": stream}
    alone, routed = _post(decode.url, path, request), _post(router.url, path, request)
    assert routed[0] == alone[0] == 200, routed
    assert _shown(routed[1]) == _shown(alone[1])
    assert metric(httpx.get(prefill.url + "/metrics").text, "fd_kv_sent_tokens_total") > metric(
        sent, "fd_kv_sent_tokens_total"), "the request was not handed over"


def test_structured_output_through_the_router(roles: tuple[Served, Served, Served]) -> None:
    """A json_schema response_format: the decode instance's grammar goes on past the token the prefill instance chose
    under it, so the answer is the one a single server gives (not a second object begun after the first token)."""
    prefill, decode, router = roles
    body = {**CHAT, "temperature": 0, "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {
                "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}
    alone, routed = _post(decode.url, "/v1/chat/completions", body), _post(router.url, "/v1/chat/completions", body)
    assert routed[0] == alone[0] == 200, routed
    assert _shown(routed[1]) == _shown(alone[1])
    assert routed[1]["choices"][0]["message"]["content"].startswith('{"a": ')  # the object the schema asks for


def test_eight_clients_at_once(roles: tuple[Served, Served, Served]) -> None:
    prefill, decode, router = roles
    bodies = [{**COMPLETION, "prompt": f"Story number {i}: once upon a time", "max_tokens": 8 + i} for i in range(8)]
    alone = [_post(decode.url, "/v1/completions", b)[1]["choices"] for b in bodies]
    routed: dict[int, Any] = {}

    def client(i: int) -> None:
        routed[i] = _post(router.url, "/v1/completions", bodies[i])[1]["choices"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [routed.get(i) for i in range(8)] == alone
    for served in (prefill, decode):
        assert metric(httpx.get(served.url + "/metrics").text, "fd_kv_cache_blocks_used") == 0


def test_what_the_prefill_instance_answers_alone_comes_back_as_it_is(roles: tuple[Served, Served, Served]) -> None:
    """A request that ends at its first token is answered by the prefill instance (nothing handed over), and a request
    it refuses comes back with its 400 and message."""
    prefill, decode, router = roles
    status, answer = _post(router.url, "/v1/completions", {**COMPLETION, "max_tokens": 1})
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    status, answer = _post(router.url, "/v1/completions", {**COMPLETION, "temperature": -1})
    assert status == 400 and "temperature" in answer["error"]["message"], answer
    status, answer = _post(router.url, "/v1/completions", {**COMPLETION, "n": 2})
    assert status == 400 and "hand-over is of one prompt with n=1" in answer["error"]["message"], answer


def test_a_decode_instance_killed_mid_stream(roles: tuple[Served, Served, Served]) -> None:
    """Last in this module: it kills the decode instance. The client's stream ends with an error event naming it within
    30 s; the router stays up, answers 503 naming the decode stage, and the prefill side holds no block."""
    prefill, decode, router = roles
    body = {**COMPLETION, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
                break
        killed = time.monotonic()
        os.killpg(decode.process.pid, signal.SIGKILL)
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
    waited = time.monotonic() - killed
    assert waited < 30, waited
    last = json.loads(events[-1][6:])
    assert last["error"]["code"] == "decode_failed" and decode.url in last["error"]["message"], events[-1]
    decode.process.wait(10)
    status, answer = _post(router.url, "/v1/completions", COMPLETION)
    assert status == 503 and "decode instance" in answer["error"]["message"], answer
    assert httpx.get(router.url + "/health").status_code == 503
    assert httpx.get(prefill.url + "/health").status_code == 200
    wait_for(lambda: metric(httpx.get(prefill.url + "/metrics").text, "fd_kv_cache_blocks_used") == 0, 10,
             "the prefill instance's blocks freed")
    assert left_over(decode.marker) == []


def test_a_prefill_instance_that_hangs_or_dies_is_left_out() -> None:
    """Own instances (the module's are shared): two prefill instances behind a router whose timeout is 3 s. One frozen
    (SIGSTOP) before the request reaches it costs that request the timeout, then it is prefilled on the other and
    answered as the decode instance answers it alone; the next request, within the DOWN_S (5 s) the router leaves the
    frozen one out, skips it at once. With both prefill instances gone, a
    request gets a 503 naming the prefill stage within seconds, not a hang; the decode instance holds no block."""
    decode = start_server(["--role", "decode"])
    hung = start_server(["--role", "prefill"])
    other = start_server(["--role", "prefill"])
    router = start_server(["--role", "router", "--prefill", hung.url, "--prefill", other.url, "--decode", decode.url,
                           "--router-timeout", "3"])
    try:
        status, want = _post(decode.url, "/v1/completions", COMPLETION)
        assert status == 200, want
        # Warm: its first request's own start-up must not push the next request past the 5 s the frozen one is out.
        assert httpx.post(other.url + "/v1/completions", json=COMPLETION, timeout=120).status_code == 200
        os.kill(hung.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        status, answer = _post(router.url, "/v1/completions", COMPLETION)  # the first choice is the frozen one
        took = time.monotonic() - started
        assert status == 200 and _shown(answer) == _shown(want), answer
        assert 3 <= took < 6, took
        started = time.monotonic()
        status, answer = _post(router.url, "/v1/completions", COMPLETION)
        assert status == 200 and _shown(answer) == _shown(want) and time.monotonic() - started < 3, answer
        os.killpg(hung.process.pid, signal.SIGKILL)
        hung.process.wait(10)
        finish(other)
        started = time.monotonic()
        status, answer = _post(router.url, "/v1/completions", COMPLETION)
        assert status == 503 and "prefill instance" in answer["error"]["message"], answer
        assert time.monotonic() - started < 10
        assert metric(httpx.get(decode.url + "/metrics").text, "fd_kv_cache_blocks_used") == 0
    finally:
        for served in (router, decode, other):
            if served.process.poll() is None:
                finish(served)
        if hung.process.poll() is None:
            os.killpg(hung.process.pid, signal.SIGKILL)
            hung.process.wait(10)
    assert left_over(hung.marker) == []


def test_a_router_without_instances_or_options_out_of_place_are_refused() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fd_core.cli", "serve", "--role", "router", "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "fd: error: --role router needs at least one --prefill URL and one --decode URL"), done.stderr
    done = subprocess.run([sys.executable, "-m", "fd_core.cli", "serve", "--decode", "http://x", "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "pass them with --role router" in done.stderr, done.stderr
