"""Real-size rows: ERNIE-4.5-0.3B's published config with random bfloat16 weights saved as transformers saves
them; `fd run --checkpoint` at tp=1 and tp=2 as a user starts it (no environment set), against transformers
at 1 and 2 torch threads (float32; bfloat16 reported), against the measured matrix-vector ceiling at the
same number of cores and tp=2's bound under it (the ceiling's products with a tp=2 step's all-reduces and
nothing else, `fd_bench.insync`), fd tp=2 beside one competing busy thread, the peak RSS per rank over its weights and
KV cache, and where a decode step's time goes (the `step` row).

Every side is a whole process; the sides take turns, the order flipping every round, and each reports
medians over the rounds. The machine's load average is recorded with the figures. `--smoke` runs the tiny
preset once per side, to prove the rows run.
"""

from __future__ import annotations

import json
import math
import os
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
BUSY = "while True: pass"
# The step row's (tp, batch) cases: one sequence at both layouts, then tp=1's step as the batch grows.
STEP_CASES = ((1, 1), (2, 1), (1, 2), (1, 4), (1, 8))
FD_SIDES = ("fd tp=1", "fd tp=2")
HF_SIDES = ("transformers 1 thread", "transformers 2 threads")
HF_BF16 = "transformers 2 threads bfloat16"
BUSY_SIDE = "fd tp=2, one busy thread beside it"


def run_side(args: list[str], timeout: float = 900) -> dict[str, Any]:
    # as a user starts it
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args[:3])} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    return json.loads(done.stdout[done.stdout.index("{"):])


def _busy_run(args: list[str]) -> dict[str, Any]:
    """`args` run while one other process spins a core (a competing single-thread load)."""
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        return run_side(args)
    finally:
        busy.kill()
        busy.wait()


def idle_paddle_rss() -> int:
    """Peak RSS of a process that imported paddle (and paddle.distributed, as a rank does) and did nothing else."""
    code = ("import resource, paddle, paddle.distributed; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.split()[-1])


def has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("torch") is not None


def random_checkpoint(checkpoint: Path, smoke: bool) -> Path:
    """ERNIE-4.5-0.3B's config (the tiny preset under `smoke`) with random bfloat16 weights, saved by `fd save-random`
    as transformers saves a checkpoint."""
    save = ["-m", "fd_core.cli", "save-random", "--dtype", "bfloat16", str(checkpoint)]
    save[3:3] = ["--model", "ernie4_5"] if smoke else ["--config", str(CONFIG)]
    subprocess.run([sys.executable, *save], capture_output=True, text=True, check=True, timeout=900)
    return checkpoint


def measure(smoke: bool) -> dict[str, Any]:
    """Every side's results per round, the matrix-vector ceilings, the idle RSS,
    the step breakdowns and the load, from one run."""
    workdir = Path(tempfile.mkdtemp(prefix="fd-bench-realsize-"))
    checkpoint = random_checkpoint(workdir / "checkpoint", smoke)
    prompt, steps, rounds = (SMOKE_PROMPT, 8, 1) if smoke else (PROMPT, 32, 3)
    config_path = str(checkpoint / "config.json")
    fd = ["-m", "fd_core.cli", "run", "--checkpoint", str(checkpoint), "--steps", str(steps),
          "--prompt-ids", prompt, "--json"]
    sides: dict[str, list[str]] = {"fd tp=1": [*fd, "--tp", "1"], "fd tp=2": [*fd, "--tp", "2"],
                                   BUSY_SIDE: [*fd, "--tp", "2"]}
    hf = has_transformers()
    if hf:
        base = ["-m", "fd_bench.hf_decode", str(checkpoint), prompt, str(steps)]
        sides.update({HF_SIDES[0]: [*base, "1"], HF_SIDES[1]: [*base, "2"], HF_BF16: [*base, "2", "bfloat16"]})
    ceilings: dict[str, list[str]] = {
        "paddle, 1 process x 1 thread": ["-m", "fd_bench.matvec", config_path, "paddle", "1", "1"],
        "paddle, 2 processes x 1 thread": ["-m", "fd_bench.matvec", config_path, "paddle", "2", "1"],
        # What fd tp=1 reads at: one process, its one-row products split across 2 threads by the cpu platform's kernel.
        "paddle, 1 process x 2 threads (fd's split product)":
            ["-m", "fd_bench.matvec", config_path, "fd-split", "1", "2"],
    }
    if hf:
        ceilings.update({"torch, 1 thread": ["-m", "fd_bench.matvec", config_path, "torch", "1", "1"],
                         "torch, 2 threads": ["-m", "fd_bench.matvec", config_path, "torch", "1", "2"]})
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    matvec: dict[str, list[dict[str, Any]]] = {name: [] for name in ceilings}
    insync: list[dict[str, Any]] = []
    idle: list[int] = []
    load = [os.getloadavg()[0]]
    try:
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                results[name].append(_busy_run(sides[name]) if name == BUSY_SIDE else run_side(sides[name]))
            for name, args in ceilings.items():
                matvec[name].append(run_side(args))
            # tp=2's bound: the 2-process ceiling's products with a tp=2 step's all-reduces between them, nothing else.
            insync.append(run_side(["-m", "fd_bench.insync", config_path, "3" if smoke else "10"]))
            idle.append(idle_paddle_rss())
            load.append(os.getloadavg()[0])
        # (tp, batch): batch 1 at both layouts, then how tp=1's step grows with the batch.
        step = {(tp, batch): run_side(["-m", "fd_bench.step", str(checkpoint), str(tp), str(steps), prompt, "off",
                                       "-", str(batch)])
                for tp, batch in STEP_CASES}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"results": results, "matvec": matvec, "insync": insync, "idle_rss": statistics.median(idle), "steps": steps,
            "rounds": rounds, "load": load, "step": step}


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _cores(name: str, threads: dict[str, int]) -> int:
    """Cores a side computes on: its ranks times threads per rank."""
    return 2 if "tp=2" in name else threads.get(name, 1)


