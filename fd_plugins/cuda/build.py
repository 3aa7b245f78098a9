"""Which Paddle build is installed, read from package metadata: detection explains a wrong build without
importing paddle, so `fd plugins` stays light on machines that have only the CPU build."""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, packages_distributions, version

# Where the install commands for every build are; the detection reasons point users there.
INSTALL_DOC = "docs/install.md"
# Paddle's CPU build. Its GPU build is `paddlepaddle-gpu`; vendors ship others (`paddlepaddle-xpu`, ...).
CPU_DISTRIBUTION = "paddlepaddle"


def installed(distribution: str) -> str | None:
    """The installed version of `distribution`, None if it is not installed."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def paddle_build() -> str:
    """What provides the `paddle` package here, for a reason line: 'the CPU build (paddlepaddle 3.3.1)'."""
    cpu = installed(CPU_DISTRIBUTION)
    if cpu is not None:
        return f"the CPU build ({CPU_DISTRIBUTION} {cpu})"
    if importlib.util.find_spec("paddle") is None:  # finds the package without running its __init__
        return "not installed"
    # Rare: a build under another name. Scanning every distribution's metadata is slow, so it is paid only here.
    names = sorted(set(packages_distributions().get("paddle", [])))
    return " and ".join(f"{name} {installed(name)}" for name in names) or "installed by no known distribution"
