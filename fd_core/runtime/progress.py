"""Rank progress: each rank notes the phase it is in, and the parent reads the notes to tell a stuck rank.

A rank started by `spawn_ranks` finds its note's path in FD_PROGRESS_FILE; elsewhere (tp=1 in the
`fd` process, a launcher) reporting does nothing. Notes are rate-limited: a decode loop may call
`report` every step.
"""

from __future__ import annotations

import os
import time

PROGRESS_ENV = "FD_PROGRESS_FILE"
# Within one phase, a note at most this often (seconds).
_MIN_INTERVAL = 0.5
_last: tuple[str, float] = ("", 0.0)


def report(phase: str) -> None:
    """Note that this rank is alive in `phase` (a new phase is always written, the same one at most every 0.5 s)."""
    global _last
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    now = time.time()
    if phase == _last[0] and now - _last[1] < _MIN_INTERVAL:
        return
    _last = (phase, now)
    try:
        with open(path + ".tmp", "w") as f:
            f.write(f"{now!r} {phase}")
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # a full disk must not fail the rank; the parent then sees it as quiet


def read(path: str) -> tuple[float, str] | None:
    """(time, phase) of a rank's last note, or None before its first."""
    try:
        with open(path) as f:
            stamp, _, phase = f.read().partition(" ")
        return float(stamp), phase
    except (OSError, ValueError):
        return None
