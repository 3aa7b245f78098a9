"""Paged KV cache rows (ERNIE-4.5-0.3B's size; the tiny preset in smoke mode), each with both sides in one run:

- prefix: 8 requests sharing a system prompt (1,024 tokens) through `fd serve`, one after another: the median time to
  first token with prefix caching against without;
- capacity: at one KV budget, sequences of mixed lengths (64 to 2,048 positions) running together before any
  preemption: the engine's blocks against the fixed-slot cache fd had before (a batch's rows each as long as its
  longest sequence, rounded up to 32);
- chunked: the largest gap between two tokens of a running stream while a 4,096-token prompt arrives, prefilled in
  chunks of --max-prefill-tokens against whole;
- decode: tokens per second at batch 1 and batch 8 against the code before the paged cache (its commit, run from a
  copy of that tree in the same run).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fd_bench.report import Line

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "benchmarks" / "configs" / "ernie-4.5-0.3b.json"
# The last commit with the fixed-slot cache: the decode row's "before".
BEFORE = "91dfbf0"


def _scratch(prefix: str) -> Path:
    """A new temporary directory, removed when the process exits (a checkpoint of the real size is 700 MiB)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def bench_checkpoint(smoke: bool) -> Path:
    """A random checkpoint of the benchmark's size (bfloat16 storage, as published), written once."""
    root = _scratch("fd-bench-paged-")
    checkpoint = root / "checkpoint"
    save = [sys.executable, "-m", "fd_core.cli", "save-random", "--dtype", "bfloat16", str(checkpoint)]
    save[4:4] = ["--model", "ernie4_5"] if smoke else ["--config", str(CONFIG)]
    subprocess.run(save, capture_output=True, text=True, check=True, timeout=900)
    return checkpoint


def random_ids(count: int, seed: int, vocab: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab, size=count)]


