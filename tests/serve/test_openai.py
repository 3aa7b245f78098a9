"""The official `openai` client against `fd serve` at tp=1 and tp=2 (one server per tp, started as a user starts it):
completions, chat, streaming, stop strings, seeds and 16 concurrent clients, each compared with the same request
through the Python API's LLM one at a time; and every error case in the OpenAI error format."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from fakedist import make_distribution
from fd_core.runtime.engine.sampling import SamplingParams
from serving import GATE, Served, finish, metric, start_server, wait_for

# Without them (the test extra brings both) the module skips, saying which is missing.
httpx = pytest.importorskip("httpx", reason="the serve tests need httpx (pip install -e '.[cpu,test]')")
openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (pip install -e '.[cpu,test]')")

PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time", "A language model reads", "Numbers like 1, 2, 3",
           "The server keeps the model", "Clients send prompts", "How are you today?"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fd_core.serve.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def oracle(checkpoint: Path) -> Iterator[Any]:
    """The same checkpoint through the Python API in this process, one request at a time."""
    from fd_core.runtime import LLM

    with LLM(checkpoint, tp=1) as llm:
        yield llm


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(
    request: pytest.FixtureRequest, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    site = make_distribution(tmp_path_factory.mktemp("site"), "fd-serve-gate", {"serve_gate": GATE},
                             {"fd.plugins": {"serve_gate": "serve_gate"}})
    served = start_server(["--checkpoint", str(checkpoint), "--tp", str(request.param), "--max-queue", "32"], site=site)
    yield served
    finish(served, interrupt=request.param == 2)  # tp=2 ends as Ctrl-C ends it: SIGINT to the server and its ranks


@pytest.fixture
def client(server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def expected(oracle: Any, prompt: Any, chat: bool = False, **sampling: Any) -> Any:
    return oracle.generate(prompt, SamplingParams(**sampling), chat=chat)[0]


def test_models_health_and_metrics_answer(server: Served, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    before = httpx.get(f"{server.url}/metrics").text
    assert "# TYPE fd_time_to_first_token_seconds histogram" in before and metric(before, "fd_queue_length") == 0
    reply = client.completions.create(model="tiny", prompt="Hello there", max_tokens=9, extra_body={"ignore_eos": True})
    after = httpx.get(f"{server.url}/metrics").text
    assert reply.usage.completion_tokens == 9
    assert metric(after, "fd_generation_tokens_total") - metric(before, "fd_generation_tokens_total") == 9
    assert (metric(after, "fd_prompt_tokens_total") - metric(before, "fd_prompt_tokens_total")
            == reply.usage.prompt_tokens)
    assert (metric(after, "fd_time_to_first_token_seconds_count")
            - metric(before, "fd_time_to_first_token_seconds_count") == 1)
    assert metric(after, "fd_decode_tokens_total") - metric(before, "fd_decode_tokens_total") == 8
    assert metric(after, "fd_decode_tokens_per_second") > 0
    assert 'fd_requests_total{endpoint="/v1/completions",status="200"}' in after
    # The paged KV cache: its blocks, none held between requests, and the prefix tokens looked up.
    assert metric(after, "fd_kv_cache_blocks_total") > 0 and metric(after, "fd_kv_cache_blocks_used") == 0
    assert (metric(after, "fd_prefix_cache_queried_tokens_total")
            - metric(before, "fd_prefix_cache_queried_tokens_total") == reply.usage.prompt_tokens)
    assert metric(after, "fd_preemptions_total") == 0
    # The same system prompt again, a whole block long: its first block is found cached.
    shared = "word " * 40
    for question in ("one?", "two?"):
        client.completions.create(model="tiny", prompt=shared + question, max_tokens=2)
    hits = metric(httpx.get(f"{server.url}/metrics").text, "fd_prefix_cache_hit_tokens_total")
    assert hits >= 16, f"a repeated prefix of 40 words found {hits} tokens cached"


def test_completions_equal_the_engine_alone(client: openai.OpenAI, oracle: Any) -> None:
    reasons = set()
    for prompt, tokens in zip(PROMPTS[:3], (12, 5, 20), strict=True):
        want = expected(oracle, prompt, max_new_tokens=tokens)
        reasons.add(want.finish_reason)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=tokens)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[want.finish_reason]
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_ids), len(want.token_ids))
    # both mappings were seen ("Hello world" meets the end-of-sequence id at its 7th token)
    assert reasons == {"eos", "length"}
    # Token ids in, and several prompts in one request (one choice each, in order).
    ids = oracle.tokenizer.encode("Hello world")
    assert (client.completions.create(model="tiny", prompt=ids, max_tokens=6).choices[0].text
            == expected(oracle, ids, max_new_tokens=6).text)
    many = client.completions.create(model="tiny", prompt=PROMPTS[3:5], max_tokens=7)
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == [
        expected(oracle, p, max_new_tokens=7).text for p in PROMPTS[3:5]
    ]


def test_chat_goes_through_the_chat_template(client: openai.OpenAI, oracle: Any, checkpoint: Path) -> None:
    want = expected(oracle, "Say hello", chat=True, max_new_tokens=10)
    got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hello"}],
                                         max_tokens=10)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_ids)
    # A conversation: rendered here with jinja2 from the checkpoint's template, as an independent reading of it.
    import jinja2

    template = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Count"}]
    rendered = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=turns, add_generation_prompt=True, bos_token="<s>")
    ids = oracle.tokenizer.encode(rendered, add_special_tokens=False)
    got = client.chat.completions.create(model="tiny", messages=turns, max_tokens=9)  # type: ignore[arg-type]
    assert got.usage.prompt_tokens == len(ids)
    assert got.choices[0].message.content == expected(oracle, ids, max_new_tokens=9).text


def test_streaming_sends_the_same_text_in_openai_chunks_ending_with_done(
    server: Served, client: openai.OpenAI, oracle: Any,
) -> None:
    want = expected(oracle, PROMPTS[5], max_new_tokens=24)
    chunks = list(
        client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=24, stream=True,
                                  stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    # piece by piece, not the whole text at the end
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1
    assert ([c.choices[0].finish_reason for c in chunks if c.choices][-1]
            == {"eos": "stop", "stop": "stop", "length": "length"}[want.finish_reason])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    chat_want = expected(oracle, "Tell a story", chat=True, max_new_tokens=16)
    deltas = list(
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell a story"}],
                                       max_tokens=16, stream=True)
    )
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == chat_want.text
    assert deltas[-1].choices[0].finish_reason is not None
    # On the wire: server-sent events, each `data: {json}`, the last `data: [DONE]`.
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "stream": True},
                      timeout=60) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        events = [line for line in raw.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] is not None


def test_a_stop_string_cuts_the_text_before_it(client: openai.OpenAI, oracle: Any) -> None:
    whole = expected(oracle, PROMPTS[6], max_new_tokens=32).text
    stop = next(ch for ch in whole[3:] if ch.isascii() and ch.isalnum())  # a character that appears after the start
    cut = whole[: whole.index(stop)]
    got = client.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=32, stop=[stop])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=32, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_a_seed_gives_the_same_sample_and_another_seed_another(client: openai.OpenAI, oracle: Any) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt="Once", max_tokens=16, temperature=1.0, top_p=0.95,
                                         seed=seed).choices[0].text or ""

    first = sample(7)
    assert first == sample(7) == expected(oracle, "Once", max_new_tokens=16, temperature=1.0, top_p=0.95, seed=7).text
    assert any(sample(seed) != first for seed in (8, 9))
    # Without a seed each request draws anew, as OpenAI's API does (not seed 0 every time).
    unseeded = {
        client.completions.create(model="tiny", prompt="Once", max_tokens=16, temperature=1.0).choices[0].text
        for _ in range(3)
    }
    assert len(unseeded) > 1


def test_sixteen_concurrent_clients_get_their_sequential_outputs(server: Served, oracle: Any) -> None:
    jobs = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 6 + i % 7, i % 3 == 0) for i in range(16)]
    sequential = [expected(oracle, p, max_new_tokens=n).text for p, n, _ in jobs]

    def ask(job: tuple[str, int, bool]) -> str:
        prompt, tokens, stream = job
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        if stream:
            return "".join(c.choices[0].text
                           for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=tokens,
                                                              stream=True))
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=tokens).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(ask, jobs))
    assert concurrent == sequential


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The response is `status` with an OpenAI error body and no traceback."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in response.text
    return dict(body["error"])


def test_errors_come_in_the_openai_format_with_one_log_line_each(
    server: Served, client: openai.OpenAI, oracle: Any,
) -> None:
    url = f"{server.url}/v1/completions"
    logged = len([line for line in server.lines if line.startswith("fd serve: 4")])
    assert "not valid JSON" in openai_error(
        httpx.post(url, content=b'{"prompt": "Hi",', headers={"content-type": "application/json"}), 400
    )["message"]
    wrong = openai_error(httpx.post(url, json={"prompt": "Hi", "max_tokens": "many"}), 400)
    assert wrong["param"] == "max_tokens"
    assert openai_error(httpx.post(url, json={"max_tokens": 3}), 400)["param"] == "prompt"
    assert openai_error(httpx.post(url, json={"prompt": "Hi", "n": 0}), 400)["param"] == "n"
    assert openai_error(httpx.post(f"{server.url}/v1/embeddings", json={}), 404)["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=3)
    assert unknown.value.status_code == 404 and "'gpt-4' is not served here" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt="Hello world", max_tokens=5000)
    n = len(oracle.tokenizer.encode("Hello world"))
    assert f"has {n} tokens and 5000 new tokens are asked for: {n + 5000} exceed the model's context of 4096" in long.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=13)
    assert "this device cannot generate 13 tokens" in refused.value.message and refused.value.code == "request_refused"
    # A picture to a text-only model is refused before it is read (--max-images and the pixel bound: test_limits.py).
    picture = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGNgAAAAAgABSK+kcQAAAABJRU5ErkJggg=="
    with pytest.raises(openai.BadRequestError, match="takes no image"):
        client.chat.completions.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": "What is this?"}]}])
    def errors() -> list[str]:
        return [line for line in server.lines if line.startswith("fd serve: 4")]

    # The server's stderr is read by a thread of this process: its last line may land a moment after the answer.
    wait_for(lambda: len(errors()) - logged >= 9, 5, "nine error lines")
    time.sleep(0.2)
    assert len(errors()) - logged == 9, server.stderr
    assert not [line for line in server.lines if "Traceback" in line], server.stderr
    # The server is still serving.
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text is not None


def test_unknown_paths_add_no_series_and_the_page_parses(server: Served) -> None:
    """Round 4's hostile /metrics: a quote in an unknown path used to be written unescaped into a label (breaking
    Prometheus' parser for the whole page), and each distinct unknown path added a series for good."""
    from prometheus_client.parser import text_string_to_metric_families

    for i in range(40):
        assert httpx.get(f"{server.url}/x{i}%22%7D%201%2Cstatus=%22404%22%7D").status_code == 404
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}  # raises on a malformed page
    endpoints = {s.labels["endpoint"] for s in families["fd_requests"].samples}
    # /health and /metrics are never counted, a 405 to them neither (docs/serving.md, Metrics).
    assert "unmatched" in endpoints and all(e == "unmatched" or e.startswith("/v1/") for e in endpoints), endpoints
    unmatched = [s for s in families["fd_requests"].samples
                 if s.labels["endpoint"] == "unmatched" and s.labels["status"] == "404"]
    assert len(unmatched) == 1 and unmatched[0].value >= 40


