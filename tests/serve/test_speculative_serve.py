"""`fd serve --tp 2 --speculative ngram` as an operator starts it: completions (plain, streamed with logprobs, n=2)
equal the engine's without speculation, and /metrics counts what was proposed and accepted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from serving import Served, finish, metric, start_server

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx (pip install -e '.[cpu,test]')")

# A prompt the tiny checkpoint goes on repeating (found by trying a few), so that n-grams find what comes next.
PROMPT = [417] * 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fd_core.serve.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "tiny")


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[Served]:
    server = start_server(["--checkpoint", str(checkpoint), "--tp", "2", "--name", "tiny", "--speculative", "ngram",
                           "--num-speculative-tokens", "3"])
    yield server
    finish(server)


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> Any:
    """The same greedy and sampled completions from LLM at tp=1 without speculation."""
    from fd_core.runtime import LLM, SamplingParams

    with LLM(checkpoint, tp=1) as llm:
        greedy = llm.generate([PROMPT], SamplingParams(max_new_tokens=48, ignore_eos=True, logprobs=2))[0]
        pair = llm.generate([PROMPT], SamplingParams(max_new_tokens=48, ignore_eos=True, n=2))
    return greedy, pair


def test_served_tokens_with_speculation_equal_plain_decoding(served: Served, plain: Any) -> None:
    greedy, pair = plain
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with httpx.Client(base_url=served.url, timeout=120) as client:
        done = client.post("/v1/completions", json={**body, "n": 2}).json()
        assert [c["token_ids"] for c in done["choices"]] == [c.token_ids for c in pair]
        ids: list[int] = []
        logprobs: list[float] = []
        with client.stream("POST", "/v1/completions", json={**body, "stream": True, "logprobs": 2}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])["choices"][0]
                    ids += chunk.get("token_ids") or []
                    logprobs += (chunk.get("logprobs") or {}).get("token_logprobs") or []
        assert ids == greedy.token_ids
        assert len(logprobs) == len(ids)
        assert all(abs(a - b.logprob) < 1e-3 for a, b in zip(logprobs, greedy.logprobs, strict=True))
        text = client.get("/metrics").text
    proposed, accepted = metric(text, "fd_spec_proposed_tokens_total"), metric(text, "fd_spec_accepted_tokens_total")
    assert proposed > 0 and 0 < accepted <= proposed, (proposed, accepted)
