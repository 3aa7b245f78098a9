"""The cores this process may run compute threads on: its affinity mask
(fd_core.detection.affinity_cores), capped by its cgroup's CPU quota."""

from __future__ import annotations

import math
from typing import Callable

CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_QUOTA = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_limit(read: Callable[[str], str | None] = _read) -> float | None:
    """The cgroup's CPU quota in cores (cgroup v2 `cpu.max`, else v1 cfs quota / period);
    None when unlimited or unknown."""
    line = read(CGROUP_V2_CPU_MAX)
    if line is not None:
        quota, _, period = line.partition(" ")
        pair = (quota, period or "100000")
    else:
        v1 = [read(path) for path in CGROUP_V1_QUOTA]
        if v1[0] is None or v1[1] is None:
            return None
        pair = (v1[0], v1[1])
    try:
        quota_us, period_us = int(pair[0]), int(pair[1])
    except ValueError:  # "max": no quota
        return None
    if quota_us <= 0 or period_us <= 0:  # v1 writes -1 for no quota
        return None
    return quota_us / period_us


def usable_cores(affinity: int, quota: float | None) -> int:
    """The affinity mask's cores, capped by the quota rounded up (a 1.5-core quota still runs
    two threads part of the time)."""
    cores = max(1, affinity)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


def describe(affinity: int, quota: float | None) -> str:
    """"2 usable: affinity mask 2, cgroup quota 1.5": for the detection's reason, after the core count."""
    limit = "no cgroup quota" if quota is None else f"cgroup quota {quota:g}"
    return f"{usable_cores(affinity, quota)} usable: affinity mask {affinity}, {limit}"