def realsize_rows(smoke: bool, m: dict[str, Any] | None = None) -> list[Line]:
    m = m if m is not None else measure(smoke)
    res, rounds = m["results"], m["rounds"]
    speed = {name: _median(runs, "tokens_per_s") for name, runs in res.items()}
    size = "tiny preset" if smoke else "ERNIE-4.5-0.3B"
    lines: list[Line] = []
    reference = res["fd tp=1"][0]["tokens"]
    same = {name: all(r["tokens"] == reference for r in runs) for name, runs in res.items()}
    loads = ", ".join(f"{x:.1f}" for x in m["load"])
    common = (f"medians of {rounds} interleaved round(s), {m['steps']} tokens each; "
              f"1-minute load average before and after each round: {loads}; "
              f"same tokens as fd tp=1: " + ", ".join(f"{n} {s}" for n, s in same.items()))
    threads = {name: runs[0]["threads"]["per_rank"] for name, runs in res.items() if name.startswith("fd")}
    threads.update({name: runs[0]["threads"] for name, runs in res.items() if name.startswith("transformers")})
    shares = {n: "/".join(f"{statistics.median(r['decode_core_share_by_rank'][i] for r in runs):.2f}"
                          for i in range(len(runs[0]["decode_core_share_by_rank"])))
              for n, runs in res.items() if n.startswith("fd")}
    details = {"tokens_per_s": {n: [r["tokens_per_s"] for r in runs] for n, runs in res.items()}, "threads": threads,
               "load": m["load"], "matvec": m["matvec"], "core_share": shares}
    fd_best = max(FD_SIDES, key=speed.__getitem__)
    fd_worst = min(FD_SIDES, key=speed.__getitem__)
    setting = ", ".join(f"{n}: {threads[n]} thread(s) a rank, core share {shares[n]}" for n in FD_SIDES)

    def line(case: str, a: str, b: str, a_value: float, b_value: float, unit: str, label: str, target: float | None,
             note: str) -> Line:
        ratio = a_value / b_value if b_value else math.nan
        return Line(row="realsize", case=f"{size}: {case}", a=a, b=b, a_value=a_value, b_value=b_value, unit=unit,
                    ratio=ratio, ratio_label=label, target="reported" if target is None else f">= {target:.2f}",
                    met=None if target is None else ratio >= target, note=note, details=details)

    hf_best = max(HF_SIDES, key=speed.__getitem__) if HF_SIDES[0] in speed else None
    if hf_best is not None:
        lines.append(line("fd's faster layout vs transformers' faster float32 setting", fd_best, hf_best,
                          speed[fd_best], speed[hf_best], "tok/s", "fd / transformers", 1.1,
                          f"{common}; transformers: 1 thread {speed[HF_SIDES[0]]:.2f}, "
                          f"2 threads {speed[HF_SIDES[1]]:.2f}, 2 threads bfloat16 {speed[HF_BF16]:.2f} tok/s "
                          f"(Paddle's CPU build has no bfloat16 matmul); {setting}"))
    else:
        common += "; transformers is not installed (pip install '.[cpu,test]' in a checkout): no reference side"
    lines.append(line("the slower fd layout vs the faster", fd_worst, fd_best, speed[fd_worst], speed[fd_best],
                      "tok/s", "slower / faster", 0.85, f"{common}; {setting}"))
    # The ceiling at the cores the faster layout computes on: the best matrix-vector pass measured with that many.
    passes = {name: _median(runs, "passes_per_s") for name, runs in m["matvec"].items()}
    cores = _cores(fd_best, threads)
    at_cores = {n: v for n, v in passes.items() if (2 if ("2 processes" in n or "2 threads" in n) else 1) == cores}
    ceiling_name = max(at_cores, key=at_cores.__getitem__)
    lines.append(line(f"fd's faster layout vs the matrix-vector ceiling on {cores} core(s)", fd_best,
                      f"matvec pass ({ceiling_name})", speed[fd_best], at_cores[ceiling_name], "tok/s",
                      "fd / ceiling", 0.85,
                      "one float32 product per weight matrix of the model (every layer's 7 projections and the "
                      "LM head), nothing else, median passes/s: "
                      + ", ".join(f"{n} {v:.2f} ({_median(m['matvec'][n], 'gb_s'):.1f} GB/s)"
                                  for n, v in passes.items())))
    if m.get("insync"):
        lines.append(_insync_line(m["insync"], size, details))
    lines.append(line("fd tp=2 beside one busy thread vs fd tp=2 alone", BUSY_SIDE, "fd tp=2", speed[BUSY_SIDE],
                      speed["fd tp=2"], "tok/s", "busy / quiet", 0.6,
                      f"{common}; the competing load is one process spinning (`python -c '{BUSY}'`) for the whole run; "
                      f"core share with it: {shares[BUSY_SIDE]}, without: {shares['fd tp=2']}"))
    lines += _rss_lines(m, size)
    return lines


