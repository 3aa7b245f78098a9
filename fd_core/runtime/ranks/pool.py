"""Ranks kept up for a session at tp > 1: spawned with `spawn_ranks`' failure handling, each serving one engine
step per tick over its pipe, and weight reloads and reports when asked."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Literal, Sequence

from fd_core.error_lines import add_hint
from fd_core.errors import RankError, setting
from fd_core.host.failure_hints import dtype_hint
from fd_core.runtime import progress
from fd_core.runtime.engine.loop import FINGERPRINT_EVERY, fingerprints_agree
from fd_core.runtime.ranks.spawn import DEFAULT_STALL_S, init_rank, spawn_ranks
from fd_core.runtime.ranks.worker import RankWorker, end_reason

if TYPE_CHECKING:
    from fd_core.runtime.engine.loop import Event, Job
    from fd_core.runtime.plan import Plan

POLL_S = 0.2


def _shown(printed: tuple[int, float, float] | None) -> str:
    """A rank's fingerprint as a message shows it."""
    return "none" if printed is None else f"({printed[1]:.6g}, {printed[2]:.6g})"


def serve_rank(plan: "Plan", pipes: Sequence[Any]) -> dict[str, Any]:
    """A spawned rank: join the group, load, report ready, then serve the session's messages until told to close.

    A tick carries the jobs added and the keys cancelled since the last, the same to every rank, so
    every rank's engine admits, decodes and finishes the same sequences at the same step; rank 0
    answers with every event, the others with the tokens of what finished (compared with rank 0's).
    A reload is a weight update on every rank; a report is each rank's timings and memory.
    """
    started: list[Any] = []  # (backend, context) once the platform started the rank
    _end_on_sigterm(started)
    progress.report("rendezvous")
    at = time.time()
    rank, world = init_rank()
    conn = pipes[rank]
    worker = RankWorker.start(plan, rank, world, before={"at": at, "rendezvous": time.time() - at},
                              on_started=lambda backend, context: started.append((backend, context)))
    try:
        result = _serve(worker, rank, conn)
    except BaseException as exc:
        worker.end(end_reason(exc))
        raise
    worker.end("normal")
    return result


def _end_on_sigterm(started: list[Any]) -> None:
    """The parent's SIGTERM stops this rank at once, as the signal's default would, even inside a collective that
    holds the main thread in C++ (where no Python signal handler runs): a thread woken through the signal's wakeup fd
    calls the started plugins' fd_rank_end with "signal" (each bounded), then ends the process with the signal's
    exit code."""
    import threading

    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a Python handler, so the wakeup fd is written
    signal.set_wakeup_fd(write)

    def watch() -> None:
        while os.read(read, 1) != bytes([signal.SIGTERM]):
            pass
        for backend, context in started[-1:]:
            backend.rank_end(context, "signal")
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="fd-rank-sigterm", daemon=True).start()


def _serve(worker: RankWorker, rank: int, conn: Any) -> dict[str, Any]:
    """serve_rank's loop: the session's messages until it says close (or goes away)."""
    engine = worker.engine
    # The session compares what every rank's all-reduces returned every few steps (a launcher's ranks compare
    # nothing, so they pay nothing).
    engine.fingerprint_every = FINGERPRINT_EVERY
    conn.send(("ready", {**worker.describe(), "pid": os.getpid()}))
    while True:
        try:
            # Between requests a rank is idle, not stuck: it keeps noting progress, or the parent's stall watch would
            # stop it.
            while not conn.poll(1.0):
                progress.report("waiting for a request")
            message = conn.recv()
        except EOFError:  # the caller went away without closing
            return worker.describe()
        kind = message[0]
        if kind == "close":
            return worker.describe()
        if kind == "reload":
            worker.reload()
            conn.send(("reloaded",))
            continue
        if kind == "report":
            conn.send(("report", worker.report()))
            continue
        for job in message[1]:
            engine.add(job)
        for key in message[2]:
            engine.cancel(key)
        events = step(worker)
        # Every few steps, what the step's all-reduces returned, summed: compared by the caller across ranks.
        printed, engine.fingerprint = engine.fingerprint, None
        if rank == 0:
            # What the caller reads back (timings) when a sequence ended; not every step.
            info = worker.describe() if any(e.done is not None for e in events) else None
            conn.send(("events", events, info, printed))
        else:
            conn.send(("events", [(e.key, e.done.token_ids) for e in events if e.done is not None], None, printed))


def step(worker: RankWorker) -> list["Event"]:
    """One engine step of `worker`; a failure whose Paddle message is about a dtype carries its likely cause (the
    kernel or the platform's claim, and the fix) into its one line. Read only once it failed: a step pays nothing."""
    try:
        return worker.engine.step()
    except Exception as exc:
        hint = None
        with contextlib.suppress(Exception):  # a hint that fails must not hide the failure it explains
            hint = dtype_hint(exc, worker.backend, worker.plan.config.dtype)
        if hint is not None:
            add_hint(exc, hint)
        raise


