"""Disaggregation rows (docs/disaggregation.md):

- transfer: a prompt's keys and values at the ERNIE-4.5-0.3B size (1,024 positions, 18 layers, 2 kv heads of 128,
  float32: 37.7 MB) handed through the `shm` and `tcp` transports, from send() until the receiver has them in arrays
  of its own (as the engine then writes them into its cache), against one memory copy of the same arrays (numpy's
  copyto). Medians of 7.
- serving: streamed clients decoding 64 tokens of 128-id prompts, 4 at a time, while 1,024-id prompts keep arriving
  (prefill pressure), on ERNIE-4.5-0.3B's config with random weights: inter-token latency p50/p99 of the decoding
  streams and time to first token of the long prompts, one colocated `fd serve` on both cores against a prefill
  instance on core 0 and a decode instance on core 1 (taskset, --threads 1 each) behind `fd serve --role router`.

    python -m fd_bench.disagg [transfer|serving]   # or: fd bench --rows disagg
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from fd_bench.report import Line
from fd_bench.serving_load import percentile

POSITIONS, LAYERS, KV_HEADS, HEAD_DIM = 1024, 18, 2, 128
SHORT_CLIENTS, SHORT_IDS, SHORT_TOKENS = 4, 128, 64
LONG_IDS, LONG_TOKENS = 1024, 4


# -- transfer --------------------------------------------------------------------------------------------------
def _parts() -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [np.asarray([POSITIONS, 0], dtype=np.int64)] + [
        rng.standard_normal((POSITIONS, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2 * LAYERS)]


def _copy_s(parts: list[Any], rounds: int = 7) -> float:
    import numpy as np

    out = [np.empty_like(p) for p in parts]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for a, b in zip(out, parts, strict=True):
            np.copyto(a, b)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _transfer_s(
    make: Callable[[str, int], Any], addresses: tuple[str, str], parts: list[Any], rounds: int = 7
) -> tuple[float, float]:
    """Seconds from send() until the receiver holds the parts in arrays of its own (copied out of what receive() gave),
    and until receive() returned them."""
    import numpy as np

    sender, receiver = make(addresses[0], 0), make(addresses[1], 0)
    out = [np.empty_like(p) for p in parts]
    times: list[float] = []
    handed: list[float] = []  # until receive() returned (its views, before they are copied out)
    try:
        for i in range(rounds + 2):  # two warm-ups: a long-running instance's transport has its buffers
            start = time.perf_counter()
            sender.send(f"b{i}", addresses[1], parts, 60.0)
            while (state := sender.state(f"b{i}").value) == "pending":
                time.sleep(0.0001)
            if state != "done":
                raise RuntimeError(f"the {make.__name__} send ended {state}")
            got = receiver.receive(f"b{i}")
            held = time.perf_counter()
            for into, part in zip(out, got, strict=True):
                np.copyto(into, part)
            if i >= 2:
                times.append(time.perf_counter() - start)
                handed.append(held - start)
            del got, part  # as the engine drops them once they are in its cache (a transport may then reuse them)
    finally:
        sender.close()
        receiver.close()
    return statistics.median(times), statistics.median(handed)


def transfer_rows() -> list[Line]:
    from fd_plugins.transfer.shm import ShmTransport

    parts = _parts()
    size = sum(int(p.nbytes) for p in parts)
    copy = _copy_s(parts)
    tag = uuid.uuid4().hex[:6]
    cases: list[tuple[str, Callable[[str, int], Any], tuple[str, str]]] = [
        ("shm", ShmTransport, (f"bench{tag}a", f"bench{tag}b"))]
    try:
        from fd_plugins.transfer.tcp import TcpTransport

        cases.append(("tcp (127.0.0.1)", TcpTransport, ("127.0.0.1:7911", "127.0.0.1:7921")))
    except ImportError:
        pass
    lines = []
    for name, make, addresses in cases:
        seconds, handed = _transfer_s(make, addresses, parts)
        lines.append(Line(
            row="disagg", case=f"a 1,024-position prompt's keys and values ({size / 1e6:.1f} MB) through {name}",
            a=name, b="numpy copyto", a_value=size / seconds / 1e9, b_value=size / copy / 1e9, unit="GB/s",
            ratio=copy / seconds, ratio_label="transfer / memory copy", target="shm >= 0.5", met=(
                copy / seconds >= 0.5 if name == "shm" else None),
            note=f"medians of 7: transfer {seconds * 1e3:.1f} ms, copy {copy * 1e3:.1f} ms; from send() until the "
                 f"receiver holds them in arrays of its own ({handed * 1e3:.1f} ms until receive() returned)",
        ))
    return lines


# -- serving under prefill pressure ----------------------------------------------------------------------------
def _start(args: Sequence[str], cores: str | None = None) -> tuple[subprocess.Popen[str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    command = [sys.executable, "-m", "fd_core.cli", "serve", "--port", "0", *args]
    if cores is not None:
        command = ["taskset", "-c", cores, *command]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=env)
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            match = re.search(r"ready at (http://\S+)$", line.strip())
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300) or not found:
        process.kill()
        raise RuntimeError(f"fd serve {' '.join(args)} did not start (exit code {process.poll()})")
    return process, found[0]


def _load(url: str, vocab: int, longs: int) -> dict[str, Any]:
    """SHORT_CLIENTS streams decoding at once, started again as each ends, while `longs` long prompts arrive one after
    another; returns the short streams' token gaps and every first-token delay."""
    import httpx

    from fd_bench.paged import random_ids
    from fd_bench.serving_load import stream

    done = threading.Event()
    gaps: list[float] = []
    short_ttft: list[float] = []
    long_ttft: list[float] = []

    def short(c: int) -> None:
        with httpx.Client(timeout=900) as client:
            n = 0
            while not done.is_set():
                r = stream(client, url, random_ids(SHORT_IDS, 7919 * c + n, vocab), SHORT_TOKENS)
                arrivals = r["arrivals"]
                gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
                if r["ttft"] is not None:
                    short_ttft.append(r["ttft"])
                n += 1

    def long() -> None:
        with httpx.Client(timeout=900) as client:
            time.sleep(2.0)  # the short streams running first
            for i in range(longs):
                r = stream(client, url, random_ids(LONG_IDS, 104729 + i, vocab), LONG_TOKENS)
                if r["ttft"] is not None:
                    long_ttft.append(r["ttft"])
        done.set()

    with ThreadPoolExecutor(SHORT_CLIENTS + 1) as pool:
        futures = [pool.submit(short, c) for c in range(SHORT_CLIENTS)] + [pool.submit(long)]
        for f in futures:
            f.result()
    return {"gaps": gaps, "short_ttft": short_ttft, "long_ttft": long_ttft}


