"""llama.cpp beside fd on the same weights (issues 47 and 52): ERNIE-4.5-0.3B's config with random bfloat16 weights,
saved by `fd save-random`, converted by llama.cpp's own converter (f32) and quantizer (q8_0, q4_0).

- decode: batch 1, the same prompt ids, 64 tokens. fd runs `fd run --json` at tp=1 and tp=2 in float32, wint8 and
  wint4. llama.cpp runs `llama-bench` at the prompt's depth with 1 and 2 threads. The sides take turns, the order
  flipping every round, and each side's median is reported. fd's faster layout is compared with llama.cpp at 2
  threads (the same two cores).
- agreement: the greedy tokens of the prompt, and the top-2 log-probabilities of the first steps, from `fd serve` and
  `llama-server` (f32). The log-probabilities are the evidence that both run the same model: random weights give one
  token at every step on both sides.
- serving: N = 1, 4 and 8 streamed clients at once, each with its own random 128-id prompt and 64 greedy tokens, as
  the `serving` row sends them. fd serve (tp=1, float32 and wint8) faces llama-server (2 threads, 8 slots, f32 and
  q8_0), one fresh server at a time.

    FD_LLAMA_CPP=/path/to/llama.cpp python -m fd_bench.llamacpp [decode|serving|all]   # or: fd bench --rows llamacpp

FD_LLAMA_CPP is a llama.cpp source tree whose `build/bin` holds llama-bench, llama-quantize and llama-server. The
tree that llama.cpp's Python package ships (`vendor/llama.cpp` in the llama-cpp-python sdist) builds offline;
docs/benchmarks.md gives the commands. Nothing here is downloaded. The converter runs in this Python; it needs torch
(the test extra's CPU build) and sentencepiece (one of fd's own dependencies). A stub tokenizer stands in for the random
checkpoint's missing one: 64 pieces, which the converter pads to the config's vocabulary; it is removed after
converting, so fd runs without a tokenizer (as the serving row does). Prompts are token ids, so no text is ever
tokenized.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fd_bench.report import Line

TREE_ENV = "FD_LLAMA_CPP"
BINARIES = ("llama-bench", "llama-quantize", "llama-server")
PROMPT = [5, 17, 42, 99, 7, 300, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000, 77, 3]
STEPS = 64
# fd's scheme -> llama.cpp's type of the same bits (both in blocks: wint8 groups of 128 against q8_0's 32, wint4
# groups of 32 against q4_0's 32).
TYPES = {"float32": "f32", "wint8": "q8_0", "wint4": "q4_0"}
SERVING_SIDES = (("float32", "f32"), ("wint8", "q8_0"))
SLOTS = 8


def tree() -> Path | None:
    value = os.environ.get(TREE_ENV, "").strip()
    return Path(value) if value else None


def missing() -> str | None:
    """Why the row cannot run here, or None."""
    root = tree()
    if root is None:
        return (f"not measured: set {TREE_ENV} to a llama.cpp tree built with cmake (docs/benchmarks.md, 'llama.cpp "
                f"beside fd', shows how to build it offline from llama-cpp-python's sdist)")
    absent = [b for b in BINARIES if not (root / "build" / "bin" / b).is_file()]
    if absent or not (root / "convert_hf_to_gguf.py").is_file():
        return (f"not measured: {root} has no {', '.join(absent) or 'convert_hf_to_gguf.py'}; build it with "
                f"`cmake -B build && cmake --build build --target {' '.join(BINARIES)}`")
    lacking = [m for m in ("torch", "sentencepiece", "httpx") if importlib.util.find_spec(m) is None]
    if lacking:
        return (f"not measured: {', '.join(lacking)} not installed (llama.cpp's converter needs torch, the client "
                f"httpx: pip install '.[test,serve]' in a checkout)")
    return None


def _bin(name: str) -> str:
    root = tree()
    assert root is not None
    return str(root / "build" / "bin" / name)


def stub_tokenizer(checkpoint: Path) -> None:
    """A 64-piece SentencePiece model as the checkpoint's tokenizer.model, for the converter only. Its special ids
    are the config's: pad 0, bos 1, eos 2."""
    import sentencepiece

    corpus = checkpoint / "stub-corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {7 * i}" for i in range(2000)))
    try:
        sentencepiece.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(checkpoint / "tokenizer"), vocab_size=64, model_type="bpe",
            pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2)
    finally:
        corpus.unlink()


