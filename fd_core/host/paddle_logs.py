"""Paddle's own noise (C++ info logs, import-time warnings) kept off a user's terminal, set before paddle is
imported."""

from __future__ import annotations

import os
import warnings


def quiet_paddle_logs() -> None:
    """Keep paddle's C++ info logs and import-time warnings off a user's terminal (user settings and `fd --verbose`
    win).

    Idempotent: called where paddle may be imported next (a command, LLM, spawning ranks, a Backend); a spawned rank
    inherits the environment it sets."""
    if os.environ.get("FD_VERBOSE", "0") not in ("", "0"):
        return
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ.setdefault("GLOG_v", "0")
    # Spawned ranks import paddle before any code of ours runs: filter through the environment.
    quiet = "ignore:No ccache found"
    current = os.environ.get("PYTHONWARNINGS", "")
    if quiet not in current:
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [current, quiet]))
    warnings.filterwarnings("ignore", message="No ccache found")
    # Paddle's notice that a host-only build runs without devices ("...ONLY mode").
    warnings.filterwarnings("ignore", message=r".*[A-Z]{3}ONLY mode.*")
