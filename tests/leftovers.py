"""Processes a test started, found by a marker in their environment: what a run that should have
stopped everything left behind."""

from __future__ import annotations

import os
import signal
import time


def processes_with(variable: str, marker: str) -> list[int]:
    """Live (not zombie) processes whose environment has `variable`=`marker`."""
    needle = f"{variable}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(int(entry))
    return found


def left_over(variable: str, marker: str, wait: float = 3.0) -> list[int]:
    """Such processes still alive `wait` seconds after the run ended; killed (not leaked into the rest
    of the suite), then returned."""
    deadline = time.monotonic() + wait
    alive = processes_with(variable, marker)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = processes_with(variable, marker)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive
