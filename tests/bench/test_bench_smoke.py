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
ROWS = ("dispatch", "dispatch_vs_hook", "dispatch_wrapper", "tp1", "decode", "startup", "allreduce", "graph", "reload",
        "realsize", "step", "kvwrite", "kernels", "serve", "serving", "prefix", "capacity", "chunked", "decode_paged",
        "quant", "disagg")
# The rows the CI smoke run prints: all but the real-size comparison and its step breakdown, whose smoke
# run alone (a dozen processes importing paddle and torch) took 40 of the suite's 20-minute budget;
# `fd bench --rows realsize,step` runs them, as docs/benchmarks.md records.
SMOKE_ROWS = tuple(r for r in ROWS if r not in ("realsize", "step"))
LINE_KEYS = {"row", "case", "a", "b", "a_value", "b_value", "unit", "ratio", "ratio_label", "target", "met",
             "note", "details"}


def test_smoke_prints_every_row_and_writes_json(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    out = tmp_path / "results" / "smoke.json"
    env = {k: v for k, v in os.environ.items() if k not in ("FD_PLATFORM", "FD_PLUGINS")}
    # The checkout first, so the benchmark under test is this one even before a reinstall.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "fd_bench", "--smoke", "--rows", ",".join(SMOKE_ROWS), "--json", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"fd bench --smoke failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    printed = {line.split("|")[1].strip() for line in table}
    assert set(SMOKE_ROWS) <= printed, f"rows missing from the table: {sorted(set(SMOKE_ROWS) - printed)}\n{proc.stdout}"

    doc = json.loads(out.read_text())
    assert doc["mode"] == "smoke"
    assert doc["errors"] == {}, doc["errors"]
    assert list(doc["rows"]) == list(SMOKE_ROWS)
    assert {"nproc", "cpu_model", "python", "paddlepaddle"} <= set(doc["machine"])
    by_row: dict[str, list[dict]] = {}
    for line in doc["lines"]:
        assert LINE_KEYS <= set(line), f"line lacks {sorted(LINE_KEYS - set(line))}: {line}"
        by_row.setdefault(line["row"], []).append(line)
    assert set(by_row) == set(SMOKE_ROWS)
    # Every comparison produced numbers (a side may be absent only when its plugin is not installed).
    for row, lines in by_row.items():
        for line in lines:
            assert line["b_value"] is not None, (row, line)
            assert line["a_value"] is not None or "not installed" in line["a"], (row, line)
    assert len(by_row["allreduce"]) == 4  # 1 KiB, 64 KiB, 1 MiB, 16 MiB
    assert len(by_row["startup"]) == 2  # import fd_core, fd plugins
    # fd serve's logprobs, n and structured output against the plain requests of the same run (the row checks each
    # field came back applied); figures are finite (else doc["errors"]), and every structured request ran to
    # max_tokens, so its per-token time compares with the plain one's.
    serve = {line["case"]: line for line in by_row["serve"]}
    for case in ("logprobs 5, 4 clients: tok/s", "logprobs 5, 4 clients: time to first token",
                 "n=4, 4 clients: tok/s of every choice", "n=4, 4 clients: time to first token",
                 "json_schema, 4 clients: decode time per token"):
        assert case in serve and serve[case]["ratio"] is not None, (case, sorted(serve))
    schema = serve["json_schema, 4 clients: decode time per token"]["details"]
    assert schema["a"]["short"] == 0 and schema["a"]["tokens"] == schema["b"]["tokens"], schema


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
    bad = subprocess.run([sys.executable, "-m", "fd_bench", "--rows", "nosuchrow"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "nosuchrow" in bad.stderr


def test_json_to_stdout_is_only_json_and_errors_are_one_line(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))

    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fd_core.cli", "bench", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    piped = bench("--smoke", "--rows", "tp1", "--json", "-")
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert json.loads(piped.stdout)["rows"] == ["tp1"]  # the whole of stdout is the JSON document
    assert "| tp1" in piped.stderr  # the table went to stderr
    missing = tmp_path / "nosuch" / "dir" / "x.json"
    (tmp_path / "afile").write_text("")
    for args, message in [
        (("--json", str(missing)), f"fd: error: --json {missing}: directory {missing.parent} does not exist; create it or choose another path (see fd bench --help)"),
        (("--json", str(tmp_path)), f"fd: error: --json {tmp_path} is a directory; name a file in it (see fd bench --help)"),
        (("--frobnicate",), "fd: error: unrecognized arguments: --frobnicate (see fd bench --help)"),
        (("--json", ""), "fd: error: --json needs a file name, or - for stdout (see fd bench --help)"),
        (("--json", "nosuch/"), "fd: error: --json nosuch/ is a directory; name a file in it (see fd bench --help)"),
        (("--json", str(tmp_path / "afile" / "x.json")), f"fd: error: --json {tmp_path / 'afile' / 'x.json'}: {tmp_path / 'afile'} is not a directory; choose another path (see fd bench --help)"),
    ]:
        done = bench(*args)
        assert (done.returncode, done.stdout, done.stderr) == (2, "", message + "\n")
    assert not missing.parent.exists() and not (tmp_path / "nosuch").exists()  # nothing was made on the way
    # fd's own -v before a plugin's command reaches the command.
    verbose = subprocess.run([sys.executable, "-m", "fd_core.cli", "-v", "bench", "--smoke", "--rows", "tp1",
                              "--json", "-"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert verbose.returncode == 0 and json.loads(verbose.stdout)["rows"] == ["tp1"], verbose.stderr[-3000:]
