"""Serve row: `fd serve` (a real subprocess, tp=1, the tiny preset with its tokenizer) under 1, 4 and 16 concurrent
streaming clients, against the same requests through the Python API's LLM one at a time; then, on the same server at 4
clients, what logprobs, n choices and structured output cost against the same requests without them."""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from fd_bench.report import Line

PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time", "A language model reads", "Numbers like 1, 2, 3",
           "The server keeps the model", "Clients send prompts", "How are you today?"]
CLIENTS = (1, 4, 16)
# The request options measured against the same requests without them, on the same server, at FEATURE_CLIENTS clients.
FEATURE_CLIENTS = 4
LOGPROBS = 5  # completions' logprobs: the most alternatives OpenAI's API allows
CHOICES = 4  # n
# A small json_schema whose one string is longer than max_tokens tokens can spell (the tiny vocabulary's longest token
# has a few characters), so that the grammar never completes and every request generates max_tokens tokens, as the
# plain ones do with ignore_eos: the comparison is per token. json_object lets the greedy tiny model close "{}" after
# two tokens for some prompts and run on for others.
SCHEMA_MIN_CHARS = 10_000
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "note", "strict": True, "schema": {
    "type": "object", "properties": {"text": {"type": "string", "minLength": SCHEMA_MIN_CHARS}}, "required": ["text"],
    "additionalProperties": False}}}
FEATURES: dict[str, dict[str, Any]] = {"plain": {}, "logprobs": {"logprobs": LOGPROBS}, "n": {"n": CHOICES},
                                       "schema": {"response_format": RESPONSE_FORMAT}}


def start_server(checkpoint: Path, extra: Sequence[str] = ()) -> tuple[subprocess.Popen[str], str]:
    """`fd serve` (with `extra` options) on a free port; its address read from stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    process = subprocess.Popen([sys.executable, "-m", "fd_core.cli", "serve", "--checkpoint", str(checkpoint),
                                "--tp", "1", "--port", "0", "--max-queue", "64", *extra],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=env)
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            match = re.search(r" at (http://\S+)$", line.strip())
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(180) or not found:
        process.kill()
        raise RuntimeError(f"fd serve did not start (exit code {process.poll()})")
    return process, found[0]


_CLIENTS = threading.local()  # one HTTP client (a kept-alive connection) per client thread, as a real client keeps


def _one(url: str, prompt: str, tokens: int, extra: dict[str, Any] | None = None) -> tuple[float, float, int]:
    """(seconds to the first token, seconds in all, completion tokens of every choice) of one streamed completion with
    the request fields `extra`."""
    import json

    import httpx

    if getattr(_CLIENTS, "client", None) is None:
        _CLIENTS.client = httpx.Client(timeout=600)
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.perf_counter()
    first: float | None = None
    used = 0
    with _CLIENTS.client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if data["choices"] and first is None:
                first = time.perf_counter() - start
            if data.get("usage"):
                used = int(data["usage"]["completion_tokens"])
    total = time.perf_counter() - start
    return (first if first is not None else total), total, used


def _send(url: str, clients: int, requests: int, tokens: int,
          extra: dict[str, Any] | None = None) -> tuple[float, list[tuple[float, float, int]]]:
    """(wall seconds, each request's _one) of `requests` streamed completions from `clients` concurrent clients."""
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: _one(url, p, tokens, extra), jobs))
    return time.perf_counter() - start, results


def _load(url: str, clients: int, requests: int, tokens: int) -> dict[str, Any]:
    wall, results = _send(url, clients, requests, tokens)
    ttft = [r[0] for r in results]
    generated = sum(r[2] for r in results)
    return {"wall_s": wall, "req_s": requests / wall, "tok_s": generated / wall, "tokens": generated,
            "ttft_p50_ms": statistics.median(ttft) * 1000, "ttft_max_ms": max(ttft) * 1000}


def _check(url: str, kind: str, tokens: int) -> None:
    """A RuntimeError unless a request of FEATURES' `kind` (not streamed) comes back with what its field asks for: the
    server ignores fields it does not know, and a row whose field was dropped would time plain requests."""
    import httpx

    body = {"prompt": PROMPTS[0], "max_tokens": tokens, "ignore_eos": True, **FEATURES[kind]}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    choices = response.json()["choices"]
    text, logprobs = choices[0]["text"], choices[0]["logprobs"]
    opening = '{"text": "'  # how the schema's output starts (json.dumps' layout), as far as the tokens go
    ok = {
        "plain": len(choices) == 1 and logprobs is None,
        "logprobs": logprobs is not None and len(logprobs["tokens"]) == tokens and all(logprobs["top_logprobs"]),
        "n": len(choices) == CHOICES,
        "schema": bool(text) and (text.startswith(opening) or opening.startswith(text)),
    }[kind]
    if not ok:
        raise RuntimeError(f"fd serve did not apply {FEATURES[kind]} (answer: {choices!r:.300})")


