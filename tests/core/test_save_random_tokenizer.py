"""`fd save-random --tokenizer`: a text model's random checkpoint with a tokenizer and chat template that fd reads back
(text in, text out); refused for a model that takes pictures before anything is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _fd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fd_core.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_a_text_checkpoint_with_a_tokenizer_runs_chat(tmp_path: Path) -> None:
    made = _fd("save-random", "--model", "ernie4_5", "--tokenizer", "tiny", cwd=tmp_path)
    assert made.returncode == 0 and "with a tokenizer and a chat template" in made.stdout, made.stderr
    ran = _fd("run", "--tp", "1", "--checkpoint", "tiny", "--chat", "--prompt", "Hello", "--max-new-tokens", "3",
              "--json", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    output = json.loads(ran.stdout)["outputs"][0]
    assert isinstance(output["text"], str) and len(output["ids"]) >= 1


def test_a_model_that_takes_pictures_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    done = _fd("save-random", "--model", "qwen3_vl", "--tokenizer", "vl", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "fd: error: --tokenizer writes a text tokenizer, and qwen3_vl takes pictures; save it without --tokenizer and "
        "copy its published tokenizer beside it, or use --model ernie4_5"], done.stderr
    assert not (tmp_path / "vl").exists()
