"""The host's memory as the cpu platform's one device: /proc/meminfo, bounded by this process's cgroup limit."""

from __future__ import annotations

from pathlib import Path

from fd_core import DeviceMemory

# cgroup v1 reports "no limit" as a huge number (about 2**63, rounded to a page); anything from here up is none.
_NO_LIMIT = 2**62


def _read_int(path: Path) -> int | None:
    """The integer in a one-value file; None when it is absent, unreadable or "max" (cgroup v2's no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    value = int(text)
    return value if value < _NO_LIMIT else None


def meminfo(root: Path = Path("/")) -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) of /proc/meminfo in bytes; None for what is not there."""
    found: dict[str, int] = {}
    try:
        with open(root / "proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    found[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found.get("MemTotal"), found.get("MemAvailable")


def cgroup_limit(root: Path = Path("/")) -> tuple[int | None, int | None]:
    """(limit, usage) in bytes of the tightest memory cgroup this process is in; (None, None) without a limit.

    cgroup v2: memory.max and memory.current of this process's group (/proc/self/cgroup's "0::" line),
    or of the mount's root in a container. cgroup v1: memory.limit_in_bytes and memory.usage_in_bytes
    of its memory group, or of the memory mount's root.
    """
    cgroup = root / "sys/fs/cgroup"
    candidates: list[tuple[Path, str, str]] = []
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        relative = path.lstrip("/")
        if controllers == "":
            candidates.append((cgroup / relative, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            candidates.append((cgroup / "memory" / relative, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    candidates += [(cgroup, "memory.max", "memory.current"),
                   (cgroup / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes")]
    best: tuple[int | None, int | None] = (None, None)
    for directory, limit_file, usage_file in candidates:
        limit = _read_int(directory / limit_file)
        if limit is not None and (best[0] is None or limit < best[0]):
            best = (limit, _read_int(directory / usage_file))
    return best


def host_memory(root: Path = Path("/")) -> DeviceMemory | None:
    """The host as one device: total is MemTotal within the cgroup limit; free is MemAvailable within what the
    limit leaves. None where /proc/meminfo says nothing."""
    total, available = meminfo(root)
    if total is None:
        return None
    free = available if available is not None else total
    limit, usage = cgroup_limit(root)
    if limit is not None:
        total = min(total, limit)
        free = min(free, max(0, limit - (usage or 0)))
    return DeviceMemory(total=total, free=min(free, total))


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere).

    Loading frees each float weight once its product is prepared, while glibc's adaptive mmap threshold has grown
    with the large blocks freed before: later weights come from the heap, whose freed pages stay resident until
    trimmed (measured: about 500 MiB of ERNIE-4.5-0.3B's load, held for the whole run).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)