def _features(url: str, kinds: Sequence[str], requests: int, tokens: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Each kind of FEATURES at FEATURE_CLIENTS clients: a warm-up of each, then `rounds` rounds in which the kinds take
    turns (the order flipping every round). Per kind: tok/s (every choice's completion tokens over the load's wall
    time; the median of the rounds), and over every request of every round the medians of the time to the first token
    and of the decode time per token, (last byte - first token) / (tokens per choice - 1), as the client sees them."""
    for kind in kinds:  # n runs 16 sequences at once; the first grammar builds its table of the vocabulary's tokens
        _check(url, kind, tokens)
        _send(url, FEATURE_CLIENTS, FEATURE_CLIENTS, tokens, FEATURES[kind])
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    done: dict[str, list[tuple[float, float, int]]] = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            wall, results = _send(url, FEATURE_CLIENTS, requests, tokens, FEATURES[kind])
            rates[kind].append(sum(used for _, _, used in results) / wall)
            done[kind].extend(results)
    out = {}
    for kind in kinds:
        choices = int(FEATURES[kind].get("n", 1))
        results = done[kind]
        per_token = [(total - first) / (used / choices - 1) for first, total, used in results if used > choices]
        out[kind] = {
            "tok_s": statistics.median(rates[kind]), "tok_s_rounds": rates[kind],
            "ttft_p50_ms": statistics.median(r[0] for r in results) * 1000,
            "ttft_max_ms": max(r[0] for r in results) * 1000,
            "ms_per_token_p50": statistics.median(per_token) * 1000 if per_token else None,
            "requests": len(results), "tokens": sum(r[2] for r in results),
            # requests that ended before max_tokens in each choice (a grammar complete, or an error): none expected
            "short": sum(1 for r in results if r[2] < tokens * choices),
        }
    return out


def missing_serve_extra() -> str | None:
    """Why a row that runs `fd serve` cannot here (the serve extra or httpx, its client, not installed), or None."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", "httpx") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"not measured: {', '.join(missing)} not installed (the row runs fd serve: pip install '.[serve]' httpx "
            f"in a checkout)")


def missing_grammar() -> str | None:
    """Why the structured-output line cannot run here (llguidance, part of the serve extra, not installed), or None."""
    import importlib.util

    if importlib.util.find_spec("llguidance") is None:
        return ("not measured: llguidance not installed (structured output needs it: pip install '.[serve]' in a "
                "checkout)")
    return None


def not_measured(row: str, case: str, unit: str, target: str, why: str) -> Line:
    """A row that could not run here, saying why (no figure, no verdict)."""
    return Line(row=row, case=case, a="-", b="-", a_value=None, b_value=None, unit=unit, ratio=None, ratio_label="-",
                target=target, met=None, note=why)


def _feature_cases() -> list[tuple[str, str]]:
    """(case, unit) of each line feature_lines gives, in its order."""
    c = FEATURE_CLIENTS
    return [(f"logprobs {LOGPROBS}, {c} clients: tok/s", "tok/s"),
            (f"logprobs {LOGPROBS}, {c} clients: time to first token", "ms"),
            (f"n={CHOICES}, {c} clients: tok/s of every choice", "tok/s"),
            (f"n={CHOICES}, {c} clients: time to first token", "ms"),
            (f"json_schema, {c} clients: decode time per token", "ms")]


def feature_lines(m: dict[str, dict[str, Any]], requests: int, tokens: int, rounds: int) -> list[Line]:
    """The lines of _features' measurements, each against the plain requests of the same run."""
    cases = _feature_cases()
    plain = m["plain"]
    run = (f"{FEATURE_CLIENTS} streaming clients, {requests} requests x {tokens} tokens (ignore_eos) per round, "
           f"{rounds} round{'s' if rounds > 1 else ''} taking turns with the plain requests (the same requests "
           f"without the field) on one server")
    lines = []
    for kind, a, label, (throughput, first), about in (
        ("logprobs", f"logprobs {LOGPROBS} (completions)", "logprobs / plain", cases[0:2],
         f"each token's logprob and its {LOGPROBS} most likely alternatives, in every chunk"),
        ("n", f"n={CHOICES}", f"n={CHOICES} / n=1", cases[2:4],
         f"{FEATURE_CLIENTS} x {CHOICES} = {FEATURE_CLIENTS * CHOICES} sequences at once (--max-batch 8 decodes 8 "
         f"at a time), greedy, so the choices are identical"),
    ):
        if kind not in m:
            continue
        f = m[kind]
        lines.append(Line(
            row="serve", case=throughput[0], a=a, b="plain", a_value=f["tok_s"], b_value=plain["tok_s"],
            unit="tok/s", ratio=f["tok_s"] / plain["tok_s"], ratio_label=label, target="reported", met=None,
            note=(f"{run}; {about}; tokens of every choice over the wall time, median of the rounds"),
            details={"a": f, "b": plain, "requests": requests, "tokens": tokens, "rounds": rounds},
        ))
        lines.append(Line(
            row="serve", case=first[0], a=a, b="plain", a_value=f["ttft_p50_ms"], b_value=plain["ttft_p50_ms"],
            unit="ms", ratio=f["ttft_p50_ms"] / plain["ttft_p50_ms"], ratio_label=label, target="reported",
            met=None, note=(f"medians over every request of every round; max {f['ttft_max_ms']:.0f} ms against "
                            f"{plain['ttft_max_ms']:.0f} ms"),
            details={"a": f, "b": plain},
        ))
    if "schema" in m:
        f = m["schema"]
        a, b = f["ms_per_token_p50"], plain["ms_per_token_p50"]
        lines.append(Line(
            row="serve", case=cases[4][0], a="response_format json_schema", b="plain", a_value=a, b_value=b,
            unit="ms", ratio=None if a is None or b is None else a / b, ratio_label="schema / plain",
            target="reported", met=None,
            note=(f"{run}; a one-string schema (minLength {SCHEMA_MIN_CHARS}) the output never completes, so both "
                  f"sides generate {tokens} tokens; per request (last byte - first token) / {tokens - 1}, the median "
                  f"over every request: llguidance's mask on the host, then the masked row sampled alone; "
                  f"{f['tok_s']:.0f} tok/s against {plain['tok_s']:.0f}; time to first token p50 "
                  f"{f['ttft_p50_ms']:.0f} ms against {plain['ttft_p50_ms']:.0f} ms"
                  + (f"; {f['short']} request(s) ended early" if f["short"] else "")),
            details={"a": f, "b": plain, "requests": requests, "tokens": tokens, "rounds": rounds},
        ))
    return lines


