"""Importing the runtime starts nothing heavy, and it exports what users need (the layering itself:
tests/core/test_layers.py)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_runtime_imports_no_paddle() -> None:
    code = "import sys, fd_core.runtime\nprint('paddle' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def test_the_runtime_exports_what_users_need_and_nothing_private() -> None:
    import fd_core.runtime as runtime

    assert sorted(runtime.__all__) == ["Completion", "Handoff", "LLM", "Piece", "SamplingParams", "Submission",
                                       "TokenLogprob", "Tokenizer", "load_tokenizer"]
    assert all(not name.startswith("_") for name in runtime.__all__)
