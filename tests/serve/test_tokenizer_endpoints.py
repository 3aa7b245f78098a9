"""The tokenizer's endpoints (/tokenize, /detokenize, /tokenizer_info, as vLLM serves them and lm-evaluation-harness's
remote tokenizer reads them) and streaming from ids (issue 52): against the `tokenizers` library reading the same
tokenizer.json, and the engine's own tokens through the Python API. The app runs in this process over a real LLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from fd_core.runtime import LLM, SamplingParams

pytest.importorskip("fastapi", reason="fd serve needs the serve extra (pip install -e '.[cpu,test]')")

from fastapi.testclient import TestClient  # noqa: E402

from fd_core.serve.app import Server  # noqa: E402

TEXT = "Hello, world! The quick brown fox: 2026 Café"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fd_core.runtime.save_random import save_random_checkpoint
    from fd_core.serve.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tokenizer-endpoints")
    return {"text": write_tiny_checkpoint(root / "text"),
            "ids": Path(save_random_checkpoint("ernie4_5", str(root / "ids"), seed=0))}


@pytest.fixture(scope="module")
def llms(checkpoints: dict[str, Path]) -> Iterator[dict[str, LLM]]:
    with LLM(checkpoints["text"], tp=1, graph="off") as text, LLM(checkpoints["ids"], tp=1, graph="off") as ids:
        yield {"text": text, "ids": ids}


def _client(llm: LLM, **options: Any) -> TestClient:
    return TestClient(Server(llm, name="tiny", **options).app)


def test_tokenize_and_detokenize_agree_with_the_tokenizers_library(
    llms: dict[str, LLM], checkpoints: dict[str, Path]
) -> None:
    from tokenizers import Tokenizer as Reference

    reference = Reference.from_file(str(checkpoints["text"] / "tokenizer.json"))
    want = reference.encode(TEXT, add_special_tokens=False).ids
    with _client(llms["text"]) as client:
        got = client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False})
        assert got.status_code == 200, got.text
        assert got.json() == {"count": len(want), "tokens": want}
        back = client.post("/detokenize", json={"tokens": want, "model": "tiny"})
        assert back.status_code == 200 and back.json() == {"prompt": reference.decode(want, skip_special_tokens=False)}
        assert back.json()["prompt"] == TEXT
        info = client.get("/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("</s>", "<s>", "<pad>")
    assert info["chat_template"] == llms["text"].chat_template and info["chat_template"]


def test_the_tokenizer_endpoints_refuse_clearly(llms: dict[str, LLM]) -> None:
    with _client(llms["text"], api_key="k") as client:
        assert client.post("/tokenize", json={"prompt": "Hi"}).status_code == 401  # behind the key, as /v1 is
        auth = {"Authorization": "Bearer k"}
        outside = client.post("/detokenize", json={"tokens": [1, 10**9]}, headers=auth)
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens", outside.text
        assert "tokens[1] = 1000000000 is not a token" in outside.json()["error"]["message"]
        missing = client.post("/tokenize", json={"text": "Hi"}, headers=auth)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt", missing.text
        other = client.post("/tokenize", json={"prompt": "Hi", "model": "other"}, headers=auth)
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    with _client(llms["ids"]) as client:
        for answer in (client.post("/tokenize", json={"prompt": "Hi"}), client.post("/detokenize", json={"tokens": [1]}),
                       client.get("/tokenizer_info")):
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "no_tokenizer", answer.text
            assert "has no tokenizer" in answer.json()["error"]["message"] and "\n" not in answer.text


def _chunks(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        lines = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_checkpoint_without_a_tokenizer_streams_a_chunk_per_token_with_its_id(llms: dict[str, LLM]) -> None:
    """Before, every token's text was empty and rode with the next, so the whole answer came in one chunk at the end."""
    prompt = [5, 17, 42, 99, 7]
    want = llms["ids"].generate(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    with _client(llms["ids"]) as client:
        chunks = _chunks(client, {"prompt": prompt, "max_tokens": 6, "ignore_eos": True})
    tokens = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert [t["token_ids"] for t in tokens] == [[i] for i in want]  # one chunk a token, in order
    assert all(t["text"] == "" for t in tokens)


def test_return_token_ids_gives_every_chunks_ids_and_the_whole_answers(llms: dict[str, LLM]) -> None:
    with _client(llms["text"]) as client:
        body = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
        whole = client.post("/v1/completions", json=body).json()["choices"][0]
        chunks = _chunks(client, body)
    want = llms["text"].generate("Hello", SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert whole["token_ids"] == want.token_ids and whole["text"] == want.text
    streamed = [c["choices"][0] for c in chunks if c["choices"] and "token_ids" in c["choices"][0]]
    assert [i for c in streamed for i in c["token_ids"]] == want.token_ids
    assert "".join(c["text"] for c in streamed) == want.text
    assert len(streamed) == len(want.token_ids)  # a chunk a token, one that completes no character included


def test_echo_with_max_tokens_0_scores_the_prompt_alone(llms: dict[str, LLM]) -> None:
    """What evaluation harnesses send for log-likelihoods (issue 49): the prompt and its logprobs, nothing generated.
    The logprobs are the Python API's prompt_logprobs (themselves checked against transformers in
    tests/models/test_reference.py)."""
    prompt = "Hello world, the quick brown fox"
    want = llms["text"].generate(prompt, SamplingParams(max_new_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
    assert want is not None
    body = {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1}
    with _client(llms["text"]) as client:
        whole = client.post("/v1/completions", json=body).json()
        chunks = _chunks(client, {**body, "stream_options": {"include_usage": True}})
        refused = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    choice = whole["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 0
    scored = choice["logprobs"]["token_logprobs"]
    assert scored[0] is None and scored[1:] == pytest.approx([p.logprob for p in want[1:]], abs=1e-6)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == prompt and chunks[-1]["usage"]["completion_tokens"] == 0
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
