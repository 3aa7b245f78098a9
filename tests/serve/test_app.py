"""The HTTP side of `fd serve` in this process (FastAPI's test client, an engine that answers at once): strict request
types, a request larger than --max-queue, the API while the model loads, and pictures the server refuses."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi", reason="fd serve needs the serve extra (pip install -e '.[cpu,test]' brings it)")
pytest.importorskip("httpx", reason="FastAPI's test client needs httpx (pip install -e '.[cpu,test]')")

from fastapi.testclient import TestClient  # noqa: E402 - after the skip

from fd_core.errors import CheckpointError  # noqa: E402
from fd_core.serve.app import Server  # noqa: E402
from stand_in import Engine, error_of  # noqa: E402


@pytest.fixture
def engine() -> Engine:
    return Engine()


@pytest.fixture
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(Server(engine, name="tiny", max_queue=3).app) as client:
        yield client


CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
WRONG_TYPES = [
    ({"prompt": "Hi", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 10.0}, "max_tokens"),
    ({"prompt": "Hi", "stream": "yes"}, "stream"),
    ({"prompt": "Hi", "stream": 1}, "stream"),
    ({"prompt": "Hi", "temperature": "0.5"}, "temperature"),
    ({"prompt": "Hi", "temperature": True}, "temperature"),
    ({"prompt": "Hi", "top_p": "1"}, "top_p"),
    ({"prompt": "Hi", "top_k": "5"}, "top_k"),
    ({"prompt": "Hi", "seed": 1.5}, "seed"),
    ({"prompt": "Hi", "seed": "7"}, "seed"),
    ({"prompt": "Hi", "ignore_eos": "true"}, "ignore_eos"),
    ({"prompt": "Hi", "model": 5}, "model"),
    ({"prompt": "Hi", "stop": 5}, "stop"),
    ({"prompt": "Hi", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({**CHAT, "max_completion_tokens": "3"}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
]


@pytest.mark.parametrize("body, param", WRONG_TYPES, ids=[f"{p}={b[p] if p in b else ''!r}" for b, p in WRONG_TYPES])
def test_a_value_of_the_wrong_json_type_is_a_400_naming_the_field_never_converted(
    client: TestClient, engine: Engine, body: dict[str, Any], param: str,
) -> None:
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    error = error_of(client.post(endpoint, json=body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"{param}: ") and "\n" not in error["message"], error
    assert engine.submitted == []


def test_the_message_says_what_was_sent_and_what_to_send(client: TestClient) -> None:
    error = error_of(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": "10"}), 400)
    assert error["message"] == ('max_tokens: Input should be a valid integer (got "10"); send an integer (values of '
                                'another JSON type are not converted)')
    # A union (a string or a list of strings) is not said to take only its first member.
    stop = error_of(client.post("/v1/completions", json={"prompt": "Hi", "stop": 5}), 400)["message"]
    assert "send" not in stop


def test_integers_are_still_numbers(client: TestClient, engine: Engine) -> None:
    reply = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 1, "top_p": 1,
                                                 "seed": 4, "stream": True, "stream_options": {"include_usage": False}})
    assert reply.status_code == 200, reply.text
    sampling = engine.submitted[-1]
    assert (sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.seed) == (3, 1.0, 1.0, 4)
    chat = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "logprobs": False, "stream": False})
    assert chat.status_code == 200, chat.text


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_retry(client: TestClient, engine: Engine) -> None:
    error = error_of(client.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 2}), 400)
    assert error["param"] == "prompt" and "--max-queue 3" in error["message"]
    assert "asks for 4 sequences" in error["message"] and "send fewer prompts or a smaller n" in error["message"]
    assert engine.submitted == []
    # As many as it holds are served.
    assert client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2}).status_code == 200


def test_a_busy_queue_is_still_a_503_with_retry_after(engine: Engine) -> None:
    server = Server(engine, name="tiny", max_queue=3)
    with TestClient(server.app) as client:
        server.admitted = 2  # two prompts in flight
        busy = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
        assert error_of(busy, 503)["code"] == "queue_full" and busy.headers["retry-after"] == "1"


def test_while_the_model_loads_health_and_the_api_answer_503(engine: Engine) -> None:
    server = Server(None, name="tiny", api_key="k")
    key = {"Authorization": "Bearer k"}
    with TestClient(server.app) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading", health.text
        assert health.headers["retry-after"] == "5"
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            # Before the body is read: a valid one or not, the answer is "loading".
            refused = client.request(method, path, json={"prompt": 5}, headers=key)
            error = error_of(refused, 503)
            assert error["code"] == "loading" and refused.headers["retry-after"] == "5", error
            assert "retry once GET /health answers 200" in error["message"]
        assert error_of(client.get("/v1/models"), 401)["code"] == "invalid_api_key"  # the key first
        assert client.get("/metrics").status_code == 200
        server.attach(engine)
        assert client.get("/health").json()["status"] == "ok"
        assert client.post("/v1/completions", json={"prompt": "Hi"}, headers=key).status_code == 200


def picture(kind: str) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (10, 20, 30)).save(buffer, format=kind)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["GIF", "BMP", "TIFF", "WEBP"])
def test_a_picture_neither_png_nor_jpeg_is_a_400_over_http(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"a.{kind.lower()}"
    path.write_bytes(picture(kind))
    server = Server(Engine(), name="tiny", image_roots=(tmp_path,))
    with TestClient(server.app) as client:
        for url in (f"data:image/png;base64,{base64.b64encode(picture(kind)).decode()}", str(path)):
            body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
            error = error_of(client.post("/v1/chat/completions", json=body), 400)
            assert "only PNG or JPEG are accepted" in error["message"], error


@pytest.mark.parametrize("url", ["/tmp/a\x00b.png", "/" + "x" * 5000, "/" + "y" * 300 + "/a.png"],
                         ids=["nul", "5000-characters", "a-300-character-name"])
def test_an_impossible_path_is_a_400_not_a_500(url: str) -> None:
    server = Server(Engine(), name="tiny", image_roots=(Path("/"),))
    with TestClient(server.app, raise_server_exceptions=False) as client:
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        reply = client.post("/v1/chat/completions", json=body)
        error = error_of(reply, 400)
        assert error["param"] == "messages" and len(error["message"]) < 400, error


def test_a_content_part_fd_does_not_read_is_named_with_its_type(client: TestClient, engine: Engine) -> None:
    """Before, pydantic's union error: "messages.0.content: Input should be a valid string (got [...])"."""
    for kind in ("audio", "input_audio", "file"):
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": kind}]}]}
        error = error_of(client.post("/v1/chat/completions", json=body), 400)
        assert error["param"] == "messages[0].content[1].type", error
        assert error["message"] == (f"messages[0].content[1].type {kind!r} is not supported; send \"text\" or "
                                    f"\"image_url\" parts (fd serve reads text and pictures)"), error
    assert engine.submitted == []


