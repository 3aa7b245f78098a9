"""Real-size rows: ERNIE-4.5-0.3B's published config with random bfloat16 weights, `fd run --checkpoint` at tp=1
and tp=2 against transformers on the same checkpoint and against the machine's read bandwidth, and the peak
RSS per rank over its weights and KV cache.

Every side is a whole process (as a user runs it); the sides take turns, the order flipping every round, and
each reports medians over the rounds. `--smoke` runs the tiny preset once per side, to prove the rows run.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from fd_bench.report import Line

CONFIG = Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "ernie-4.5-0.3b.json"
PROMPT = "5,17,42,99,7,300,1024,2048,4096,8192,16384,32768,65536,100000,77,3"
SMOKE_PROMPT = "5,17,42,99,7,300,1,2"


def _run(args: list[str], timeout: float = 900) -> dict[str, Any]:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args[:3])} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    return json.loads(done.stdout[done.stdout.index("{"):])


def _idle_paddle_rss() -> int:
    """Peak RSS of a process that imported paddle (and paddle.distributed, as a rank does) and did nothing else."""
    code = "import resource, paddle, paddle.distributed; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("torch") is not None


def measure(smoke: bool) -> dict[str, Any]:
    """Every side's results per round, the idle RSS and the bandwidth, from one run."""
    workdir = Path(tempfile.mkdtemp(prefix="fd-bench-realsize-"))
    checkpoint = workdir / "checkpoint"
    save = ["-m", "fd_core.cli", "save-random", "--dtype", "bfloat16", str(checkpoint)]
    save[3:3] = ["--model", "ernie4_5"] if smoke else ["--config", str(CONFIG)]
    subprocess.run([sys.executable, *save], capture_output=True, text=True, check=True, timeout=900)
    prompt, steps, rounds = (SMOKE_PROMPT, 8, 1) if smoke else (PROMPT, 32, 3)
    sides = {
        "fd tp=1": ["-m", "fd_core.cli", "run", "--checkpoint", str(checkpoint), "--tp", "1", "--steps", str(steps), "--prompt-ids", prompt, "--json"],
        "fd tp=2": ["-m", "fd_core.cli", "run", "--checkpoint", str(checkpoint), "--tp", "2", "--steps", str(steps), "--prompt-ids", prompt, "--json"],
    }
    if _has_transformers():
        sides["transformers"] = ["-m", "fd_bench.hf_decode", str(checkpoint), prompt, str(steps)]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    idle: list[int] = []
    bandwidth: dict[int, list[float]] = {1: [], 2: []}
    try:
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                results[name].append(_run(sides[name]))
            idle.append(_idle_paddle_rss())
            for procs in (1, 2):
                bandwidth[procs].append(_run(["-m", "fd_bench.bandwidth", str(procs), "64" if smoke else "512"])["total_gb_s"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"results": results, "idle_rss": statistics.median(idle), "bandwidth": {k: statistics.median(v) for k, v in bandwidth.items()},
            "steps": steps, "rounds": rounds}


def realsize_rows(smoke: bool) -> list[Line]:
    m = measure(smoke)
    res, rounds = m["results"], m["rounds"]
    speed = {name: statistics.median(r["tokens_per_s"] for r in runs) for name, runs in res.items()}
    size = "tiny preset" if smoke else "ERNIE-4.5-0.3B"
    lines: list[Line] = []
    same = all(r["tokens"] == res["fd tp=1"][0]["tokens"] for runs in res.values() for r in runs)
    common = f"medians of {rounds} interleaved round(s), {m['steps']} tokens each; same tokens on every side: {same}"
    hf = "transformers" in speed

    bw = m["bandwidth"]
    shares = {n: [statistics.median(r["decode_core_share_by_rank"][i] for r in runs) for i in range(len(runs[0]["decode_core_share_by_rank"]))]
              for n, runs in res.items() if n.startswith("fd")}
    machine = (f"; two processes at once read {bw[2] / bw[1]:.2f}x what one reads in this run ({bw[2]:.1f} vs {bw[1]:.1f} GB/s), "
               f"the ceiling of tp=2 over tp=1 here; core share while decoding: "
               + ", ".join(f"{n} " + "/".join(f"{s:.2f}" for s in v) for n, v in shares.items()))

    def decode_line(a: str, b: str, target: float) -> Line:
        ratio = speed[a] / speed[b]
        return Line(row="realsize", case=f"{size} decode, {a} vs {b}", a=a, b=b, a_value=speed[a], b_value=speed[b], unit="tok/s",
                    ratio=ratio, ratio_label=f"{a} / {b}", target=f">= {target:.1f}", met=ratio >= target,
                    note=common + (machine if "tp=2" in a else ""),
                    details={"tokens_per_s": {n: [r["tokens_per_s"] for r in runs] for n, runs in res.items()}, "bandwidth_gb_s": bw,
                             "decode_core_share": shares})

    if hf:
        lines.append(decode_line("fd tp=1", "transformers", 1.2))
        lines.append(decode_line("fd tp=2", "transformers", 2.0))
    lines.append(decode_line("fd tp=2", "fd tp=1", 1.6))
    # Against the bandwidth bound: one token reads every weight once (each rank its shard, at once).
    for name, procs in (("fd tp=1", 1), ("fd tp=2", 2)):
        weights = sum(res[name][0]["weight_bytes_by_rank"])
        bound = m["bandwidth"][procs] * 1e9 / weights
        lines.append(Line(row="realsize", case=f"{size} decode, {name} vs read bandwidth", a=name,
                          b=f"bandwidth bound ({procs} process{'es' if procs > 1 else ''})",
                          a_value=speed[name], b_value=bound, unit="tok/s", ratio=speed[name] / bound, ratio_label="fd / bound", target="reported", met=None,
                          note=(f"bound = {m['bandwidth'][procs]:.1f} GB/s measured (float32 matrix-vector, {procs} process(es) at once) "
                                f"/ {weights / 1e9:.3f} GB of weights per token")))
    idle = m["idle_rss"]
    for name in ("fd tp=1", "fd tp=2"):
        runs = res[name]
        ranks = len(runs[0]["peak_rss_bytes_by_rank"])
        over = []
        for rank in range(ranks):
            peak = statistics.median(r["peak_rss_bytes_by_rank"][rank] for r in runs)
            # The measure: less an idle process that imported paddle (a forked rank starts
            # below it, sharing its parent's pages, and counts them again as it touches them).
            base = idle
            held = runs[0]["weight_bytes_by_rank"][rank] + runs[0]["kv_cache_bytes_by_rank"][rank]
            over.append(((peak - base) / held, peak, held, base))
        worst = max(over)
        lines.append(Line(row="realsize", case=f"{size} peak RSS per rank, {name}", a="peak RSS - idle paddle", b="weights + KV cache",
                          a_value=(worst[1] - worst[3]) / 2**20, b_value=worst[2] / 2**20, unit="MiB", ratio=worst[0], ratio_label="A / B (worst rank)",
                          target="<= 1.20", met=worst[0] <= 1.2,
                          note=f"idle paddle process {idle / 2**20:.0f} MiB (measured in this run); per rank: "
                               + ", ".join(f"{o[0]:.2f} ({o[1] / 2**20:.0f} MiB peak)" for o in over)
                               + "; held at the rank's start: "
                               + "/".join(f"{statistics.median(r['entry_rss_bytes_by_rank'][i] for r in runs) / 2**20:.0f}" for i in range(ranks))
                               + " MiB"))
    if hf:
        peak = statistics.median(r["peak_rss_bytes"] for r in res["transformers"])
        lines[-1].note += f"; transformers peaks at {peak / 2**20:.0f} MiB"
    if not hf:
        lines[0].note += "; transformers is not installed (pip install '.[cpu,test]' in a checkout): compared with fd's own tp=1 only"
    return lines
