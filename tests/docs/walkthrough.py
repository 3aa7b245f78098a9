"""What the walk-through tests share: a doc's fenced blocks, and an environment that installs a
package and removes it after."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Iterator

DOCS = Path(__file__).resolve().parents[2] / "docs"


def blocks(doc: Path) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of `doc`, in order."""
    return re.findall(r"```(\w+)\n(.*?)```", doc.read_text(), re.S)


@contextlib.contextmanager
def walk_env(distribution: str) -> Iterator[dict[str, str]]:
    """This test environment for bash (its `bin` first on PATH, no FD_ settings), where the doc's `pip install`
    lands in a directory of its own on PYTHONPATH, not in the environment every other test shares (the tests run
    side by side: a package half-written by the walk-through would reach their `fd` runs); removed after."""
    bin_dir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    with tempfile.TemporaryDirectory(prefix=f"walk-{distribution}-") as site:
        env.update(PIP_NO_DEPS="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_TARGET=site, PIP_UPGRADE="1",
                   # Without it pip passes the target to the build backend's own install, which refuses it;
                   # the build uses this environment's setuptools (pip's env form: "0" turns isolation off).
                   PIP_NO_BUILD_ISOLATION="0",
                   PYTHONPATH=os.pathsep.join(filter(None, [site, env.get("PYTHONPATH", "")])),
                   PATH=os.pathsep.join([bin_dir, env.get("PATH", "")]))
        yield env
