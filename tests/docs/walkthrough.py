"""What the walk-through tests share: a doc's fenced blocks, and an environment that installs a
package and removes it after."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

DOCS = Path(__file__).resolve().parents[2] / "docs"


def blocks(doc: Path) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of `doc`, in order."""
    return re.findall(r"```(\w+)\n(.*?)```", doc.read_text(), re.S)


@contextlib.contextmanager
def walk_env(distribution: str) -> Iterator[dict[str, str]]:
    """This test environment for bash (its `bin` first on PATH, no FD_ settings);
    `distribution` is uninstalled after."""
    bin_dir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    env.update(PIP_NO_DEPS="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PATH=os.pathsep.join([bin_dir, env.get("PATH", "")]))
    try:
        yield env
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", distribution], capture_output=True,
                       timeout=120)
