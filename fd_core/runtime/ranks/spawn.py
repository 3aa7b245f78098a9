"""Rank processes: local spawn through paddle.distributed, failure propagation, and launcher glue."""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import logging
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Sequence

from fd_core.error_lines import error_line, informative_line
from fd_core.errors import ConfigError, FdError, PlatformError, RankError, setting
from fd_core.host.output import plugin_prints_to_stderr
from fd_core.host.paddle_logs import quiet_paddle_logs
from fd_core.runtime import progress
from fd_core.runtime.ranks import rendezvous
from fd_core.runtime.ranks.rendezvous import LOOPBACK, LoopbackStore


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by `paddle.distributed.launch` or spawn."""
    rank, world = os.environ.get("PADDLE_TRAINER_ID"), os.environ.get("PADDLE_TRAINERS_NUM")
    if rank is None or world is None:
        return None
    try:
        parsed = int(rank), int(world)
    except ValueError:
        raise ConfigError(
            f"PADDLE_TRAINER_ID={rank!r}, PADDLE_TRAINERS_NUM={world!r}: not rank numbers; "
            f"unset them, or start fd with python -m paddle.distributed.launch"
        ) from None
    if not 0 <= parsed[0] < parsed[1]:
        raise ConfigError(
            f"PADDLE_TRAINER_ID={rank} is outside 0..{parsed[1] - 1} (PADDLE_TRAINERS_NUM={world}); "
            f"check the launcher's environment"
        )
    return parsed


def init_rank() -> tuple[int, int]:
    """Join the process group of a spawned or launched rank; returns (rank, world size)."""
    import paddle.distributed as dist

    launched = launched_rank()
    if launched is not None:
        # A rank spawn_ranks started joins the loopback store its parent serves (Paddle's own would listen on
        # every interface); under a launcher, rank 0 serves it on the master address the user gave.
        if not os.environ.get(rendezvous.STORE_ENV):
            rendezvous.serve_launched_store(launched[0])
        rendezvous.join_store(launched[1])
    # init_parallel_env prints a table of modified flags to stderr on every rank.
    with contextlib.redirect_stderr(io.StringIO()):
        dist.init_parallel_env()
    return dist.get_rank(), dist.get_world_size()


# The signals that stop a run as SIGTERM does: a closed terminal's SIGHUP and SIGQUIT too. Each
# exits 128 + its number, as a shell reports a process it ended (143, 129, 131).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP, SIGQUIT) reached `fd run` while its ranks ran; they have been stopped.

    A KeyboardInterrupt, so that whatever treats Ctrl-C as "stop everything" (pytest under
    `fd check`, for one) treats SIGTERM the same; `sigterm_received` tells the two apart.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """128 + the signal's number (143 for SIGTERM, 129 for SIGHUP, 131 for SIGQUIT)."""
        return 128 + self.signum

    def message(self) -> str:
        """The line `fd` prints once every rank has been stopped."""
        by = "" if self.signum == signal.SIGTERM else f" by {signal.Signals(self.signum).name}"
        return f"fd: terminated{by}; every rank was stopped"


sigterm_received = False
# The stop signal received (one of STOP_SIGNALS), or None.
stop_signal: int | None = None


# How often the watch over running ranks wakes when nothing happens (to check progress notes and a stop request).
WATCH_S = 0.25
# After the first rank fails, how long to let the failures it causes land before naming a culprit.
SETTLE_S = 0.5
# How long a rank may sit stopped (SIGSTOP, a debugger) before the run ends: its peers cannot go on.
STOPPED_S = 3.0
# How long a rank may go without noting progress before the run ends (`fd run --stall-timeout`).
DEFAULT_STALL_S = 60.0
# What a stalled rank's error tells `fd run`'s user; other callers pass their own.
STALL_HINT = "raise --stall-timeout if it is only slow"
_PR_SET_PDEATHSIG = 1


@dataclass
class RankFailure:
    rank: int
    message: str
    # Ranks killed by a signal sort first (a peer's failure reaches a rank as an error, never as a
    # signal), then by the time the rank recorded its error.
    order: tuple[int, float] = (1, float("inf"))
    # The rank's full traceback, kept after the run (the message is its last line).
    traceback: str | None = None