class RankPool:
    """`tp` ranks serving one session; a rank that fails stops the others and the next call raises its RankError.

    `start_method` "fork" starts the ranks with this process's imports done (seconds saved); only for a
    caller that has run no paddle op and started no thread pool, as `spawn_ranks` says.
    """

    def __init__(
        self, plan: "Plan", tp: int, grace: float, stall: float = DEFAULT_STALL_S,
        start_method: Literal["spawn", "fork"] = "spawn",
    ) -> None:
        context = multiprocessing.get_context(start_method)
        pairs = [context.Pipe() for _ in range(tp)]
        self.conns = [ours for ours, _ in pairs]
        theirs = tuple(end for _, end in pairs)
        self.error: BaseException | None = None
        self.aborted = False
        self.platform = plan.platform
        self.dtype = plan.config.dtype
        # Set by abort(): the spawning thread stops every rank, even before they are ready
        self.stop = threading.Event()
        self.pids: list[int] = []
        self.thread = threading.Thread(target=self._spawn, args=(plan, theirs, tp, grace, stall, start_method),
                                       name="fd-ranks", daemon=True)
        self.thread.start()
        try:
            self.ready = [self._receive(rank, "ready") for rank in range(tp)]
        except BaseException:
            self.abort()
            raise
        finally:
            for end in theirs:
                end.close()
        self.pids = [info[1]["pid"] for info in self.ready]
        self.info: dict[str, Any] = self.ready[0][1]

    def _spawn(
        self, plan: "Plan", pipes: tuple[Any, ...], tp: int, grace: float, stall: float, start_method: Any
    ) -> None:
        try:
            spawn_ranks(serve_rank, (plan, pipes), tp, plan.dist_backend, grace=grace, stall=stall,
                        start_method=start_method, stall_hint=f"raise {setting('stall_timeout')} if it is only slow",
                        platform=plan.platform, stop=self.stop)
        except BaseException as exc:  # re-raised in the caller's thread by its next call
            self.error = exc

    def _receive(self, rank: int, *kinds: str) -> tuple[Any, ...]:
        """The next message from `rank`; the ranks' failure (a RankError naming the first) if they ended."""
        conn = self.conns[rank]
        while True:
            if conn.poll(POLL_S):
                try:
                    message = conn.recv()
                except EOFError:
                    break
                if message[0] in kinds:
                    return message
                raise RankError(f"rank {rank} sent {message[0]!r} where {' or '.join(kinds)} was expected")
            if not self.thread.is_alive() and not conn.poll(0):
                break
        self.thread.join()
        if isinstance(self.error, RankError):
            raise RankError(str(self.error)) from None
        if self.error is not None:
            raise self.error
        raise RankError(f"rank {rank} ended without answering")

    def _each(self, message: tuple[Any, ...], answer: str) -> list[tuple[Any, ...]]:
        """`message` to every rank; every rank's answer, in rank order (a broken pipe is the ranks' failure)."""
        try:
            for conn in self.conns:
                conn.send(message)
            return [self._receive(rank, answer) for rank in range(len(self.conns))]
        except (OSError, EOFError) as exc:
            if self.aborted:  # the pipes were closed under this call by abort()
                raise RankError("the ranks were stopped (the session was aborted) before this call finished") from None
            raise RankError(f"the pipe to the ranks failed: {exc}") from None

    def tick(self, adds: Sequence["Job"], cancels: Sequence[int]) -> list["Event"]:
        """One engine step on every rank for the jobs added and keys cancelled since the last; rank 0's events."""
        answers = self._each(("tick", list(adds), list(cancels)), "events")
        events, info, printed = answers[0][1:]
        ended = {e.key: e.done.token_ids for e in events if e.done is not None}
        for rank, answer in enumerate(answers[1:], 1):
            if dict(answer[1]) != ended:
                raise RankError(
                    f"rank {rank} generated different tokens than rank 0 (or ended other sequences); the ranks disagree"
                )
            theirs = answer[3]
            if (printed is None) != (theirs is None) or (
                printed is not None and theirs is not None and not fingerprints_agree(printed, theirs, self.dtype)
            ):
                at = printed[0] if printed else theirs[0] if theirs else "?"
                raise RankError(
                    f"rank {rank}'s all-reduce results at step {at} "
                    f"differ from rank 0's (sum and absolute sum {_shown(theirs)} against {_shown(printed)}), though "
                    f"the tokens agree: an all-reduce must return the same tensor on every rank; run fd check "
                    f"{self.platform} (its all-reduce checks)"
                )
        if info is not None:
            self.info = info
        return list(events)

    def reload(self) -> None:
        """A weight update on every rank (graphs cleared, weights released, loaded again)."""
        self._each(("reload",), "reloaded")

    def reports(self) -> list[dict[str, Any]]:
        """Every rank's timings, speed and memory, in rank order."""
        reports = [answer[1] for answer in self._each(("report",), "report")]
        self.info = {k: v for k, v in reports[0].items() if k in self.info}
        return reports

    def close(self) -> None:
        """Ask every rank to finish and wait for them."""
        for conn in self.conns:
            try:
                conn.send(("close",))
            except OSError:
                pass
        self.thread.join()

    def abort(self) -> None:
        """Stop every rank now (after an error, Ctrl-C or a stop signal in the caller): SIGTERM, then spawn's own
        cleanup."""
        self.aborted = True
        self.stop.set()
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for conn in self.conns:
            conn.close()
        self.thread.join()
