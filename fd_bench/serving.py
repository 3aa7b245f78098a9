"""Serve row: `fd serve` (a real subprocess, tp=1, the tiny preset with its tokenizer) under 1, 4 and 16 concurrent
streaming clients, against the same requests through the Python API's LLM one at a time."""

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


def _one(url: str, prompt: str, tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds in all, completion tokens) of one streamed completion."""
    import json

    import httpx

    if getattr(_CLIENTS, "client", None) is None:
        _CLIENTS.client = httpx.Client(timeout=600)
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
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


def _load(url: str, clients: int, requests: int, tokens: int) -> dict[str, Any]:
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: _one(url, p, tokens), jobs))
    wall = time.perf_counter() - start
    ttft = [r[0] for r in results]
    generated = sum(r[2] for r in results)
    return {"wall_s": wall, "req_s": requests / wall, "tok_s": generated / wall, "tokens": generated,
            "ttft_p50_ms": statistics.median(ttft) * 1000, "ttft_max_ms": max(ttft) * 1000}


def missing_serve_extra() -> str | None:
    """Why a row that runs `fd serve` cannot here (the serve extra or httpx, its client, not installed), or None."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", "httpx") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"not measured: {', '.join(missing)} not installed (the row runs fd serve: pip install '.[serve]' httpx "
            f"in a checkout)")


def not_measured(row: str, case: str, unit: str, target: str, why: str) -> Line:
    """A row that could not run here, saying why (no figure, no verdict)."""
    return Line(row=row, case=case, a="-", b="-", a_value=None, b_value=None, unit=unit, ratio=None, ratio_label="-",
                target=target, met=None, note=why)


def serve_rows(smoke: bool) -> list[Line]:
    why = missing_serve_extra()
    if why is not None:
        return [not_measured("serve", "fd serve against LLM one request at a time", "req/s", "reported", why)]
    import logging

    from fd_core.runtime import LLM, SamplingParams

    # one INFO line per request otherwise, once paddle has configured logging
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from fd_core.serve.tiny import write_tiny_checkpoint

    requests, tokens = (16, 8) if smoke else (32, 32)
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
    return lines