def _last_line(trace: str) -> str:
    """The exception a traceback ends with, as one line (a multi-line message's informative line)."""
    start = trace.rfind("Traceback (most recent call last):")  # the last of chained exceptions
    lines = [line.strip() for line in trace.splitlines() if line.strip()]
    last = informative_line(trace[start:]) if start >= 0 else lines[-1] if lines else None
    if last is None:
        return "failed without a message"
    # "fd_core.errors.CheckpointError: ..." -> "CheckpointError: ..."
    head, sep, tail = last.partition(": ")
    return f"{head.rsplit('.', 1)[-1]}{sep}{tail}"


def _failure(context: Any, out_dir: str, index: int) -> RankFailure:
    code = context.processes[index].exitcode
    if code is not None and code < 0:
        return RankFailure(index, f"killed by {signal.Signals(-code).name}", (0, 0.0))
    record = os.path.join(out_dir, f"rank{index}.failed")
    if os.path.exists(record):
        with open(record) as f:
            data = json.load(f)
        return RankFailure(index, data["message"], (1, data["time"]), data.get("traceback"))
    queue = context.error_queues[index]
    if not queue.empty():
        return RankFailure(index, _last_line(queue.get()))
    return RankFailure(index, f"exited with code {code}")


def _describe(failures: list[RankFailure]) -> str:
    """One line: the rank that failed first, then any peer that failed after it."""
    first, *then = sorted(failures, key=lambda f: f.order)
    line = f"rank {first.rank} failed: {first.message}"
    if then:
        # A bad checkpoint or config fails every rank alike: say so instead of repeating it.
        notes = [
            f"rank {f.rank} failed the same way" if f.message == first.message
            else f"then rank {f.rank}: {_shorten(f.message)}"
            for f in then
        ]
        line += f" ({'; '.join(notes)})"
    if first.traceback:
        line += f"; its traceback is in {first.traceback}"
    return line


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stop_all(processes: Sequence[Any], grace: float) -> None:
    """SIGTERM every live rank, wait up to `grace` seconds, then SIGKILL what is left."""
    for p in processes:
        if p.is_alive():
            p.terminate()
            # A stopped rank would hold SIGTERM until continued: continue it so that it can end.
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5)


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this rank when `fd run` dies, even by SIGKILL (Linux; elsewhere a no-op).

    The kernel ties this to the thread that spawned the rank; spawn_ranks waits in that thread
    until every rank has ended."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _call_and_save(fn: Callable[..., Any], out_dir: str, errors_dir: str, parent: int, store: str, *args: Any) -> None:
    """Run `fn` on a spawned rank and leave its result in a file: a large result through the return
    queue's pipe would block the rank's exit while the parent waits for that exit."""
    _die_with_parent(parent)
    # The parent coordinates every stop: a terminal's Ctrl-C reaches it (and it stops the ranks),
    # and its SIGTERM ends a rank at once, without the crash report Paddle's handler would print.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # A closed terminal's SIGHUP and Ctrl-\'s SIGQUIT reach the whole job: the parent stops the ranks for them too.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    rank = os.environ.get("PADDLE_TRAINER_ID", "0")
    if "paddle" in sys.modules:
        import paddle

        # Paddle keeps its graph mode per thread, and a rank forked from a thread other than the main one starts
        # without it (in static mode): every rank computes eagerly unless it captures.
        paddle.disable_static()
    os.environ[rendezvous.STORE_ENV] = store
    os.environ[progress.PROGRESS_ENV] = os.path.join(out_dir, f"rank{rank}.progress")
    progress.report("starting")
    try:
        # A rank's stdout is its parent's: what plugins print there must not mix with fd's output (see
        # plugin_prints_to_stderr).
        with plugin_prints_to_stderr():
            result = fn(*args)
    except Exception as exc:
        # When and why, so the parent can tell the rank that failed first from the peers it took down;
        # the whole traceback goes to a file that outlives the run, for whoever must fix the cause.
        trace = os.path.join(errors_dir, f"rank{rank}.traceback")
        if not isinstance(exc, FdError):  # an FdError's message is the whole story; anything else is a bug to chase
            with contextlib.suppress(OSError):
                with open(trace, "w") as f:
                    f.write(traceback.format_exc())
        record = os.path.join(out_dir, f"rank{rank}.failed")
        message = error_line(exc)  # the informative line of a multi-line message (Paddle's), and fd's hint
        with contextlib.suppress(OSError):  # without it the parent falls back to Paddle's error queue
            with open(record + ".tmp", "w") as f:
                json.dump(
                    {"time": time.time(), "message": message, "traceback": trace if os.path.exists(trace) else None}, f
                )
            os.replace(record + ".tmp", record)
        raise
    path = os.path.join(out_dir, f"rank{rank}.pickle")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)