def test_head_where_get_works_and_405_says_which_methods(server: Served) -> None:
    """Round 4's weak cases: HEAD /health was 405, and a 405 came without Allow."""
    for path in ("/health", "/metrics", "/v1/models"):
        head = httpx.head(f"{server.url}{path}")
        assert head.status_code == 200 and head.content == b"", path
    wrong = httpx.post(f"{server.url}/health")
    assert wrong.status_code == 405 and set(wrong.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
    assert wrong.json()["error"]["type"] == "invalid_request_error"


REFUSED = [
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 65}, "n"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"min_tokens": 3}, "min_tokens"),
    ("/v1/completions", {"logit_bias": {"five": 10}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces",
                                                                                         "schema": {}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "12:00"}]}, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0]"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
]


@pytest.mark.parametrize("endpoint, fields, param", REFUSED, ids=[f"{e.rsplit('/', 1)[-1]}-{p}" for e, _, p in REFUSED])
def test_a_field_fd_does_not_serve_is_refused_never_ignored(
    server: Served, endpoint: str, fields: dict[str, Any], param: str
) -> None:
    """Issue 37: response_format, tools and top_logprobs were silently ignored (200 with text that ignores them).
    Logprobs, n, the penalties, logit_bias and structured output are served: the values they may not take are refused
    naming the field; best_of and suffix are refused; tools are served on chat only."""
    base = {"prompt": "Hi"} if endpoint.endswith("/completions") and "chat" not in endpoint else {
        "messages": [{"role": "user", "content": "Hi"}]}
    error = openai_error(httpx.post(f"{server.url}{endpoint}", json={**base, "max_tokens": 2, **fields}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_max_completion_tokens_is_honoured_on_both_endpoints(client: openai.OpenAI) -> None:
    """Issue 37: /v1/completions ignored it (16 tokens generated)."""
    done = client.completions.create(model="tiny", prompt="Hello", extra_body={"max_completion_tokens": 3,
                                                                                "ignore_eos": True})
    assert done.usage.completion_tokens == 3
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3
    # The defaults a client may send are served: response_format text, tool_choice none, text modality.
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=2,
                                           response_format={"type": "text"}, tool_choice="none", modalities=["text"])
    assert plain.choices[0].message.content is not None


# -- logprobs ---------------------------------------------------------------------------------
def token_entry(oracle: Any, token: int, logprob: float) -> dict[str, Any]:
    """A token as chat's logprobs show it: its bytes through the checkpoint's tokenizer, as text."""
    data = oracle.tokenizer.token_bytes(token)
    return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}