def convert(checkpoint: Path, out: Path) -> dict[str, Path]:
    """The checkpoint as llama.cpp's f32, q8_0 and q4_0 files, made by its own converter and quantizer."""
    root = tree()
    assert root is not None
    stub_tokenizer(checkpoint)
    files = {t: out / f"model-{t}.gguf" for t in TYPES.values()}
    try:
        subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "f32",
                        "--outfile", str(files["f32"])], check=True, capture_output=True, text=True, timeout=900)
    finally:
        for stub in ("tokenizer.model", "tokenizer.vocab"):  # fd's sides run without a tokenizer, as before
            (checkpoint / stub).unlink(missing_ok=True)
    for kind in ("q8_0", "q4_0"):
        subprocess.run([_bin("llama-quantize"), str(files["f32"]), str(files[kind]), kind], check=True,
                       capture_output=True, text=True, timeout=900)
    return files


def bench_speeds(report: str) -> dict[tuple[str, int], float]:
    """(type, threads) -> generated tokens per second, from `llama-bench -o json`'s report."""
    speeds: dict[tuple[str, int], float] = {}
    for entry in json.loads(report):
        if int(entry.get("n_gen", 0)) <= 0:
            continue
        # The file names convert() gave: model-f32.gguf, model-q8_0.gguf, model-q4_0.gguf.
        stem = Path(str(entry["model_filename"])).stem
        name = stem.removeprefix("model-")
        if name not in TYPES.values():
            raise ValueError(f"llama-bench reported a model this row did not make: {entry['model_filename']!r}")
        speeds[(name, int(entry["n_threads"]))] = float(entry["avg_ts"])
    return speeds


def llama_bench(files: dict[str, Path], steps: int) -> dict[tuple[str, int], float]:
    """One llama-bench run of every file at 1 and 2 threads: decode of `steps` tokens after the prompt's positions."""
    models = ",".join(str(files[t]) for t in TYPES.values())
    proc = subprocess.run([_bin("llama-bench"), "-m", models, "-p", "0", "-n", str(steps), "-d", str(len(PROMPT)),
                           "-t", "1,2", "-r", "1", "-o", "json"], check=True, capture_output=True, text=True,
                          timeout=900)
    return bench_speeds(proc.stdout)


def fd_sides(checkpoint: Path, steps: int) -> dict[str, list[str]]:
    """Each fd side's `fd run` arguments: float32, wint8 and wint4 at tp=1 and tp=2."""
    base = ["-m", "fd_core.cli", "run", "--checkpoint", str(checkpoint), "--steps", str(steps), "--prompt-ids",
            ",".join(map(str, PROMPT)), "--kv-cache-blocks", "64", "--json"]
    sides = {}
    for scheme in TYPES:
        for tp in (1, 2):
            sides[f"fd {scheme} tp={tp}"] = [*base, "--tp", str(tp),
                                             *(("--quantization", scheme) if scheme != "float32" else ())]
    return sides


def measure_decode(checkpoint: Path, files: dict[str, Path], rounds: int, steps: int) -> dict[str, Any]:
    """Every fd side's `fd run --json` results and llama-bench's speeds, per round, the sides' order flipping."""
    from fd_bench.realsize import run_side

    sides = fd_sides(checkpoint, steps)
    fd: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    llama: dict[tuple[str, int], list[float]] = {}
    load = [os.getloadavg()[0]]
    order = ["llama.cpp", *sides]
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            if name == "llama.cpp":
                for key, speed in llama_bench(files, steps).items():
                    llama.setdefault(key, []).append(speed)
            else:
                fd[name].append(run_side(sides[name]))
        load.append(os.getloadavg()[0])
    return {"fd": fd, "llama": llama, "load": load, "rounds": rounds, "steps": steps}


