"""This process's start time and memory, from /proc (what the run reports measure)."""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """When this process started, as time.time() (from /proc where there is one; else now)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Its age from the uptime, both in 10 ms steps (the boot time /proc/stat gives is whole seconds).
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def peak_resident_bytes() -> int:
    """This process's peak resident set size so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes() -> int:
    """This process's resident set size now (not its peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