def same_logprobs(got: Any, want: Any) -> bool:
    """Equal entries, the floats to 1e-5: at tp=2 the all-reduce sums in another order (the last bits differ)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same_logprobs(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same_logprobs, got, want))
    if isinstance(want, float):
        return abs(got - want) <= 1e-5
    return bool(got == want)


def test_chat_logprobs_are_the_engines_with_each_tokens_text_and_bytes(
    server: Served, client: openai.OpenAI, oracle: Any,
) -> None:
    messages = [{"role": "user", "content": "Tell a story"}]
    want = expected(oracle, "Tell a story", chat=True, max_new_tokens=14, logprobs=3)
    content = [{**token_entry(oracle, p.token, p.logprob),
                "top_logprobs": [token_entry(oracle, t, v) for t, v in p.top]} for p in want.logprobs]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=14, logprobs=True,  # type: ignore[arg-type]
                                         top_logprobs=3)
    assert got.choices[0].message.content == want.text
    shown = got.choices[0].logprobs.model_dump()["content"]
    assert same_logprobs(shown, content), (shown, content)
    for entry in shown:  # the chosen first among greedy alternatives, sorted
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
        assert [e["logprob"] for e in entry["top_logprobs"]] == sorted((e["logprob"] for e in entry["top_logprobs"]),
                                                                        reverse=True)
    # The tokens' bytes joined are the text (the end-of-sequence token, which the text skips, aside).
    special = {p.token for p in want.logprobs} & oracle.tokenizer.special_ids
    joined = b"".join(bytes(e["bytes"]) for e, p in zip(shown, want.logprobs, strict=True) if p.token not in special)
    assert joined.decode("utf-8", errors="replace") == want.text
    # logprobs true alone: the chosen tokens' only; not asked: none.
    alone = client.chat.completions.create(model="tiny", messages=messages, max_tokens=14, logprobs=True)  # type: ignore[arg-type]
    assert [e.top_logprobs for e in alone.choices[0].logprobs.content] == [[]] * len(want.token_ids)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=14)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None
    # Streamed: each chunk carries the logprobs of its tokens; together they are the whole answer's.
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=14, logprobs=True,  # type: ignore[arg-type]
                                                 top_logprobs=3, stream=True))
    streamed = [e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert same_logprobs(streamed, content)
    assert len([c for c in chunks if c.choices and c.choices[0].logprobs]) > 1  # piece by piece


def test_completion_logprobs_in_the_legacy_shape_streamed_or_not(client: openai.OpenAI, oracle: Any) -> None:
    prompt = "Hello world"  # meets the end-of-sequence id at its 7th token: its logprob is the last
    want = expected(oracle, prompt, max_new_tokens=20, logprobs=2)
    assert want.finish_reason == "eos"
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, logprobs=2)
    shown = got.choices[0].logprobs.model_dump()
    text = oracle.tokenizer.token_bytes
    tokens = [text(p.token).decode("utf-8", errors="replace") for p in want.logprobs]
    assert shown["tokens"] == tokens and got.choices[0].text == want.text
    assert same_logprobs(shown["token_logprobs"], [p.logprob for p in want.logprobs])
    # The k most likely and the chosen token (OpenAI's "up to logprobs + 1"), keyed by text.
    tops = [{text(t).decode("utf-8", errors="replace"): v for t, v in reversed((*p.top, (p.token, p.logprob)))}
            for p in want.logprobs]
    assert same_logprobs(shown["top_logprobs"], tops)
    # Where each token starts in the text: the text decoded up to it, wherever that ends on a whole character.
    ids = want.token_ids
    for i, offset in enumerate(shown["text_offset"]):
        before = oracle.tokenizer.decode(ids[:i])
        if not before.endswith("\ufffd"):
            assert offset == len(before), (i, offset, before)
    assert shown["text_offset"] == sorted(shown["text_offset"])
    # Streamed, the chunks' lists joined are the whole answer's, offsets included.
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=20, logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in chunk.choices[0].logprobs.model_dump().items():
                joined[key] += values
    assert same_logprobs(joined, shown)
    # logprobs 0: the chosen token alone in each top_logprobs.
    zero = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, logprobs=0).choices[0].logprobs
    assert zero.top_logprobs == [{t: v} for t, v in zip(zero.tokens, zero.token_logprobs, strict=True)]
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=3).choices[0].logprobs is None


def test_logprob_limits_are_refused_with_what_to_send(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as alone:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, top_logprobs=2)  # type: ignore[arg-type]
    assert alone.value.param == "top_logprobs" and "needs logprobs: true" in alone.value.message  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as many:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, logprobs=True, top_logprobs=21)  # type: ignore[arg-type]
    assert many.value.param == "top_logprobs" and "must be in 0..20, got 21" in many.value.message  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as legacy:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, logprobs=6)
    assert legacy.value.param == "logprobs" and "must be in 0..5 on /v1/completions" in legacy.value.message  # type: ignore[attr-defined]


def test_echo_returns_the_prompt_with_its_tokens_logprobs_streamed_or_not(client: openai.OpenAI, oracle: Any) -> None:
    """What loglikelihood evaluation sends (lm-eval's completions models: echo, logprobs, a token or so): the prompt's
    text before the answer's, and its tokens in the logprobs, the first with null ones; the values the engine's
    prompt_logprobs (checked against transformers in tests/models/test_reference.py)."""
    prompt = "The quick brown fox"
    want = expected(oracle, prompt, max_new_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    assert want.prompt_logprobs is not None and want.logprobs is not None
    ask = dict(model="tiny", prompt=prompt, max_tokens=3, logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice = client.completions.create(**ask).choices[0]  # type: ignore[call-overload]
    assert choice.text == prompt + want.text
    shown = choice.logprobs.model_dump()
    ids = want.prompt_ids + want.token_ids
    text = oracle.tokenizer.token_bytes
    assert shown["tokens"] == [text(t).decode("utf-8", errors="replace") for t in ids]
    scored = [*want.prompt_logprobs[1:], *want.logprobs]
    assert shown["token_logprobs"][0] is None and shown["top_logprobs"][0] is None
    assert same_logprobs(shown["token_logprobs"][1:], [p.logprob for p in scored])
    tops = [{text(t).decode("utf-8", errors="replace"): v for t, v in reversed((*p.top, (p.token, p.logprob)))}
            for p in scored]
    assert same_logprobs(shown["top_logprobs"][1:], tops)
    for i, offset in enumerate(shown["text_offset"]):  # the prompt's offsets, then the answer's after them
        before = oracle.tokenizer.decode(ids[:i])
        if not before.endswith("\ufffd"):
            assert offset == len(before), (i, offset, before)
    # Streamed: the prompt's chunk first, then the answer's; joined, the whole answer's.
    chunks = [c for c in client.completions.create(**ask, stream=True) if c.choices]  # type: ignore[call-overload]
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices[0].logprobs is not None:
            for key, values in chunk.choices[0].logprobs.model_dump().items():
                joined[key] += values
    assert same_logprobs(joined, shown)
    # Without logprobs, the text alone; a prompt of ids is echoed as their text.
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert plain.text == prompt + want.text and plain.logprobs is None
    by_ids = client.completions.create(model="tiny", prompt=want.prompt_ids, max_tokens=3, echo=True,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert by_ids.text == oracle.tokenizer.decode(want.prompt_ids) + want.text
    # n choices each echo the prompt, with its scored tokens.
    two = client.completions.create(**{**ask, "n": 2}).choices  # type: ignore[call-overload]
    assert [c.text for c in two] == [choice.text] * 2
    assert all(same_logprobs(c.logprobs.model_dump(), shown) for c in two)
    # Ids outside the vocabulary: the engine's 400, not a failure to echo them.
    with pytest.raises(openai.BadRequestError) as outside:
        client.completions.create(model="tiny", prompt=[1, 2 ** 40], max_tokens=2, echo=True)
    assert "outside the vocabulary" in outside.value.message  # type: ignore[attr-defined]


# -- n, penalties, bias, structured output ------------------------------------------------------
def test_n_choices_are_the_engines_each_indexed_and_the_prompt_counted_once(
    client: openai.OpenAI, oracle: Any,
) -> None:
    want = oracle.generate("Once", SamplingParams(max_new_tokens=8, temperature=1.0, seed=4, n=3, ignore_eos=True))
    done = client.completions.create(model="tiny", prompt="Once", max_tokens=8, temperature=1.0, seed=4, n=3,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.text for c in done.choices] == [c.text for c in want] and len({c.text for c in want}) == 3
    assert done.usage.prompt_tokens == len(want[0].prompt_ids) and done.usage.completion_tokens == 24
    # Streamed: each choice's chunks carry its index, and joined they are the same texts.
    texts = ["", "", ""]
    for chunk in client.completions.create(model="tiny", prompt="Once", max_tokens=8, temperature=1.0, seed=4, n=3,
                                           stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in want]


def test_penalties_bias_and_min_tokens_are_the_engines(client: openai.OpenAI, oracle: Any) -> None:
    plain = expected(oracle, "Hello world", max_new_tokens=12)
    banned = plain.token_ids[0]
    settings = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=10,
                    logit_bias={banned: -100.0})
    want = expected(oracle, "Hello world", max_new_tokens=12, **settings)
    assert want.token_ids[0] != banned and want.text != plain.text
    done = client.completions.create(model="tiny", prompt="Hello world", max_tokens=12, presence_penalty=1.5,
                                     frequency_penalty=0.5, logit_bias={str(banned): -100},
                                     extra_body={"repetition_penalty": 1.3, "min_tokens": 10})
    assert done.choices[0].text == want.text


REPLY = {"type": "object", "additionalProperties": False, "required": ["answer", "count"],
         "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer", "maximum": 999}}}


def test_structured_output_parses_and_validates_streamed_or_not(client: openai.OpenAI) -> None:
    """json_schema through the official client: the content parses, and has exactly the schema's keys and types."""
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "reply", "schema": REPLY, "strict": True}}
    messages: Any = [{"role": "user", "content": "Answer in JSON"}]
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, response_format=fmt,
                                          temperature=1.0, seed=3, n=2)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=40, response_format=fmt, stream=True))
    for text in [c.message.content or "" for c in done.choices] + [streamed]:
        value = json.loads(text)
        assert set(value) == {"answer", "count"} and value["answer"] in ("yes", "no"), text
        assert isinstance(value["count"], int) and value["count"] <= 999, text
    assert all(c.finish_reason == "stop" for c in done.choices)
    anything = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=1.0,
                                              seed=2, n=4, response_format={"type": "json_object"})
    ended = [c.message.content or "" for c in anything.choices if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended)
    assert all((c.message.content or "").startswith("{") for c in anything.choices)
    pattern = client.completions.create(model="tiny", prompt="Hi", max_tokens=10, temperature=1.0, seed=1,
                                        extra_body={"guided_regex": "(yes|no), [0-9]{2}"})
    assert re.fullmatch("(yes|no), [0-9]{2}", pattern.choices[0].text), pattern.choices[0].text


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer",
                                                                                         "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def _valid_call(call: Any) -> None:
    """A call of one of the offered tools, with arguments its schema accepts."""
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "days"} and isinstance(arguments["city"], str), arguments
        assert len(arguments["city"]) <= 12 and 1 <= arguments["days"] <= 7, arguments
    else:
        assert call.function.name == "get_time" and arguments == {"zone": arguments["zone"]}, arguments
        assert arguments["zone"] in ("UTC", "CET"), arguments
    assert call.type == "function" and call.id.startswith("call_")


