"""Reload row: time and resident memory across weight-reload cycles (fd_core.runtime.engine.runner.ModelRunner,
generating through the engine).

Runs in a fresh process (`python -m fd_bench.reload CYCLES STEPS`), so the RSS is the runner's alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fd_bench.report import Line


def measure(cycles: int, steps: int, graph: str = "auto") -> dict:
    """One tp=1 runner on the cpu platform; graphs on auto (the row: a static-graph capture
    after every reload) or off."""
    from fd_core.host.paddle_logs import quiet_paddle_logs

    quiet_paddle_logs()
    from fd_core import ParallelConfig
    from fd_core.host.backend import load_backend
    from fd_core.runtime.engine.loop import Engine
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for
    from fd_core.runtime.procstats import resident_bytes
    from fd_core.runtime.request import Request

    env = dict(os.environ)
    env["FD_PLATFORM"] = "cpu"
    backend = load_backend(ParallelConfig(), env=env)
    arch = backend.plugins.registry.get("ernie4_5")
    runner = ModelRunner(backend, arch, model_config_for(arch, None), graph=graph)
    request = Request.greedy([[1, 2, 3, 4]], steps)
    engine = Engine(runner)
    start = time.perf_counter()
    runner.load()
    decision = runner.decide()
    first = engine.generate(request)[0].token_ids
    record = [{"cycle": 0, "seconds": time.perf_counter() - start, "rss_bytes": resident_bytes(), "same_tokens": True}]
    for cycle in range(1, cycles + 1):
        start = time.perf_counter()
        runner.reload()
        again = engine.generate(request)[0].token_ids
        record.append({"cycle": cycle, "seconds": time.perf_counter() - start, "rss_bytes": resident_bytes(),
                       "same_tokens": again == first})
    return {"graph": f"{decision.mode} {'on' if decision.allowed else 'off'}", "graph_summary": decision.summary(),
            "steps": steps, "cycles": record}


def _run(cycles: int, steps: int, graph: str) -> dict:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "fd_bench.reload", str(cycles), str(steps), graph],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"reload worker (graph {graph}) failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reload_rows(smoke: bool) -> list[Line]:
    """The row (graphs on auto, as `fd run` does), and the same cycles with graphs off to show what capture adds."""
    cycles, steps = (3, 4) if smoke else (20, 16)
    lines = []
    for graph in ("auto", "off"):
        data = _run(cycles, steps, graph)
        rec = data["cycles"]
        after_first = rec[1]["rss_bytes"]
        last = rec[-1]["rss_bytes"]
        growth = (last - after_first) / after_first * 100
        secs = sorted(r["seconds"] for r in rec[1:])
        median_s = secs[len(secs) // 2]
        same = all(r["same_tokens"] for r in rec)
        lines.append(Line(
            row="reload", case=f"{cycles} cycles, tp=1, --graph {graph} ({data['graph']})",
            a=f"RSS after cycle {cycles}", b="RSS after cycle 1", a_value=last / 2**20, b_value=after_first / 2**20,
            unit="MiB", ratio=last / after_first, ratio_label="last / first", target="growth <= 1%",
            met=growth <= 1.0 and same,
            note=(f"growth {growth:+.2f}% after cycle 1 "
                  f"({(last - after_first) / 2**20 / max(cycles - 1, 1):.2f} MiB a cycle); "
                  f"median cycle {median_s * 1000:.0f} ms; first load+generate {rec[0]['seconds']:.2f} s; "
                  f"tokens unchanged: {same}"),
            details={"growth_pct": growth, "median_cycle_s": median_s, **data},
        ))
    return lines


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4])))
