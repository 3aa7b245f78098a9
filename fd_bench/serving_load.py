"""Serving row at a real size: `fd serve` (a real subprocess, cpu platform) on ERNIE-4.5-0.3B's config with random
bfloat16 weights (float32 compute) and no tokenizer, under 1, 4 and 8 concurrent clients, each a streamed completion
of its own 128-id prompt and 64 greedy tokens (a chunk per token, with its id): aggregate tokens per second, time to
first token, and the gaps between a stream's tokens (inter-token latency), p50 and p99.

    python -m fd_bench.serving_load [CHECKPOINT [TP [ROUNDS]]]   # or: fd bench --rows serving

Prompts differ in every request of every round (no prefix is cached across them). llama-server beside it, on the
same weights and requests, is the `llamacpp` row (fd_bench/llamacpp.py), which needs a llama.cpp build.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fd_bench.paged import bench_checkpoint, random_ids
from fd_bench.report import Line
from fd_bench.serving import missing_serve_extra, not_measured, start_server

CLIENTS = (1, 4, 8)
PROMPT_IDS = 128
TOKENS = 64


def _vocab(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])


def stream(client: Any, url: str, ids: list[int], tokens: int, llama: bool = False) -> dict[str, Any]:
    """One streamed completion: its first token's delay and every token's arrival (seconds from the request). With
    `llama`, the same request in llama-server's own form (its /completion endpoint, ids as "tokens")."""
    if llama:
        path, body = "/completion", {"prompt": ids, "n_predict": tokens, "stream": True, "ignore_eos": True,
                                     "temperature": 0, "return_tokens": True, "cache_prompt": False}
    else:
        path, body = "/v1/completions", {"prompt": ids, "max_tokens": tokens, "stream": True, "ignore_eos": True,
                                         "temperature": 0, "return_token_ids": True}
    start = time.perf_counter()
    arrivals: list[float] = []
    with client.stream("POST", f"{url}{path}", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            # One arrival per token the chunk carries (a chunk per token is what the server promises for ids).
            for ids_of_chunk in ([data.get("tokens")] if llama else [c.get("token_ids") for c in data["choices"]]):
                arrivals.extend([time.perf_counter() - start] * len(ids_of_chunk or []))
    return {"ttft": arrivals[0] if arrivals else None, "arrivals": arrivals}


def _round(url: str, clients: int, seed: int, tokens: int, vocab: int, llama: bool = False) -> dict[str, Any]:
    """`clients` streams at once, each of its own random prompt (no two requests share a cached block)."""
    import httpx

    http = [httpx.Client(timeout=900) for _ in range(clients)]
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(
                lambda c: stream(http[c], url, random_ids(PROMPT_IDS, seed + c, vocab), tokens, llama),
                range(clients)))
        wall = time.perf_counter() - start
    finally:
        for client in http:
            client.close()
    generated = sum(len(r["arrivals"]) for r in results)
    gaps = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    return {"wall_s": wall, "tokens": generated, "tok_s": generated / wall,
            "ttft": [r["ttft"] for r in results if r["ttft"] is not None], "gaps": gaps,
            "chunks_per_token": all(len(r["arrivals"]) == tokens for r in results)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure(checkpoint: Path, tp: int = 1, rounds: int = 1, clients: tuple[int, ...] = CLIENTS,
            tokens: int = TOKENS, extra: tuple[str, ...] = ()) -> dict[int, dict[str, Any]]:
    """`fd serve` on the checkpoint: measure_url's figures."""
    # start_server runs tp=1; a later --tp wins.
    process, url = start_server(checkpoint, (*(("--tp", str(tp)) if tp != 1 else ()), *extra))
    try:
        return measure_url(url, checkpoint, clients, tokens, rounds=rounds)
    finally:
        process.terminate()
        process.wait(60)


def measure_url(url: str, checkpoint: Path, clients: tuple[int, ...] = CLIENTS, tokens: int = TOKENS,
                llama: bool = False, rounds: int = 1) -> dict[int, dict[str, Any]]:
    """Each client count's aggregate tok/s (median of the rounds), TTFT and inter-token latency over every round,
    from the server at `url` (llama-server's own endpoint with `llama`)."""
    vocab = _vocab(checkpoint)
    _round(url, 1, 10_000, 4, vocab, llama)  # warm-up: first calls, allocations
    out: dict[int, dict[str, Any]] = {}
    for n in clients:
        done = [_round(url, n, 1000 * r + 100 * n, tokens, vocab, llama) for r in range(rounds)]
        ttft = [t for d in done for t in d["ttft"]]
        gaps = [g for d in done for g in d["gaps"]]
        if len(ttft) < n * rounds or not gaps:
            raise RuntimeError(f"the server at {url} streamed no tokens to {n * rounds - len(ttft)} of {n * rounds} "
                               f"requests at {n} client(s): nothing to time")
        out[n] = {"tok_s": statistics.median(d["tok_s"] for d in done),
                  "ttft_p50_ms": percentile(ttft, 0.5) * 1e3, "ttft_max_ms": max(ttft) * 1e3,
                  "itl_p50_ms": percentile(gaps, 0.5) * 1e3, "itl_p99_ms": percentile(gaps, 0.99) * 1e3,
                  "chunk_per_token": all(d["chunks_per_token"] for d in done), "rounds": rounds}
    return out


def serving_rows(smoke: bool) -> list[Line]:
    why = missing_serve_extra()
    cases = [f"{n} concurrent client{'s' if n > 1 else ''}, 128-id prompts, 64 tokens" for n in CLIENTS]
    if why is not None:
        return [not_measured("serving", case, "tok/s", "reported", why) for case in cases]
    clients, tokens = ((1, 4), 8) if smoke else (CLIENTS, TOKENS)
    m = measure(bench_checkpoint(smoke), clients=clients, tokens=tokens)
    lines = []
    one = m[clients[0]]
    for n in clients:
        r = m[n]
        lines.append(Line(
            row="serving", case=f"{n} concurrent client{'s' if n > 1 else ''}, 128-id prompts, {tokens} tokens",
            a=f"fd serve, {n} client(s)", b="fd serve, 1 client", a_value=r["tok_s"], b_value=one["tok_s"],
            unit="tok/s", ratio=r["tok_s"] / one["tok_s"], ratio_label="aggregate / one client", target="reported",
            met=None,
            note=(f"{'the tiny preset' if smoke else 'ERNIE-4.5-0.3B'}'s config, random weights, float32, tp=1; "
                  f"time to first token p50 "
                  f"{r['ttft_p50_ms']:.0f} ms (max {r['ttft_max_ms']:.0f}); inter-token latency p50 "
                  f"{r['itl_p50_ms']:.0f} ms, p99 {r['itl_p99_ms']:.0f} ms; a chunk per token: {r['chunk_per_token']}"),
            details=r,
        ))
    return lines


def main(argv: list[str]) -> int:
    checkpoint = Path(argv[0]) if argv else bench_checkpoint(False)
    tp = int(argv[1]) if len(argv) > 1 else 1
    rounds = int(argv[2]) if len(argv) > 2 else 1
    print(json.dumps(measure(checkpoint, tp, rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