def serve_rows(smoke: bool) -> list[Line]:
    why = missing_serve_extra()
    if why is not None:
        return [not_measured("serve", "fd serve against LLM one request at a time", "req/s", "reported", why),
                *(not_measured("serve", case, unit, "reported", why) for case, unit in _feature_cases())]
    import logging

    from fd_core.runtime import LLM, SamplingParams

    # one INFO line per request otherwise, once paddle has configured logging
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from fd_core.serve.tiny import write_tiny_checkpoint

    requests, tokens = (16, 8) if smoke else (32, 32)
    shape = (8, 8, 1) if smoke else (32, 32, 3)  # the feature rows' requests, tokens and rounds
    no_grammar = missing_grammar()
    with tempfile.TemporaryDirectory(prefix="fd-bench-serve-") as scratch:
        checkpoint = write_tiny_checkpoint(Path(scratch) / "tiny")
        # The baseline: the same requests through LLM in this process, one at a time.
        with LLM(checkpoint, tp=1) as llm:
            sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
            llm.generate(PROMPTS[0], sampling)  # warm-up: the first batch pays for allocation and capture
            start = time.perf_counter()
            made = sum(len(llm.generate(PROMPTS[i % len(PROMPTS)], sampling)[0].token_ids) for i in range(requests))
            wall = time.perf_counter() - start
        sequential = {"req_s": requests / wall, "tok_s": made / wall}
        process, url = start_server(checkpoint)
        try:
            # Warm-up: the first batch of each size pays for its cache and its decode graph's capture (once per size).
            for c in (*range(1, 9), 16):
                _load(url, c, c, tokens)
            measured = {c: _load(url, c, requests, tokens) for c in CLIENTS}
            kinds = [k for k in FEATURES if k != "schema" or no_grammar is None]
            features = _features(url, kinds, *shape)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    lines = []
    for c in CLIENTS:
        m = measured[c]
        lines.append(Line(
            row="serve", case=f"{c} concurrent client{'s' if c > 1 else ''}", a="fd serve (streaming, HTTP)",
            b="LLM one at a time", a_value=m["req_s"], b_value=sequential["req_s"], unit="req/s",
            ratio=m["req_s"] / sequential["req_s"], ratio_label="served / sequential", target="reported", met=None,
            note=(f"{requests} requests x {tokens} tokens (ignore_eos), tiny ERNIE-4.5 at tp=1; "
                  f"{m['tok_s']:.0f} tok/s served vs {sequential['tok_s']:.0f} tok/s sequential; "
                  f"time to first token p50 {m['ttft_p50_ms']:.0f} ms, max {m['ttft_max_ms']:.0f} ms"),
            details={**m, "sequential": sequential, "requests": requests, "tokens": tokens},
        ))
    loaded, alone = measured[CLIENTS[-1]], measured[CLIENTS[0]]
    lines.append(Line(
        row="serve", case=f"time to first token under load ({CLIENTS[-1]} clients)", a=f"{CLIENTS[-1]} clients",
        b="1 client", a_value=loaded["ttft_p50_ms"], b_value=alone["ttft_p50_ms"], unit="ms",
        ratio=loaded["ttft_p50_ms"] / alone["ttft_p50_ms"], ratio_label="loaded / alone", target="reported",
        met=None, note="medians over the requests; the machine is shared",
    ))
    lines.extend(feature_lines(features, *shape))
    if no_grammar is not None:
        case, unit = _feature_cases()[-1]
        lines.append(not_measured("serve", case, unit, "reported", no_grammar))
    return lines