# -- prefix: fd serve, a shared system prompt -------------------------------------------------------------------
def _serve_ttft(checkpoint: Path, caching: bool, prompts: list[list[int]]) -> list[float]:
    """Seconds to the first token of each prompt (token ids), sent one after another to one `fd serve`."""
    import httpx

    from fd_bench.serving import start_server

    process, url = start_server(checkpoint, [] if caching else ["--no-prefix-caching"])
    try:
        out = []
        with httpx.Client(timeout=900) as client:
            for prompt in prompts:
                body = {"prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True}
                start = time.perf_counter()
                first: float | None = None
                with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter() - start
                out.append(first if first is not None else time.perf_counter() - start)
        return out
    finally:
        process.terminate()
        process.wait(60)


def prefix_rows(smoke: bool) -> list[Line]:
    from fd_bench.serving import missing_serve_extra, not_measured

    why = missing_serve_extra()
    if why is not None:
        return [not_measured("prefix", "8 requests sharing a system prompt", "ms", ">= 4", why)]
    checkpoint = bench_checkpoint(smoke)
    vocab = json.loads((checkpoint / "config.json").read_text()).get("vocab_size", 512)
    system = random_ids(64 if smoke else 1024, 0, vocab)
    prompts = [system + random_ids(16, 1 + i, vocab) for i in range(3 if smoke else 8)]
    sides = {"caching": _serve_ttft(checkpoint, True, prompts), "no caching": _serve_ttft(checkpoint, False, prompts)}
    med = {k: statistics.median(v) for k, v in sides.items()}
    ratio = med["no caching"] / med["caching"]
    return [Line(
        row="prefix", case=f"{len(prompts)} requests sharing a {len(system)}-token system prompt, one after another",
        a="fd serve, prefix caching", b="fd serve --no-prefix-caching", a_value=med["caching"] * 1e3,
        b_value=med["no caching"] * 1e3, unit="ms", ratio=ratio, ratio_label="without / with", target=">= 4",
        met=ratio >= 4, note=("median time to first token; the first request fills the cache on both sides; "
                              f"with caching: {', '.join(f'{t * 1e3:.0f}' for t in sides['caching'])} ms"),
        details={"ttft_s": sides},
    )]


# -- capacity: blocks against fixed slots -------------------------------------------------------------------------
def _fixed_slots(lengths: list[int], budget: int, max_batch: int) -> int:
    """How many of `lengths` (in order) the fixed-slot cache ran together: a batch of n rows, each as long as the
    longest need rounded up to 32 positions, within `budget` positions."""
    count, longest = 0, 0
    for need in lengths:
        longest = max(longest, -(-need // 32) * 32)
        if count + 1 > max_batch or (count + 1) * longest > budget:
            break
        count += 1
    return count


def capacity_rows(smoke: bool) -> list[Line]:
    import numpy as np

    from fd_core.host.backend import Backend
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.engine.loop import Engine, Job
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.memory import MemoryPlan
    from fd_core.runtime.plan import model_config_for

    plugins = load_plugins()
    arch = plugins.registry.get("ernie4_5")
    config = model_config_for(arch, None)
    runner = ModelRunner(Backend(plugins), arch, config, graph="off")
    runner.load()
    runner.decide()
    rng = np.random.default_rng(7)
    count, budget, max_batch = (16, 4096, 16) if smoke else (64, 16384, 64)
    lengths = [int(n) for n in rng.integers(64, 2049, size=count)]
    # Each sequence: a prompt of half its length, the rest generated (a position each), so it grows while it runs.
    jobs = [Job(i, tuple(random_ids(n // 2, 100 + i, config.vocab_size)), SamplingParams(max_new_tokens=n - n // 2,
                                                                                 ignore_eos=True))
            for i, n in enumerate(lengths)]
    memory = MemoryPlan(1.0, config.dtype, 1, 0, 1, block_size=16, blocks=budget // 16, blocks_from="the benchmark")
    engine = Engine(runner, max_batch=max_batch, memory=memory, prefix_caching=False)
    for job in jobs:
        engine.add(job)
    most = 0
    while engine.pending and engine.preemptions == 0:
        engine.step()
        most = max(most, len(engine.running)) if engine.preemptions == 0 else most
    engine.reset()
    fixed = _fixed_slots(lengths, budget, max_batch)
    ratio = most / max(fixed, 1)
    return [Line(
        row="capacity", case=f"{budget} positions of KV cache, {count} sequences of 64 to 2048 positions",
        a="blocks of 16", b="fixed slots (the cache before)", a_value=float(most), b_value=float(fixed),
        unit="sequences", ratio=ratio, ratio_label="blocks / fixed", target=">= 2", met=ratio >= 2,
        note=("sequences running together before the first preemption (a prompt of half its length, the rest "
              "generated); fixed slots: every row as long as the batch's longest, rounded up to 32, as fd's cache "
              f"was before blocks; lengths in order: {lengths[:12]}..."),
        details={"lengths": lengths, "blocks_running": most, "fixed_running": fixed},
    )]


# -- chunked: a long prompt arriving beside a stream ------------------------------------------------------------
def _largest_gap(checkpoint: Path, chunk: int, long_prompt: list[int], steps: int) -> float:
    """The largest gap (seconds) between two tokens of a running stream while `long_prompt` arrives."""
    from fd_core.runtime import LLM, SamplingParams

    # Eager decode: a graph captured for a new batch shape mid-run would be a gap of its own (the 0.3B size runs eagerly
    # on the cpu platform anyway).
    with LLM(checkpoint, max_prefill_tokens=chunk, prefix_caching=False, graph="off") as llm:
        stream = llm.submit(long_prompt[:8], SamplingParams(max_new_tokens=steps, ignore_eos=True))
        times: list[float] = []
        done = threading.Event()

        def watch() -> None:
            # The stream's tokens as they arrive (a checkpoint without a tokenizer streams no text: count tokens).
            seen = 0
            while not done.is_set() and not stream.done:
                if stream.generated_tokens > seen:
                    seen = stream.generated_tokens
                    times.append(time.perf_counter())
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        while len(times) < 4 and not stream.done:
            time.sleep(0.01)
        llm.submit(long_prompt, SamplingParams(max_new_tokens=2, ignore_eos=True)).result()
        done.set()
        stream.cancel()
        watcher.join()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return max(gaps)


def chunked_rows(smoke: bool) -> list[Line]:
    checkpoint = bench_checkpoint(smoke)
    vocab = json.loads((checkpoint / "config.json").read_text()).get("vocab_size", 512)
    length, chunk = (512, 64) if smoke else (4096, 512)
    long_prompt = random_ids(length, 3, vocab)
    steps = 400 if smoke else 200
    chunked = _largest_gap(checkpoint, chunk, long_prompt, steps)
    whole = _largest_gap(checkpoint, length, long_prompt, steps)
    ratio = chunked / whole
    return [Line(
        row="chunked", case=f"a {length}-token prompt arriving beside a running stream",
        a=f"--max-prefill-tokens {chunk}", b=f"--max-prefill-tokens {length} (whole)", a_value=chunked * 1e3,
        b_value=whole * 1e3, unit="ms", ratio=ratio, ratio_label="chunked / whole", target="<= 0.3", met=ratio <= 0.3,
        note="the largest gap between two of the stream's tokens while the long prompt is prefilled (LLM, tp=1)",
        details={"chunked_s": chunked, "whole_s": whole},
    )]


# -- decode: against the code before blocks ---------------------------------------------------------------------
def _tree(rev: str) -> Path | None:
    """A copy of the repository's packages at `rev` (git archive), or None outside a git checkout that has it."""
    if not (ROOT / ".git").exists():
        return None
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "fd_core", "fd_plugins", "fd_models"],
                             capture_output=True)
    if archive.returncode:  # a shallow clone without that commit
        return None
    target = _scratch(f"fd-bench-{rev}-")
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    # A plugin module of today's packages that the older commit lacks would resolve to today's (the editable install's
    # finder), with hooks the older fd does not know: it gets an empty stand-in there.
    from importlib.metadata import entry_points

    for point in entry_points(group="fd.plugins"):
        parts = point.value.split(":")[0].split(".")
        module = (target / Path(*parts)).with_suffix(".py")
        if parts[0] in ("fd_core", "fd_plugins", "fd_models") and not module.exists():
            for depth in range(1, len(parts)):
                package = target / Path(*parts[:depth])
                package.mkdir(exist_ok=True)
                (package / "__init__.py").touch()
            module.write_text('"""Not in this commit."""\n')
    return target


def _decode_rate(checkpoint: Path, batch: int, steps: int, tree: Path | None, vocab: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    # fd's built-in plugins only, on both sides: a third-party package installed for today's fd may declare what
    # the older commit does not know (a newer contract, a new field), and it would time neither side the same way.
    env["FD_PLUGINS"] = ""
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH", "")]))
    args = [sys.executable, "-m", "fd_core.cli", "run", "--checkpoint", str(checkpoint), "--tp", "1",
            "--max-new-tokens", str(steps), "--json"]
    for i in range(batch):
        args += ["--prompt-ids", ",".join(str(t) for t in random_ids(16, 50 + i, vocab))]
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800, env=env, cwd=tree or ROOT)
    if done.returncode:
        raise RuntimeError(f"fd run failed: {done.stderr.strip().splitlines()[-1:]}")
    return float(json.loads(done.stdout)["tokens_per_s"])


def decode_rows(smoke: bool) -> list[Line]:
    checkpoint = bench_checkpoint(smoke)
    vocab = json.loads((checkpoint / "config.json").read_text()).get("vocab_size", 512)
    tree = _tree(BEFORE)
    if tree is None:
        return [Line(row="decode_paged", case="against the code before blocks", a="-", b="-", a_value=None,
                     b_value=None, unit="tok/s", ratio=None, ratio_label="-", target=">= 0.95", met=None,
                     note=f"not a git checkout with commit {BEFORE}: the code before blocks cannot be fetched")]
    steps, rounds = (8, 1) if smoke else (32, 3)
    lines = []
    for batch in (1, 8):
        now: list[float] = []
        before: list[float] = []
        for i in range(rounds):  # interleaved, the order flipping each round
            pair = [(now, None), (before, tree)] if i % 2 == 0 else [(before, tree), (now, None)]
            for out, where in pair:
                out.append(_decode_rate(checkpoint, batch, steps, where, vocab))
        a, b = statistics.median(now), statistics.median(before)
        lines.append(Line(
            row="decode_paged", case=f"decode at batch {batch}, tp=1", a="paged KV cache",
            b=f"fixed slots ({BEFORE})",
            a_value=a, b_value=b, unit="tok/s", ratio=a / b, ratio_label="paged / before", target=">= 0.95",
            met=a / b >= 0.95,
            note=f"fd run --json tokens_per_s, medians of {rounds} interleaved round(s), {steps} tokens",
            details={"now": now, "before": before},
        ))
    return lines
