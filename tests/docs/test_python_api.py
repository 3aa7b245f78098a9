"""Executes every Python block of docs/python-api.md, docs/disaggregation.md's, and README's Python API section, as
written, each in a fresh directory after the command the page shows to make the checkpoint its examples load."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def readme_section() -> str:
    """README's 'Python API' section (up to the next heading of its level)."""
    text = (ROOT / "README.md").read_text()
    return text.split("## Python API", 1)[1].split("\n## ", 1)[0]


def sh_commands(text: str) -> list[str]:
    """Every line of the text's sh blocks."""
    return [line for block in re.findall(r"```sh\n(.*?)```", text, re.S) for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize(("source", "made_by"), [
    ("docs/python-api.md", ["fd save-random --model qwen3_vl --tokenizer checkpoints/qwen3-vl"]),
    ("README.md", ["fd save-random --model ernie4_5 --tokenizer checkpoints/ernie-tiny"]),
    ("docs/disaggregation.md", None),  # its sh block is for two hosts (tests/serve/test_disaggregated_serve.py)
])
def test_the_python_blocks_run_as_written(tmp_path: Path, source: str, made_by: list[str] | None) -> None:
    text = (ROOT / source).read_text() if source.startswith("docs") else readme_section()
    blocks = python_blocks(text)
    assert len(blocks) >= (5 if source == "docs/python-api.md" else 1)
    # The page makes its checkpoint first, with the command it shows (the only one it shows).
    commands = sh_commands(text) if made_by is not None else []
    assert made_by is None or commands == made_by, commands
    workdir = tmp_path
    for command in commands:
        made = subprocess.run([sys.executable, "-m", "fd_core.cli", *command.split()[1:]], cwd=workdir,
                              capture_output=True, text=True, timeout=300)
        assert made.returncode == 0, made.stderr
    for index, block in enumerate(blocks):
        # As a script, the way a user pastes it: a tp=2 example without the main guard fails there.
        script = workdir / f"{Path(source).stem}_{index}.py"
        script.write_text(block)
        if "tp=2" in block:
            assert 'if __name__ == "__main__":' in block, f"{source}: a tp=2 example needs the main guard:\n{block}"
        done = subprocess.run([sys.executable, str(script)], cwd=workdir, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{source}:\n{block}\n{done.stdout}\n{done.stderr}"