def test_a_tool_choice_naming_no_offered_tool_lists_a_few_of_them(client: TestClient, engine: Engine) -> None:
    """Two thousand tools made a 10 KB message listing every name."""
    tools = [{"type": "function", "function": {"name": f"tool_{i:04d}"}} for i in range(2000)]
    body = {**CHAT, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    error = error_of(client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "tool_choice", error
    assert error["message"] == ("tool_choice names function 'nope', which is not among tools (tool_0000, tool_0001, "
                                "tool_0002, tool_0003, tool_0004 and 1995 more)"), error
    assert engine.submitted == []


@pytest.mark.parametrize("header, status", [
    ("Bearer k3y", 200), ("bearer k3y", 200), ("BEARER k3y", 200), ("bEaReR  k3y", 200),
    ("Bearer K3Y", 401), ("Basic k3y", 401), ("Bearerk3y", 401), ("k3y", 401), ("Bearer", 401), ("Bearer ", 401),
])
def test_the_auth_scheme_is_case_insensitive_the_key_is_not(engine: Engine, header: str, status: int) -> None:
    """RFC 9110 section 11.1: "bearer k3y" is the same credentials as "Bearer k3y" (it was refused with 401)."""
    with TestClient(Server(engine, name="tiny", api_key="k3y").app) as client:
        reply = client.post("/v1/completions", json={"prompt": "Hi"}, headers={"Authorization": header})
        assert reply.status_code == status, (header, reply.text)


def test_health_and_metrics_are_never_counted_a_405_neither(client: TestClient) -> None:
    """docs/serving.md: /health and /metrics are not counted; a POST to them (405) was, under their routes."""
    assert client.post("/health").status_code == 405 and client.post("/metrics").status_code == 405
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json={"prompt": "Hi"}).status_code == 200
    counted = [line for line in client.get("/metrics").text.splitlines() if line.startswith("fd_requests_total{")]
    assert counted == ['fd_requests_total{endpoint="/v1/completions",status="200"} 1.0'], counted


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """The tiny preset's checkpoint through the Python API in this process, and the same without its tokenizer."""
    import shutil

    from fd_core.runtime import LLM
    from fd_core.serve.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    whole = write_tiny_checkpoint(root / "whole")
    bare = root / "bare"
    shutil.copytree(whole, bare)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        (bare / name).unlink(missing_ok=True)
    with LLM(whole, tp=1) as llm, LLM(bare, tp=1) as tokenless:
        yield llm, tokenless


def test_the_engine_answers_a_client_in_its_terms_without_the_servers_paths(
    tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fd serve runs under the command line's style (FD_SETTINGS_STYLE=cli), but what the engine says about a request
    is the client's to read: a 9 M-character message named the server's temporary tokenizer_config.json and told the
    client to "fix the template"; a model without a tokenizer told it to pass --prompt-ids, naming the directory."""
    from fd_core.errors import SETTINGS_STYLE_ENV
    from fd_core.runtime.text.chat import MAX_RENDER_CHARS

    monkeypatch.setenv(SETTINGS_STYLE_ENV, "cli")
    llm, tokenless = tiny
    with TestClient(Server(llm, name="tiny").app) as client:
        huge = {"messages": [{"role": "user", "content": "x" * 9_000_000}], "max_tokens": 2}
        error = error_of(client.post("/v1/chat/completions", json=huge), 400)
        assert error["message"] == (f"the messages hold 9000000 characters of text, more than the {MAX_RENDER_CHARS} "
                                    f"fd renders through a chat template; shorten them"), error
        assert client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200
    with TestClient(Server(tokenless, name="bare").app) as client:
        for endpoint, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", CHAT)):
            message = error_of(client.post(endpoint, json={**body, "max_tokens": 2}), 400)["message"]
            assert "/" not in message.replace("/v1/completions", "") and "--" not in message, message
            assert "send the prompt as token ids (\"prompt\": [1, 2, 3]) to /v1/completions" in message, message
        assert client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}).status_code == 200
    # Outside a request, the process's own style: fd run's words, with the directory.
    with pytest.raises(CheckpointError, match=r"/bare has no tokenizer .*; pass token ids with --prompt-ids"):
        tokenless.submit("Hi")


@pytest.mark.parametrize(("field", "value", "says"), [
    ("web_search_options", {}, "does not search the web"),
    ("verbosity", "low", "no verbosity control"),
    ("stream_options", {"include_usage": True}, "only allowed with stream: true"),
    ("temperature", 2.5, "less than or equal to 2"),
])
def test_openai_fields_fd_does_not_serve_are_refused_not_ignored(
    client: TestClient, engine: Engine, field: str, value: Any, says: str
) -> None:
    """Issue 49: these were accepted and silently ignored (OpenAI answers 400 for stream_options without stream, and
    takes temperatures up to 2)."""
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", dict(CHAT))):
        error = error_of(client.post(path, json={**body, field: value}), 400)
        assert error["param"] == field and says in error["message"], error


def test_prompt_cache_key_and_safety_identifier_are_accepted_and_change_nothing(
    client: TestClient, engine: Engine
) -> None:
    plain = client.post("/v1/completions", json={"prompt": "Hi", "seed": 1})
    keyed = client.post("/v1/completions", json={"prompt": "Hi", "seed": 1, "prompt_cache_key": "k",
                                                 "safety_identifier": "user-1"})
    assert plain.status_code == keyed.status_code == 200, keyed.text
    assert engine.submitted[-1] == engine.submitted[-2]


def test_a_prompt_list_mixing_text_and_ids_is_named_as_such(client: TestClient) -> None:
    """Issue 49: it was "prompt.0: Input should be a valid string"."""
    error = error_of(client.post("/v1/completions", json={"prompt": ["Hello", [1, 2, 3]]}), 400)
    assert error["param"] == "prompt" and error["message"] == (
        "prompt: a list of prompts holds all strings or all token-id lists, not both (item 0 is text, item 1 token "
        "ids); send one kind per request"), error
