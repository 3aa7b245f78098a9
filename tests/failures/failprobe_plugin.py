"""A test-only extension plugin that injects rank failures and records what a rank sees.

It is not part of fd-backends: tests/failures installs it as a throwaway distribution (entry point
group `fd.plugins`, name `failprobe`) with the `install_plugin` fixture or `make_distribution`, and
puts that distribution on PYTHONPATH for `fd run` in a subprocess; spawned ranks inherit the path
and the environment. It is an ordinary hook wrapper around `fd_all_reduce`, the one call every
tensor-parallel rank makes on every step, so it fails a rank exactly where a broken collective
or a crashed process would. Run with `--graph off`: a captured graph replays without calling
Python, so the wrapper would only see the calls made while tracing and prefilling.

Environment (unset: the plugin only counts calls):

FDTEST_FAIL_RANK   the rank that fails
FDTEST_FAIL_AFTER  how many all-reduce calls that rank completes before it fails (default 0)
FDTEST_FAIL_HOW    "raise" (a RuntimeError naming the call) or "kill" (SIGKILL to itself)
FDTEST_PROBE_DIR   a directory: at call FDTEST_PROBE_AT (default 1) every rank writes rank<N>.json
                   with its pid, its rendezvous environment and the TCP sockets it listens on; a
                   failing rank writes the time it fails to rank<N>.failing first
FDTEST_HANG_CLEANUP_RANK   the rank whose fd_clean_memory_fragments never returns (a plugin stuck
                   after loading weights, while its peer goes on)
FDTEST_CLEANUP_RAISES   "1": fd_clean_memory_fragments raises on every rank
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from fd_core import hookimpl

_calls = 0
_ENDPOINT_VARS = ("PADDLE_TRAINER_ENDPOINTS", "PADDLE_CURRENT_ENDPOINT", "PADDLE_MASTER", "MASTER_ADDR", "MASTER_PORT")


def _rank() -> int:
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def _listening() -> list[str]:
    """"address:port" of every TCP socket this process listens on (from /proc, no psutil)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/self/net/tcp", 8), ("/proc/self/net/tcp6", 32)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            if width == 8:
                host = ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                host = "::" if set(address) == {"0"} else address
            found.append(f"{host}:{int(port, 16)}")
    return sorted(found)


def _probe() -> None:
    directory = os.environ["FDTEST_PROBE_DIR"]
    record = {
        "rank": _rank(),
        "pid": os.getpid(),
        "calls": _calls,
        "env": {name: os.environ.get(name) for name in _ENDPOINT_VARS},
        "listening": _listening(),
    }
    path = os.path.join(directory, f"rank{_rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


@hookimpl(wrapper=True)
def fd_all_reduce(tensor: Any, group: Any) -> Any:
    """Count this rank's all-reduce calls; probe or fail at the configured call."""
    global _calls
    _calls += 1
    if "FDTEST_PROBE_DIR" in os.environ and _calls == int(os.environ.get("FDTEST_PROBE_AT", "1")):
        _probe()
    fail_rank = os.environ.get("FDTEST_FAIL_RANK")
    if fail_rank is not None and int(fail_rank) == _rank() and _calls > int(os.environ.get("FDTEST_FAIL_AFTER", "0")):
        if "FDTEST_PROBE_DIR" in os.environ:
            with open(os.path.join(os.environ["FDTEST_PROBE_DIR"], f"rank{_rank()}.failing"), "w") as f:
                f.write(repr(time.time()))
        if os.environ.get("FDTEST_FAIL_HOW", "raise") == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"failprobe: injected failure on rank {_rank()} at all-reduce call {_calls}")
    return (yield)


@hookimpl
def fd_clean_memory_fragments(state_dict: Any) -> None:
    """Hang on FDTEST_HANG_CLEANUP_RANK, or raise when FDTEST_CLEANUP_RAISES is set; otherwise nothing."""
    import threading

    if os.environ.get("FDTEST_CLEANUP_RAISES") == "1":
        raise ValueError("failprobe: cleanup cannot free this state")
    hang = os.environ.get("FDTEST_HANG_CLEANUP_RANK")
    if hang is not None and int(hang) == _rank():
        threading.Event().wait()