def note_stop_signal(signum: int) -> Terminated:
    """Note that a stop signal (one of STOP_SIGNALS) was received; the Terminated to raise for it."""
    global sigterm_received, stop_signal
    sigterm_received, stop_signal = True, signum
    return Terminated(signum)


def raise_terminated(signum: int, frame: Any) -> None:
    """A handler of STOP_SIGNALS: note the signal and raise Terminated in the main thread."""
    raise note_stop_signal(signum)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Turn SIGTERM, SIGHUP and SIGQUIT into `Terminated` in the main thread while ranks run, so they are stopped
    (and the run's temporary directories removed) rather than orphaned; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    previous = {sig: signal.signal(sig, raise_terminated) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            # None: a handler installed from C (Paddle's), which Python cannot reinstate; the default is the nearest.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """Paddle gives the root logger an INFO handler at import; spawn would log its port choice there."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        root.setLevel(level)


def spawn_ranks(
    fn: Callable[..., Any], args: Sequence[Any], nprocs: int, dist_backend: str, grace: float = 10.0,
    stall: float = DEFAULT_STALL_S,
    start_method: Literal["spawn", "fork", "forkserver"] = "spawn",
    stall_hint: str = STALL_HINT,
    platform: str | None = None,
    stop: threading.Event | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `nprocs` local ranks; return each rank's result in rank order.

    `start_method` "fork" starts the ranks with this process's imports done; only for a caller
    that has run no paddle op and started no thread pool (a fork copies one thread of them).

    When a rank fails, the others are stopped at once (they would otherwise wait in a collective
    until its timeout) and RankError names the rank that failed first, with the path of its full
    traceback. A rank that sits stopped (SIGSTOP) for STOPPED_S seconds, or notes no progress
    (`fd_core.runtime.progress.report`) for `stall` seconds, ends the run the same way. Ctrl-C
    (KeyboardInterrupt) and SIGTERM (Terminated) stop every rank before they propagate; a rank also
    dies with this process if it is killed outright. `stall_hint` ends a stalled rank's error: how the
    caller's user gives a slow rank more time. `platform` names the plugin whose detection gave `dist_backend`.
    `stop`, once set (from another thread), stops every rank as Ctrl-C would and raises KeyboardInterrupt.
    """
    import paddle.distributed as dist

    quiet_paddle_logs()
    problem = dist_backend_problem(dist_backend)
    if problem is not None:
        who = f"platform {platform!r}" if platform else "the platform"
        raise PlatformError(
            f"{who}: fd_platform_detect returned a Detection with dist_backend={dist_backend!r}: {problem}; "
            f"fix the platform plugin"
        )
    stray = os.environ.get("PADDLE_TRAINERS_NUM")
    if stray is not None and launched_rank() is None:
        # Left over from a launcher's environment: paddle.distributed.spawn would assert on it.
        raise ConfigError(
            f"PADDLE_TRAINERS_NUM={stray} is set, but this process was not started by paddle.distributed.launch "
            f"(PADDLE_TRAINER_ID is unset); unset PADDLE_TRAINERS_NUM to spawn the ranks here"
        )
    remove_stale_dirs()
    # The handlers first: a stop signal from here on removes the directories below on its way out.
    with stop_signals_raise():
        errors_dir = tempfile.mkdtemp(prefix=f"{ERRORS_PREFIX}{os.getpid()}-")
        try:
            with (
                tempfile.TemporaryDirectory(prefix=f"{RANKS_PREFIX}{os.getpid()}-") as out_dir,
                LoopbackStore() as store,
            ):
                with _quiet_root_logger(), _naming_shared_memory():
                    context = dist.spawn(
                        # paddle's typed options omit `backend`, which spawn reads at run time.
                        _call_and_save, args=(fn, out_dir, errors_dir, os.getpid(), store.address, *args),
                        nprocs=nprocs, join=False,
                        backend=dist_backend, ips=LOOPBACK, start_method=start_method,  # type: ignore[call-arg]
                    )
                _watch(context, out_dir, grace, stall, stall_hint, stop)
                return _results(out_dir, nprocs)
        finally:
            # Tracebacks of failed ranks outlive the run (the error line names them); nothing else does.
            if not os.listdir(errors_dir):
                shutil.rmtree(errors_dir, ignore_errors=True)