def test_tool_calls_come_back_as_the_engine_writes_them_streamed_or_not(client: openai.OpenAI, oracle: Any) -> None:
    """Issue 37: tools were refused. tool_choice "required" and a named function, through the official client: every
    call names an offered tool with arguments its schema accepts, finish_reason is "tool_calls", and the calls are
    the ones the engine writes for the same conversation (fd's Python API, its text parsed independently here)."""
    from fd_core.runtime.text.tools import check_tools

    messages: Any = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    done = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK],
                                          tool_choice="required", max_tokens=80, temperature=1.0, seed=5, n=2)
    for choice in done.choices:
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None and choice.message.tool_calls, choice
        else:  # "required" admits more calls: max_tokens cut one, which stays text
            assert choice.finish_reason == "length" and choice.message.content.startswith("<tool_call>"), choice
        for call in choice.message.tool_calls or []:
            _valid_call(call)
    assert done.choices[0].message.tool_calls
    # The engine's own text for the first choice: the same grammar, the template offered the same tools.
    tools = check_tools([WEATHER, CLOCK], "required", oracle.chat_template)
    want = oracle.submit(messages, SamplingParams(max_new_tokens=80, temperature=1.0, seed=5, grammar=tools.grammar()),
                         chat=True, tools=tools.for_template()).result()
    blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", want.text, re.S)
    assert [(json.loads(b)["name"], json.loads(b)["arguments"]) for b in blocks] == [
        (c.function.name, json.loads(c.function.arguments)) for c in done.choices[0].message.tool_calls]

    named: Any = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK],
                                                 tool_choice=named, max_tokens=150, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_time"
    _valid_call(calls[0])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    single = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    assert len(single.choices[0].message.tool_calls or []) == 1


def test_a_conversation_with_earlier_tool_calls_reaches_the_template(client: openai.OpenAI, oracle: Any) -> None:
    """An assistant turn's tool_calls and the tool turn's answer reach the chat template: the served prompt is the
    engine's for that conversation (arguments as a mapping, as templates take them), and so is the answer."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    messages: Any = [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    done = client.chat.completions.create(model="tiny", messages=messages, tools=[CLOCK], max_tokens=8,
                                          extra_body={"ignore_eos": True})
    rendered = [dict(messages[0]), {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}]
    want = oracle.submit(rendered, SamplingParams(max_new_tokens=8, ignore_eos=True), chat=True,
                         tools=[CLOCK]).result()
    bare = oracle.submit(messages[:1], SamplingParams(max_new_tokens=8, ignore_eos=True), chat=True,
                         tools=[CLOCK]).result()
    # The same prompt as the engine's with the earlier call and its answer; longer than without them.
    assert done.usage.prompt_tokens == len(want.prompt_ids) > len(bare.prompt_ids) + 10
    assert done.choices[0].message.content == want.text
