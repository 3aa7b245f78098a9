"""Ranks that stay up between requests (the Python API at tp > 1): spawned as `fd run` spawns them, with
its failure handling, and served requests over one pipe each."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from typing import TYPE_CHECKING, Any, Sequence

from fd_core.errors import RankError
from fd_core.host.paddle_logs import quiet_paddle_logs
from fd_core.runtime import progress
from fd_core.runtime.ranks.spawn import DEFAULT_STALL_S, init_rank, spawn_ranks
from fd_core.runtime.ranks.worker import RankWorker

if TYPE_CHECKING:
    from fd_core.runtime.engine.loop import Event, Job
    from fd_core.runtime.plan import Plan

POLL_S = 0.2


def serve_rank(plan: "Plan", pipes: Sequence[Any]) -> dict[str, Any]:
    """A spawned rank: load, report ready, then one engine step per tick until told to close.

    A tick carries the jobs added and the keys cancelled since the last, the same to every rank, so
    every rank's engine admits, decodes and finishes the same sequences at the same step; rank 0
    answers with every event, the others with the tokens of what finished (compared with rank 0's).
    """
    quiet_paddle_logs()
    rank, world = init_rank()
    conn = pipes[rank]
    worker = RankWorker.start(plan, rank, world)
    engine = worker.engine
    conn.send(("ready", {**worker.describe(), "pid": os.getpid()}))
    while True:
        try:
            # Between requests a rank is idle, not stuck: it keeps noting progress, or the parent's stall watch would stop it.
            while not conn.poll(1.0):
                progress.report("waiting for a request")
            message = conn.recv()
        except EOFError:  # the caller went away without closing
            return worker.describe()
        if message[0] == "close":
            return worker.describe()
        for job in message[1]:
            engine.add(job)
        for key in message[2]:
            engine.cancel(key)
        events = engine.step()
        if rank == 0:
            # What the caller reads back (timings) when a sequence ended; not every step.
            info = worker.describe() if any(e.done is not None for e in events) else None
            conn.send(("events", events, info))
        else:
            conn.send(("events", [(e.key, e.done.token_ids) for e in events if e.done is not None], None))


class RankPool:
    """`tp` ranks serving requests; a rank that fails stops the others and the next call raises its RankError."""

    def __init__(self, plan: "Plan", tp: int, grace: float, stall: float = DEFAULT_STALL_S) -> None:
        context = multiprocessing.get_context("spawn")
        pairs = [context.Pipe() for _ in range(tp)]
        self.conns = [ours for ours, _ in pairs]
        theirs = tuple(end for _, end in pairs)
        self.error: BaseException | None = None
        self.aborted = False
        self.pids: list[int] = []
        self.thread = threading.Thread(target=self._spawn, args=(plan, theirs, tp, grace, stall), name="fd-ranks", daemon=True)
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

    def _spawn(self, plan: "Plan", pipes: tuple[Any, ...], tp: int, grace: float, stall: float) -> None:
        try:
            spawn_ranks(serve_rank, (plan, pipes), tp, plan.dist_backend, grace=grace, stall=stall,
                        stall_hint="raise LLM(stall_timeout=...) if it is only slow")
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

    def tick(self, adds: Sequence["Job"], cancels: Sequence[int]) -> list["Event"]:
        """One engine step on every rank for the jobs added and keys cancelled since the last; rank 0's events."""
        try:
            return self._tick(adds, cancels)
        except (OSError, EOFError) as exc:
            if self.aborted:  # the pipes were closed under this step by abort()
                raise RankError("the ranks were stopped (the LLM was aborted) before this request finished") from None
            raise RankError(f"the pipe to the ranks failed: {exc}") from None

    def _tick(self, adds: Sequence["Job"], cancels: Sequence[int]) -> list["Event"]:
        for conn in self.conns:
            conn.send(("tick", list(adds), list(cancels)))
        events, info = self._receive(0, "events")[1:]
        ended = {e.key: e.done.token_ids for e in events if e.done is not None}
        for rank in range(1, len(self.conns)):
            theirs = dict(self._receive(rank, "events")[1])
            if theirs != ended:
                raise RankError(f"rank {rank} generated different tokens than rank 0 (or ended other sequences); the ranks disagree")
        if info is not None:
            self.info = info
        return list(events)

    def close(self) -> None:
        """Ask every rank to finish and wait for them."""
        for conn in self.conns:
            try:
                conn.send(("close",))
            except OSError:
                pass
        self.thread.join()

    def abort(self) -> None:
        """Stop every rank now (after an error or Ctrl-C in the caller): SIGTERM, then spawn's own cleanup."""
        self.aborted = True
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for conn in self.conns:
            conn.close()
        self.thread.join()