def decode_lines(m: dict[str, Any]) -> list[Line]:
    """One line a scheme: fd's faster layout against llama.cpp's same-bits type at 2 threads."""
    fd = {n: statistics.median(r["tokens_per_s"] for r in runs) for n, runs in m["fd"].items()}
    llama = {k: statistics.median(v) for k, v in m["llama"].items()}
    loads = ", ".join(f"{x:.1f}" for x in m["load"])
    lines = []
    targets = {"float32": 0.9, "wint8": 1.0, "wint4": 1.0}
    for scheme, kind in TYPES.items():
        best = max((n for n in fd if f" {scheme} " in n), key=fd.__getitem__)
        ours, theirs = fd[best], llama[(kind, 2)]
        each = ", ".join(f"{n} {fd[n]:.1f}" for n in fd if f" {scheme} " in n)
        lines.append(Line(
            row="llamacpp", case=f"ERNIE-4.5-0.3B batch 1 decode: fd {scheme} vs llama.cpp {kind}", a=best,
            b=f"llama.cpp {kind}, 2 threads", a_value=ours, b_value=theirs, unit="tok/s", ratio=ours / theirs,
            ratio_label="fd / llama.cpp", target=f">= {targets[scheme]:.2f}", met=ours / theirs >= targets[scheme],
            note=(f"medians of {m['rounds']} interleaved rounds, {m['steps']} tokens after a {len(PROMPT)}-id prompt "
                  f"(llama-bench -d {len(PROMPT)}); fd: {each}; llama.cpp {kind} at 1 thread "
                  f"{llama[(kind, 1)]:.1f}; 1-minute load before and after each round: {loads}"),
            details={"fd": {n: [r["tokens_per_s"] for r in runs] for n, runs in m["fd"].items() if f" {scheme} " in n},
                     "llama": {str(t): v for (k, t), v in m["llama"].items() if k == kind}},
        ))
    return lines


