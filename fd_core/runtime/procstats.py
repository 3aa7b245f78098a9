"""This process's start time and memory, from /proc (what the run reports measure)."""

from __future__ import annotations

import os
import time

# More than this between the process's creation and fd's entry point means the process ran something
# else first and then exec'd fd (a shell's `bash -c '... && fd run'` keeps its process); Python's own
# start-up and fd's imports take about 0.1 s.
INHERITED_S = 1.0


def process_start_time(entered: float | None = None) -> float:
    """When fd started in this process, as time.time(): the process's creation (from /proc where there is
    one), unless that was more than INHERITED_S before `entered`, the time fd's entry point was imported:
    then the process was created for something else and exec'd fd later, and `entered` is fd's start."""
    created = _created()
    if entered is not None and entered - created > INHERITED_S:
        return entered
    return created


def _created() -> float:
    """When this process was created (forked), as time.time(); now where /proc cannot say."""
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
