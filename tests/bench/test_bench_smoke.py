"""The benchmark runs: `fd bench --smoke` in a subprocess prints every row and writes valid JSON.

This checks that the benchmark still works, not how fast anything is: no timing is asserted here.
The targets are judged from the full run's numbers, recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("dispatch", "dispatch_vs_hook", "dispatch_wrapper", "tp1", "decode", "startup", "allreduce", "graph", "reload", "realsize", "kvwrite")
LINE_KEYS = {"row", "case", "a", "b", "a_value", "b_value", "unit", "ratio", "ratio_label", "target", "met", "note", "details"}


def test_smoke_prints_every_row_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "results" / "smoke.json"
    env = {k: v for k, v in os.environ.items() if k not in ("FD_PLATFORM", "FD_PLUGINS")}
    # The checkout first, so the benchmark under test is this one even before a reinstall.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "fd_bench", "--smoke", "--json", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"fd bench --smoke failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    printed = {line.split("|")[1].strip() for line in table}
    assert set(ROWS) <= printed, f"rows missing from the table: {sorted(set(ROWS) - printed)}\n{proc.stdout}"

    doc = json.loads(out.read_text())
    assert doc["mode"] == "smoke"
    assert doc["errors"] == {}, doc["errors"]
    assert list(doc["rows"]) == list(ROWS)
    assert {"nproc", "cpu_model", "python", "paddlepaddle"} <= set(doc["machine"])
    by_row: dict[str, list[dict]] = {}
    for line in doc["lines"]:
        assert LINE_KEYS <= set(line), f"line lacks {sorted(LINE_KEYS - set(line))}: {line}"
        by_row.setdefault(line["row"], []).append(line)
    assert set(by_row) == set(ROWS)
    # Every comparison produced numbers (a side may be absent only when its plugin is not installed).
    for row, lines in by_row.items():
        for line in lines:
            assert line["b_value"] is not None, (row, line)
            assert line["a_value"] is not None or "not installed" in line["a"], (row, line)
    assert len(by_row["allreduce"]) == 4  # 1 KiB, 64 KiB, 1 MiB, 16 MiB
    assert len(by_row["startup"]) == 2  # import fd_core, fd plugins


def test_rows_option_selects_rows(tmp_path: Path) -> None:
    out = tmp_path / "tp1.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "fd_bench", "--smoke", "--rows", "tp1,dispatch", "--json", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {line["row"] for line in json.loads(out.read_text())["lines"]} == {"dispatch", "tp1"}
    bad = subprocess.run([sys.executable, "-m", "fd_bench", "--rows", "nosuchrow"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "nosuchrow" in bad.stderr