def start_llama_server(model: Path, threads: int = 2) -> tuple[subprocess.Popen[str], str]:
    """llama-server on a free port with SLOTS parallel slots of 512 positions each; returns once it is healthy."""
    import socket

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([_bin("llama-server"), "-m", str(model), "-t", str(threads), "-c", str(512 * SLOTS),
                                "-np", str(SLOTS), "--host", "127.0.0.1", "--port", str(port)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode} before it was ready ({model.name})")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"llama-server did not become healthy in 120 s ({model.name})")


def agreement(fd_url: str, llama_url: str, tokens: int = 8) -> dict[str, Any]:
    """Both servers' greedy tokens for PROMPT and their top-2 log-probabilities at each step."""
    import httpx

    ours = httpx.post(f"{fd_url}/v1/completions", timeout=300, json={
        "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "logprobs": 2,
        "return_token_ids": True}).json()["choices"][0]
    theirs = httpx.post(f"{llama_url}/completion", timeout=300, json={
        "prompt": PROMPT, "n_predict": tokens, "temperature": 0, "ignore_eos": True, "n_probs": 2,
        "return_tokens": True, "cache_prompt": False}).json()
    fd_tokens = list(ours["token_ids"])
    ll_tokens = list(theirs["tokens"])
    gaps = []
    for step, entry in enumerate(theirs["completion_probabilities"]):
        want = {int(p["id"]): float(p["logprob"]) for p in entry["top_logprobs"]}
        got = ours["logprobs"]["top_logprobs"][step]
        for token, logprob in want.items():
            key = next((k for k in got if _token_id(k) == token), None)
            if key is not None:
                gaps.append(abs(got[key] - logprob))
    return {"fd_tokens": fd_tokens, "llama_tokens": ll_tokens, "equal": fd_tokens == ll_tokens,
            "max_logprob_gap": max(gaps) if gaps else None, "compared_logprobs": len(gaps)}


def _token_id(key: str) -> int | None:
    """The id in a logprobs key of a tokenizer-less checkpoint ("token_id:N", as fd serve names them)."""
    tail = key.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def measure_serving(checkpoint: Path, files: dict[str, Path], clients: tuple[int, ...], tokens: int) -> dict[str, Any]:
    """fd serve and llama-server, one fresh server at a time, at each client count; the agreement in f32."""
    from fd_bench import serving_load
    from fd_bench.serving import start_server

    out: dict[str, Any] = {}
    for scheme, kind in SERVING_SIDES:
        extra = ("--quantization", scheme) if scheme != "float32" else ()
        process, url = start_server(checkpoint, extra)
        try:
            out[f"fd serve {scheme}"] = serving_load.measure_url(url, checkpoint, clients, tokens)
            if scheme == "float32":
                llama_process, llama_url = start_llama_server(files[kind])
                try:
                    out["agreement"] = agreement(url, llama_url)
                finally:
                    _stop(llama_process)
        finally:
            _stop(process)
        llama_process, llama_url = start_llama_server(files[kind])
        try:
            out[f"llama-server {kind}"] = serving_load.measure_url(llama_url, checkpoint, clients, tokens,
                                                                   llama=True)
        finally:
            _stop(llama_process)
    return out


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def serving_lines(m: dict[str, Any], clients: tuple[int, ...], tokens: int) -> list[Line]:
    """One line a client count and dtype (the largest count held to 1.0x), then the agreement."""
    lines = []
    for scheme, kind in SERVING_SIDES:
        ours, theirs = m[f"fd serve {scheme}"], m[f"llama-server {kind}"]
        for n in clients:
            a, b = ours[n], theirs[n]
            target = ">= 1.00" if n == max(clients) else "reported"
            lines.append(Line(
                row="llamacpp", case=f"{n} concurrent client(s), 128-id prompts, {tokens} tokens: fd {scheme} vs "
                                     f"llama-server {kind}",
                a=f"fd serve {scheme} tp=1", b=f"llama-server {kind}, 2 threads, {SLOTS} slots", a_value=a["tok_s"],
                b_value=b["tok_s"], unit="tok/s", ratio=a["tok_s"] / b["tok_s"], ratio_label="fd / llama-server",
                target=target, met=(a["tok_s"] >= b["tok_s"]) if n == max(clients) else None,
                note=(f"time to first token p50 fd {a['ttft_p50_ms']:.0f} ms, llama-server {b['ttft_p50_ms']:.0f} ms; "
                      f"inter-token latency p50 fd {a['itl_p50_ms']:.0f} ms, llama-server {b['itl_p50_ms']:.0f} ms; "
                      f"p99 fd {a['itl_p99_ms']:.0f} ms, llama-server {b['itl_p99_ms']:.0f} ms"),
                details={"fd": a, "llama": b},
            ))
    agree = m["agreement"]
    gap = agree["max_logprob_gap"]
    lines.append(Line(
        row="llamacpp", case="greedy tokens and top-2 log-probabilities, fd serve float32 vs llama-server f32",
        a="fd serve float32", b="llama-server f32", a_value=float(len(agree["fd_tokens"])),
        b_value=float(len(agree["llama_tokens"])), unit="tokens", ratio=None, ratio_label="-",
        target="the same tokens", met=agree["equal"],
        note=(f"tokens {agree['fd_tokens']} vs {agree['llama_tokens']}; largest log-probability gap "
              f"{'-' if gap is None else f'{gap:.2e}'} over {agree['compared_logprobs']} compared"),
        details=agree,
    ))
    return lines


def llamacpp_rows(smoke: bool) -> list[Line]:
    """The row's lines, or lines saying why nothing was measured (no build; smoke mode)."""
    from fd_bench.serving import not_measured

    why = missing()
    if why is not None or smoke:
        why = why or "not measured in smoke mode (a full run converts 1.4 GB of weights three ways)"
        return [not_measured("llamacpp", f"ERNIE-4.5-0.3B: fd vs llama.cpp {kind}", "tok/s", "see docs", why)
                for kind in TYPES.values()]
    return run("all")


def run(which: str, rounds: int = 3) -> list[Line]:
    """A random checkpoint, its conversions, then the decode and / or serving parts' lines."""
    from fd_bench.realsize import random_checkpoint

    work = Path(tempfile.mkdtemp(prefix="fd-bench-llamacpp-"))
    try:
        checkpoint = random_checkpoint(work / "checkpoint", smoke=False)
        files = convert(checkpoint, work)
        lines: list[Line] = []
        if which in ("decode", "all"):
            lines += decode_lines(measure_decode(checkpoint, files, rounds, STEPS))
        if which in ("serving", "all"):
            from fd_bench.serving_load import CLIENTS, TOKENS

            lines += serving_lines(measure_serving(checkpoint, files, CLIENTS, TOKENS), CLIENTS, TOKENS)
        return lines
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str]) -> int:
    """`python -m fd_bench.llamacpp [decode|serving|all]`: the lines as JSON, one a line."""
    which = argv[0] if argv else "all"
    if which not in ("decode", "serving", "all"):
        print(f"fd_bench.llamacpp: unknown part {which!r}; choose decode, serving or all", file=sys.stderr)
        return 2
    why = missing()
    if why is not None:
        print(f"fd_bench.llamacpp: {why}", file=sys.stderr)
        return 2
    for line in run(which):
        print(json.dumps(line.to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
