"""Executes every code block of docs/writing-a-model.md in order, in an empty directory.

Files are written where their `# file:` line says; shell blocks run line by line with bash in this
test environment. The package is really installed with pip, into a directory of the test's own on PYTHONPATH.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from walkthrough import DOCS, blocks, walk_env

DOC = DOCS / "writing-a-model.md"
ROOT = DOCS.parent


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    with walk_env("fd-mini-llama") as env:
        _walk(tmp_path, env)


def _walk(tmp_path: Path, env: dict[str, str]) -> None:
    ran = {"files": 0, "commands": 0}
    tokens = {}
    for lang, body in blocks(DOC):
        if lang in ("python", "toml"):
            first, _, rest = body.partition("\n")
            assert first.startswith("# file: "), f"a {lang} block without a '# file:' line: {first!r}"
            path = tmp_path / first.removeprefix("# file: ").strip()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(rest if lang == "toml" else body)
            ran["files"] += 1
        elif lang == "sh":
            for command in filter(None, (line.strip() for line in body.splitlines())):
                if command.startswith("fd run"):
                    command += " --json"
                done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                      timeout=600)
                assert done.returncode == 0, f"$ {command}\n{done.stdout}\n{done.stderr}"
                ran["commands"] += 1
                if command.startswith("fd plugins"):
                    assert "mini_llama" in done.stdout and "fd-mini-llama 0.1.0" in done.stdout
                if command.startswith("fd run"):
                    result = json.loads(done.stdout)
                    assert result["model"] == "mini_llama"
                    tokens[result["tp"]] = result["tokens"]
                if command.startswith("fd check"):
                    assert re.search(r"^\d+ passed, 0 failed, \d+ skipped$", done.stdout, re.M), done.stdout
                    if "--model" in command:  # the model suite, reference included (transformers is in the test extra)
                        for check in ("reference_greedy_tokens", "tp2_equals_tp1", "graph_clear_really_clears",
                                      "reload_cycles_keep_the_tokens"):
                            assert f"passed   test_{check}[preset]" in done.stdout, done.stdout
                    else:
                        assert "passed   test_clear_hook_really_clears_each_captured_model" in done.stdout
    assert ran["files"] == 5 and ran["commands"] == 7
    assert tokens[1] == tokens[2] and len(set(tokens[1])) > 2  # tp=2 equals tp=1, on tokens that vary
    # With the package installed, fd bench's row that runs an older commit of fd still runs: that commit gets fd's
    # built-in plugins only, not a package written for today's contract.
    bench = subprocess.run([sys.executable, "-m", "fd_bench", "--smoke", "--rows", "decode_paged", "--json",
                            str(tmp_path / "bench.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    assert json.loads((tmp_path / "bench.json").read_text())["errors"] == {}