def _summary(m: dict[str, Any]) -> dict[str, float]:
    return {"itl_p50_ms": percentile(m["gaps"], 0.5) * 1e3, "itl_p99_ms": percentile(m["gaps"], 0.99) * 1e3,
            "long_ttft_p50_ms": statistics.median(m["long_ttft"]) * 1e3,
            "short_ttft_p50_ms": statistics.median(m["short_ttft"]) * 1e3, "gaps": len(m["gaps"])}


def measure_serving(checkpoint: Path, longs: int = 4) -> dict[str, dict[str, float]]:
    vocab = int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])
    out: dict[str, dict[str, float]] = {}
    process, url = _start(["--checkpoint", str(checkpoint)])
    try:
        _load(url, vocab, 1)  # warm-up
        out["colocated"] = _summary(_load(url, vocab, longs))
    finally:
        process.terminate()
        process.wait(60)
    started: list[subprocess.Popen[str]] = []
    try:
        decode, decode_url = _start(["--checkpoint", str(checkpoint), "--role", "decode", "--threads", "1"], "1")
        started.append(decode)
        prefill, prefill_url = _start(["--checkpoint", str(checkpoint), "--role", "prefill", "--threads", "1"], "0")
        started.append(prefill)
        router, url = _start(["--role", "router", "--prefill", prefill_url, "--decode", decode_url])
        started.append(router)
        _load(url, vocab, 1)
        out["disaggregated"] = _summary(_load(url, vocab, longs))
    finally:
        for p in started:
            p.terminate()
        for p in started:
            p.wait(60)
    return out


def serving_rows(smoke: bool) -> list[Line]:
    from fd_bench.paged import bench_checkpoint
    from fd_bench.serving import missing_serve_extra, not_measured

    case = (f"{SHORT_CLIENTS} streams of {SHORT_TOKENS} tokens while {LONG_IDS}-id prompts arrive: inter-token "
            f"latency p99")
    why = missing_serve_extra()
    if why is not None:
        return [not_measured("disagg", case, "ms", "disaggregated >= 2x better", why)]
    m = measure_serving(bench_checkpoint(smoke), longs=1 if smoke else 4)
    co, dis = m["colocated"], m["disaggregated"]
    return [Line(
        row="disagg", case=case, a="prefill on core 0, decode on core 1, router", b="one fd serve on both cores",
        a_value=dis["itl_p99_ms"], b_value=co["itl_p99_ms"], unit="ms", ratio=co["itl_p99_ms"] / dis["itl_p99_ms"],
        ratio_label="colocated / disaggregated", target=">= 2", met=co["itl_p99_ms"] / dis["itl_p99_ms"] >= 2,
        note=(f"{'the tiny preset' if smoke else 'ERNIE-4.5-0.3B'}'s config, random weights, float32; inter-token "
              f"p50 {dis['itl_p50_ms']:.0f} ms disaggregated, {co['itl_p50_ms']:.0f} colocated; long prompts' first "
              f"token p50 {dis['long_ttft_p50_ms']:.0f} ms against {co['long_ttft_p50_ms']:.0f}; short prompts' "
              f"{dis['short_ttft_p50_ms']:.0f} against {co['short_ttft_p50_ms']:.0f}"),
        details=m,
    )]


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "transfer"
    if what == "transfer":
        for line in transfer_rows():
            print(json.dumps({"case": line.case, "GB/s": line.a_value, "copy GB/s": line.b_value,
                              "ratio": line.ratio, "note": line.note}))
    else:
        from fd_bench.paged import bench_checkpoint

        checkpoint = Path(argv[1]) if len(argv) > 1 else bench_checkpoint(False)
        print(json.dumps(measure_serving(checkpoint, int(argv[2]) if len(argv) > 2 else 4)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
