"""Rank processes: local spawn through paddle.distributed, failure propagation, and launcher glue."""

from __future__ import annotations

import contextlib
import io
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from fd_core.errors import RankError

LOOPBACK = "127.0.0.1"


def quiet_paddle_logs() -> None:
    """Keep paddle's C++ info logs and import-time warnings off a user's terminal (user settings win)."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ.setdefault("GLOG_v", "0")
    # Spawned ranks import paddle before any code of ours runs: filter through the environment.
    quiet = "ignore:No ccache found"
    current = os.environ.get("PYTHONWARNINGS", "")
    if quiet not in current:
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [current, quiet]))
    warnings.filterwarnings("ignore", message="No ccache found")
    warnings.filterwarnings("ignore", message=".*CPUONLY mode.*")


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by `paddle.distributed.launch` or spawn."""
    rank, world = os.environ.get("PADDLE_TRAINER_ID"), os.environ.get("PADDLE_TRAINERS_NUM")
    if rank is None or world is None:
        return None
    return int(rank), int(world)


def init_rank() -> tuple[int, int]:
    """Join the process group of a spawned or launched rank; returns (rank, world size)."""
    import paddle.distributed as dist

    # init_parallel_env prints a table of modified flags to stderr on every rank.
    with contextlib.redirect_stderr(io.StringIO()):
        dist.init_parallel_env()
    return dist.get_rank(), dist.get_world_size()


@dataclass
class RankFailure:
    rank: int
    message: str


def _last_line(trace: str) -> str:
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    if not lines:
        return "failed without a message"
    last = lines[-1].strip()
    # "fd_core.errors.CheckpointError: ..." -> "CheckpointError: ..."
    head, sep, tail = last.partition(": ")
    return f"{head.rsplit('.', 1)[-1]}{sep}{tail}"


def _failure(context: Any, index: int) -> RankFailure:
    queue = context.error_queues[index]
    if not queue.empty():
        return RankFailure(index, _last_line(queue.get()))
    code = context.processes[index].exitcode
    if code is not None and code < 0:
        return RankFailure(index, f"killed by {signal.Signals(-code).name}")
    return RankFailure(index, f"exited with code {code}")


def _stop_all(processes: Sequence[Any], grace: float) -> None:
    """SIGTERM every live rank, wait up to `grace` seconds, then SIGKILL what is left."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5)


def _call_and_save(fn: Callable[..., Any], out_dir: str, *args: Any) -> None:
    """Run `fn` on a spawned rank and leave its result in a file: a large result through the return
    queue's pipe would block the rank's exit while the parent waits for that exit."""
    result = fn(*args)
    path = os.path.join(out_dir, f"rank{os.environ.get('PADDLE_TRAINER_ID', '0')}.pickle")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)


def spawn_ranks(
    fn: Callable[..., Any], args: Sequence[Any], nprocs: int, dist_backend: str, grace: float = 10.0
) -> list[Any]:
    """Run `fn(*args)` on `nprocs` local ranks; return each rank's result in rank order.

    When a rank fails, the others are stopped at once (they would otherwise wait in a collective
    until its timeout) and RankError names the first rank that failed.
    """
    import paddle.distributed as dist

    quiet_paddle_logs()
    with tempfile.TemporaryDirectory(prefix="fd-ranks-") as out_dir:
        context = dist.spawn(_call_and_save, args=(fn, out_dir, *args), nprocs=nprocs, join=False, backend=dist_backend, ips=LOOPBACK)
        _watch(context, grace)
        results = []
        for rank in range(nprocs):
            with open(os.path.join(out_dir, f"rank{rank}.pickle"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _watch(context: Any, grace: float) -> None:
    """Wait for every rank; on the first failure stop the rest and raise RankError naming it."""
    processes = list(context.processes)
    pending = {p.sentinel: i for i, p in enumerate(processes)}
    try:
        while pending:
            for sentinel in multiprocessing.connection.wait(list(pending), timeout=1.0):
                index = pending.pop(sentinel)
                processes[index].join()
                if processes[index].exitcode != 0:
                    failure = _failure(context, index)
                    _stop_all(processes, grace)
                    raise RankError(f"rank {failure.rank} failed: {failure.message}")
    except KeyboardInterrupt:
        _stop_all(processes, grace)
        raise
