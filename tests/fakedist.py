"""Installs throwaway plugin distributions (a module plus a real .dist-info) for discovery tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Mapping


def make_distribution(
    root: Path,
    name: str,
    modules: Mapping[str, str],
    entry_points: Mapping[str, Mapping[str, str]],
    version: str = "0.1.0",
) -> Path:
    """Write `modules` and a dist-info declaring `entry_points` under `root`; put `root` on sys.path to install."""
    root.mkdir(parents=True, exist_ok=True)
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{ep} = {value}" for ep, value in eps.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return root


def run_fd(
    args: list[str], path: Path | None = None, env: Mapping[str, str] | None = None, timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run the `fd` command as a user would, with `path` prepended to PYTHONPATH."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    if path is not None:
        full["PYTHONPATH"] = os.pathsep.join([str(path), full.get("PYTHONPATH", "")])
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "fd_core.cli", *args], capture_output=True, text=True, env=full, timeout=timeout
    )


def listing(stdout: str) -> dict[str, dict[str, str]]:
    """`fd plugins` text read back: section ("platform plugins", "architectures", ...) -> entry name ->
    the entry's lines joined with single spaces (the listing wraps at 100 columns)."""
    sections: dict[str, dict[str, str]] = {}
    section: dict[str, str] = {}
    name = ""
    for line in stdout.splitlines():
        if line and not line.startswith(" "):
            section = sections.setdefault(line.rstrip(":"), {})
        elif line.startswith("  ") and not line.startswith("   "):
            name = line.split()[0]
            section[name] = " ".join(line.split())
        elif line.strip():
            section[name] += " " + " ".join(line.split())
    return sections