def _insync_line(runs: list[dict[str, Any]], size: str, details: dict[str, Any]) -> Line:
    """tp=2's bound: the products with the all-reduces of a tp=2 step between them, against the same products free."""
    in_step, free = _median(runs, "passes_per_s"), _median(runs, "free_passes_per_s")
    # Each round's two modes ran in the same processes, pass for pass: the paired ratio is the measure.
    paired = statistics.median(r["in_step_over_free"] for r in runs)
    ranks = [r["ranks"] for r in runs]
    calls = int(ranks[0][0]["all_reduces_per_pass"])
    waits = "/".join(f"{statistics.median(rs[i]['wait_ms_per_pass'] for rs in ranks):.2f}"
                     for i in range(len(ranks[0])))
    cold = statistics.median(r["small_op_after_product_us"] for rs in ranks for r in rs)
    warm = statistics.median(r["small_op_after_small_op_us"] for rs in ranks for r in rs)
    return Line(
        row="realsize",
        case=f"{size}: tp=2's products with its {calls} all-reduces and nothing else vs the same products free",
        a=f"2 ranks in step at {calls} all-reduces", b="2 ranks free (the 2-process ceiling)", a_value=in_step,
        b_value=free, unit="passes/s", ratio=paired, ratio_label="in step / free (median of the rounds' pairs)",
        target="reported", met=None,
        note=("the best a tp=2 step can reach against the 2-process ceiling, with no attention, norms or sampling "
              "at all; per round: " + ", ".join(f"{r['in_step_over_free']:.3f}" for r in runs)
              + f" ({runs[0]['repeats']} passes a mode, alternating); "
              f"waits per in-step pass by rank {waits} ms; one [1, hidden] add costs {cold:.1f} us right after a "
              f"product and {warm:.1f} us right after another add (the product evicted the caches the op's code "
              "and data were in)"),
        details={**details, "insync": runs},
    )


