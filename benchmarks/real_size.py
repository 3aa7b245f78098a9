"""Real-size smoke: ERNIE-4.5-0.3B's published config, random bfloat16 weights in the published layout,
`fd run --checkpoint` at tp=1 and tp=2; prints load time, decode tokens/s, peak RSS per rank and
whether both tensor-parallel sizes gave the same tokens.

    python benchmarks/real_size.py [--steps 32] [--runs 3] [--keep DIR]

Runs alternate tp=1 and tp=2 (`--runs` of each) and the medians are reported. Needs about 6 GB of
memory and a few minutes on 2 cores. Not part of the test suite: it prints figures, it asserts only
that the tokens agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).parent / "configs" / "ernie-4.5-0.3b.json"
PROMPT = "5,17,42,99,7,300,1024,2048,4096,8192,16384,32768,65536,100000,77,3"


def fd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fd_core.cli", *args], capture_output=True, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", default=None,
                        help="write the checkpoint here and keep it (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="fd-real-size-"))
    checkpoint = root / "ernie-4.5-0.3b-random" if args.keep is None else root
    if not (checkpoint / "config.json").exists():
        start = time.perf_counter()
        saved = fd("save-random", "--config", str(CONFIG), "--dtype", "bfloat16", str(checkpoint))
        if saved.returncode:
            print(saved.stderr, file=sys.stderr)
            return 1
        size = sum(p.stat().st_size for p in checkpoint.iterdir())
        print(f"wrote {checkpoint} ({size / 1e9:.3f} GB, bfloat16) in {time.perf_counter() - start:.1f}s")
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(args.runs):
        for tp in (1, 2):
            start = time.perf_counter()
            done = fd("run", "--checkpoint", str(checkpoint), "--tp", str(tp), "--steps", str(args.steps),
                      "--prompt-ids", PROMPT, "--json")
            if done.returncode:
                print(done.stderr, file=sys.stderr)
                return 1
            result = json.loads(done.stdout)
            result["wall_s"] = time.perf_counter() - start
            runs[tp].append(result)
    print(f"\nERNIE-4.5-0.3B shape, random bf16 weights, {len(PROMPT.split(','))}-token prompt, {args.steps} tokens, "
          f"medians of {args.runs} interleaved runs")
    print("| tp | load (s) | decode tokens/s | peak RSS per rank (GB) | wall (s) |")
    print("|---|---|---|---|---|")
    for tp, results in runs.items():
        load = statistics.median(r["timings_s"]["load"] for r in results)
        speed = statistics.median(r["tokens_per_s"] for r in results)
        peaks = [statistics.median(r["peak_rss_bytes_by_rank"][i] for r in results) / 1e9 for i in range(tp)]
        wall = statistics.median(r["wall_s"] for r in results)
        print(f"| {tp} | {load:.2f} | {speed:.1f} | {' / '.join(f'{p:.2f}' for p in peaks)} | {wall:.1f} |")
    same = all(r["tokens"] == runs[1][0]["tokens"] for rs in runs.values() for r in rs)
    print(f"\nsame tokens at tp=1 and tp=2: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
