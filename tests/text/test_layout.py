"""The runtime stays apart: contract modules never import it, and importing it starts nothing heavy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The runner (which the runtime drives, and which will move into it) and the CLI may use the runtime.
USERS = {"runner.py", "cli.py"}
IMPORT = re.compile(r"^\s*(from|import)\s+fd_core\.runtime\b", re.M)


def test_contract_modules_never_import_the_runtime() -> None:
    hits = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "fd_core").rglob("*.py"))
            if "runtime" not in p.parts and p.name not in USERS and IMPORT.search(p.read_text())]
    assert not hits, f"contract modules importing fd_core.runtime: {hits}"
    assert IMPORT.search("    from fd_core.runtime.engine import Engine") and not IMPORT.search("from fd_core.runner import x")


def test_importing_the_runtime_imports_no_paddle() -> None:
    code = "import sys, fd_core.runtime\nprint('paddle' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def test_the_runtime_exports_what_users_need_and_nothing_private() -> None:
    import fd_core.runtime as runtime

    assert sorted(runtime.__all__) == ["Completion", "LLM", "SamplingParams", "Tokenizer", "load_tokenizer"]
    assert all(not name.startswith("_") for name in runtime.__all__)