SHM_DIR = "/dev/shm"


def shared_memory_problem(path: str = SHM_DIR) -> str | None:
    """What keeps processes from sharing memory through `path` (read-only, full), or None."""
    if not os.path.isdir(path):
        return None
    if not os.access(path, os.W_OK):
        return f"{path} is not writable"
    try:
        info = os.statvfs(path)
    except OSError:
        return None
    if info.f_bavail * info.f_frsize < 1 << 20:
        return f"{path} is full ({info.f_bavail * info.f_frsize} bytes free)"
    return None


@contextlib.contextmanager
def _naming_shared_memory() -> Iterator[None]:
    """An OSError without a path while starting ranks (multiprocessing's locks live in /dev/shm) as one line naming
    it."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        problem = shared_memory_problem()
        if problem is None:
            raise RankError(f"starting the ranks failed: {exc.strerror or exc}") from None
        raise RankError(
            f"starting the ranks failed: {exc.strerror or exc}: {problem}; the ranks' locks and shared memory live "
            f"there: make it writable with free space (docker run --shm-size), or run with {setting('tp', 1)}"
        ) from None


# A run's temporary directories in $TMPDIR, named with the pid of the process that spawned the ranks.
RANKS_PREFIX = "fd-ranks-"
ERRORS_PREFIX = "fd-rank-errors-"
# A dead process's directory untouched this long is left over. The wait is for a run in another pid
# namespace sharing $TMPDIR, whose pid looks dead from here: its ranks note progress every second or so.
STALE_S = 30.0


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def remove_stale_dirs(root: str | None = None) -> list[str]:
    """Remove what runs killed outright (SIGKILL: no code of theirs ran) left in `root` ($TMPDIR): a dead
    process's rank directories, and its error directories if empty (a traceback outlives its run).
    Returns the paths removed."""
    root = tempfile.gettempdir() if root is None else root
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        prefix = next((p for p in (RANKS_PREFIX, ERRORS_PREFIX) if entry.name.startswith(p)), None)
        if prefix is None:
            continue
        pid = entry.name[len(prefix):].split("-", 1)[0]
        try:
            info = entry.stat(follow_symlinks=False)
            if not (pid.isdigit() and entry.is_dir(follow_symlinks=False) and info.st_uid == os.getuid()):
                continue
        except OSError:
            continue
        if _alive(int(pid)) or now - info.st_mtime < STALE_S:
            continue
        if prefix == RANKS_PREFIX:
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            try:
                os.rmdir(entry.path)  # only when empty
            except OSError:
                continue
        if not os.path.exists(entry.path):
            removed.append(entry.path)
    return removed


def dist_backend_problem(name: Any) -> str | None:
    """What paddle.distributed says is wrong with `name` as a rank backend (unknown, or not in this build), or None."""
    if not isinstance(name, str) or not name.strip():
        return "not a backend name"
    # paddle.distributed.spawn validates its backend option with this function; asking it first turns
    # a bad Detection into one line naming the field, instead of a traceback from inside spawn.
    from paddle.distributed.fleet.launch_utils import check_backend

    try:
        check_backend(name)
    except ValueError as exc:
        return str(exc).replace("paddle.distributed initialize error, ", "")
    return None


def run_here(fn: Callable[..., Any], *args: Any) -> Any:
    """Run one rank's work in this process (tp=1), failing as a spawned rank would: an FdError as it
    is, anything else as one RankError line naming the exception, with its traceback kept in a file."""
    try:
        return fn(*args)
    except (FdError, KeyboardInterrupt):
        raise
    except Exception as exc:
        errors_dir = tempfile.mkdtemp(prefix=f"{ERRORS_PREFIX}{os.getpid()}-")
        trace = os.path.join(errors_dir, "rank0.traceback")
        with open(trace, "w") as f:
            f.write(traceback.format_exc())
        message = error_line(exc)  # the informative line of a multi-line message (Paddle's), and fd's hint
        raise RankError(f"rank 0 failed: {message}; its traceback is in {trace}") from None


def _results(out_dir: str, nprocs: int) -> list[Any]:
    results = []
    for rank in range(nprocs):
        try:
            with open(os.path.join(out_dir, f"rank{rank}.pickle"), "rb") as f:
                results.append(pickle.load(f))
        except FileNotFoundError:
            raise RankError(
                f"rank {rank} exited without a result (exit code 0); was it stopped from outside?"
            ) from None
    return results


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of a process ("T" stopped, "t" traced, ...), "" if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


class _Monitor:
    """Tells a stopped rank (SIGSTOP, a debugger) and a rank that has stopped noting progress."""

    def __init__(self, processes: Sequence[Any], out_dir: str, stall: float, stall_hint: str = STALL_HINT) -> None:
        self.processes, self.out_dir, self.stall, self.stall_hint = processes, out_dir, stall, stall_hint
        self.started = time.time()
        self.stopped_since: dict[int, float] = {}

    def check(self, live: Sequence[int]) -> RankFailure | None:
        now = time.time()
        for index in live:
            if _process_state(self.processes[index].pid) in ("T", "t"):
                since = self.stopped_since.setdefault(index, now)
                if now - since >= STOPPED_S:
                    return RankFailure(
                        index,
                        f"stopped (SIGSTOP or a debugger) for {now - since:.0f} s; its peers cannot go on without it",
                        (0, since),
                    )
            else:
                self.stopped_since.pop(index, None)
        notes = {i: progress.read(os.path.join(self.out_dir, f"rank{i}.progress")) for i in live}
        quiet = [(note[0] if note else self.started, i) for i, note in notes.items()]
        if quiet:
            last, index = min(quiet)
            if now - last > self.stall:
                note = notes[index]
                phase = note[1] if note else "starting"
                return RankFailure(
                    index, f"made no progress for {now - last:.0f} s (last phase: {phase}); {self.stall_hint}",
                    (0, last),
                )
        return None


def _watch(
    context: Any, out_dir: str, grace: float, stall: float = DEFAULT_STALL_S, stall_hint: str = STALL_HINT,
    stop: threading.Event | None = None,
) -> None:
    """Wait for every rank; on a failure (or a stopped or stuck rank) stop the rest and raise RankError naming it."""
    processes = list(context.processes)
    pending = {p.sentinel: i for i, p in enumerate(processes)}
    monitor = _Monitor(processes, out_dir, stall, stall_hint)

    def reap(ready: list[Any]) -> list[int]:
        failed = []
        for sentinel in ready:
            index = pending.pop(sentinel)
            processes[index].join()
            if processes[index].exitcode != 0:
                failed.append(index)
        return failed

    try:
        while pending:
            failed = reap(multiprocessing.connection.wait(list(pending), timeout=WATCH_S))
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            if not failed:
                stuck = monitor.check(list(pending.values()))
                if stuck is not None:
                    _stop_all(processes, grace)
                    raise RankError(_describe([stuck]) + "; every rank was stopped")
                continue
            # A dead rank makes its peers fail in their next collective; let those failures land
            # (briefly), so that the rank named is the one that failed first, not a bystander.
            deadline = time.monotonic() + SETTLE_S
            while pending and time.monotonic() < deadline:
                failed += reap(
                    multiprocessing.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
                )
            failures = [_failure(context, out_dir, i) for i in failed]
            _stop_all(processes, grace)
            raise RankError(_describe(failures))
    except (KeyboardInterrupt, Terminated):
        _stop_all(processes, grace)
        raise