def _rss_lines(m: dict[str, Any], size: str) -> list[Line]:
    res, idle = m["results"], m["idle_rss"]
    lines = []
    for name in FD_SIDES:
        runs = res[name]
        ranks = len(runs[0]["peak_rss_bytes_by_rank"])
        over = []
        for rank in range(ranks):
            peak = statistics.median(r["peak_rss_bytes_by_rank"][rank] for r in runs)
            # The measure: less an idle process that imported paddle (a forked rank starts
            # below it, sharing its parent's pages, and counts them again as it touches them).
            held = runs[0]["weight_bytes_by_rank"][rank] + runs[0]["kv_cache_bytes_by_rank"][rank]
            over.append(((peak - idle) / held, peak, held))
        worst = max(over)
        if size == "tiny preset":
            # A tiny model's weights are a few MiB against an idle paddle's hundreds, whose size varies
            # more than that between processes (a forked rank's peak can fall below it): only the whole
            # peak against idle paddle plus weights and cache is reported.
            peak, held = max(o[1] for o in over), max(o[2] for o in over)
            lines.append(Line(row="realsize", case=f"{size}: peak RSS per rank, {name}", a="peak RSS",
                              b="idle paddle + weights + KV cache", a_value=peak / 2**20,
                              b_value=(idle + held) / 2**20, unit="MiB", ratio=peak / (idle + held),
                              ratio_label="A / B (worst rank)", target="reported", met=None,
                              note="the real-size run judges peak RSS less idle paddle against weights + KV cache "
                                   "(<= 1.20)"))
            continue
        note = (f"idle paddle process {idle / 2**20:.0f} MiB (measured in this run); per rank: "
                + ", ".join(f"{o[0]:.2f} ({o[1] / 2**20:.0f} MiB peak)" for o in over)
                + "; held at the rank's start: "
                + "/".join(f"{statistics.median(r['entry_rss_bytes_by_rank'][i] for r in runs) / 2**20:.0f}"
                           for i in range(ranks)) + " MiB")
        if HF_SIDES[0] in res:
            note += f"; transformers (2 threads) peaks at {_median(res[HF_SIDES[1]], 'peak_rss_bytes') / 2**20:.0f} MiB"
        lines.append(Line(row="realsize", case=f"{size}: peak RSS per rank, {name}", a="peak RSS - idle paddle",
                          b="weights + KV cache", a_value=(worst[1] - idle) / 2**20, b_value=worst[2] / 2**20,
                          unit="MiB", ratio=worst[0], ratio_label="A / B (worst rank)",
                          target="<= 1.20", met=worst[0] <= 1.2, note=note))
    return lines


def step_rows(smoke: bool, m: dict[str, Any]) -> list[Line]:
    """Where a decode step's time goes, at tp=1 and tp=2, and at tp=1 with 2, 4 and 8 sequences (eager, so that every
    op is seen; rank 0, and rank 1's waits)."""
    from fd_bench.step import PARTS

    size = "tiny preset" if smoke else "ERNIE-4.5-0.3B"
    lines = []
    for (tp, batch), doc in m["step"].items():
        ranks = doc["ranks"]
        r0 = ranks[0]
        parts = r0["parts_ms"]
        matrix = parts["linear"] + parts["lm_head"]
        rest = r0["step_ms"] - matrix
        waits = "; ".join(f"rank {r['rank']}: all-reduce {r['shm']['calls_per_step']:.0f} calls, "
                          f"waited {r['shm']['wait_ms_per_step']:.2f} ms "
                          f"({r['shm']['slept_ms_per_step']:.2f} ms of it asleep)" for r in ranks if r.get("shm"))
        lines.append(Line(
            row="step", case=f"{size} decode step, tp={tp}, batch {batch}, {r0['threads']} thread(s) a rank, eager",
            a="not matrix work", b="whole step", a_value=rest, b_value=r0["step_ms"], unit="ms",
            ratio=rest / r0["step_ms"] if r0["step_ms"] else math.nan, ratio_label="share of the step",
            target="reported", met=None,
            note=(f"{r0['tokens_per_s']:.2f} tok/s, core share {r0['core_share']:.2f}; ms a step: "
                  + ", ".join(f"{PARTS[k]} {parts[k]:.2f}" for k in PARTS) + (f"; {waits}" if waits else "")),
            details=doc,
        ))
    return lines
