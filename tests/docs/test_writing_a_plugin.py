"""Executes every code block of docs/writing-a-plugin.md in order, in an empty directory.

Files are written where their `# file:` line says; shell blocks run line by line with bash, in this test
environment (its `bin` first on PATH). The plugin is really installed with pip, into a directory of the test's
own on PYTHONPATH (walkthrough.walk_env), so the environment the other tests share never holds it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from walkthrough import DOCS, blocks, walk_env

DOC = DOCS / "writing-a-plugin.md"


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    with walk_env("fd-mychip") as env:
        _walk(tmp_path, env)


def _walk(tmp_path: Path, env: dict[str, str]) -> None:
    ran = {"files": 0, "commands": 0}
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
                done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                      timeout=300)
                assert done.returncode == 0, f"$ {command}\n{done.stdout}\n{done.stderr}"
                ran["commands"] += 1
                if command.startswith("fd plugins"):
                    assert "fd-mychip 0.1.0" in done.stdout and "not active" in done.stdout
                if (command.startswith("FD_PLATFORM=mychip fd explain") and "grep" not in command
                        and "--json" not in command):
                    assert ("mychip vetoed: mychip has no graph backend yet" in done.stdout
                            or "no graph backend" in done.stdout)
                if command.startswith("FD_PLATFORM=mychip fd explain") and 'grep -A1 "^memory:"' in command:
                    # The memory report: weights per rank and the KV cache its two 1 GiB devices leave.
                    assert done.stdout.startswith("memory: weights 0.20 MiB per rank (tp=2, float32); KV cache "), done.stdout
                if "--memory-fraction 0.5 --json" in command:
                    weights, count, block_size, fraction = done.stdout.split()
                    # The device's half GiB holds far more: the pool is what 8 sequences of the preset's 4096-token
                    # context could use, in blocks of 16.
                    assert ((int(weights), int(count), int(block_size), float(fraction))
                            == (214272, 8 * 4096 // 16, 16, 0.5)), done.stdout
                if command == "fd check mychip":
                    assert re.search(r"^\d+ passed, 0 failed, \d+ skipped$", done.stdout, re.M), done.stdout
                    assert re.search(r"skipped\s+test_replay_equals_eager_and_clear_recaptures\s+mychip: capabilities.graphs is False", done.stdout)
                if "fd explain" in command and "grep kernels" in command:
                    assert "rms_norm: mychip, silu_and_mul: native" in done.stdout, done.stdout
                if command == 'fd check mychip -k "kernel or native_path"':  # the doc's mychip has no cache kernels
                    assert "3 passed, 0 failed, 0 skipped" in done.stdout, done.stdout
                    assert re.search(r"passed\s+test_every_kernel_in_use_matches_the_native_op", done.stdout)
    assert ran["files"] == 5 and ran["commands"] >= 14
