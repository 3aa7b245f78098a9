"""A session: a planned run on its ranks, the one front door into the runtime. `fd run`, `LLM` (and so
`fd serve`) and the conformance suites start their ranks, tick them, reload them and read their reports
through it, so what the suites certify is what users run."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Literal, Sequence

from fd_core.errors import FdError
from fd_core.host.backend import Backend
from fd_core.host.loading import PluginSet
from fd_core.runtime.engine.loop import Completion, Event, Job, jobs_of
from fd_core.runtime.engine.scheduler import Scheduler, Submission
from fd_core.runtime.plan import Plan
from fd_core.runtime.ranks.pool import RankPool, step
from fd_core.runtime.ranks.spawn import DEFAULT_STALL_S, init_rank, launched_rank, run_here
from fd_core.runtime.ranks.worker import RankWorker, end_reason
from fd_core.runtime.request import Request


class InProcess:
    """One rank in this process: the whole run at tp=1, or this process's rank under a launcher."""

    def __init__(self, worker: RankWorker) -> None:
        self.worker: RankWorker | None = worker
        self.info = worker.describe()
        self.error: BaseException | None = None

    def _live(self) -> RankWorker:
        if self.worker is None:
            raise FdError("this session is closed; start a new one")
        return self.worker

    def tick(self, adds: Sequence[Job], cancels: Sequence[int]) -> list[Event]:
        """One engine step for the jobs added and keys cancelled since the last."""
        worker = self._live()
        engine = worker.engine
        for job in adds:
            engine.add(job)
        for key in cancels:
            engine.cancel(key)
        events = run_here(step, worker)
        if any(e.done is not None for e in events):
            self.info = self._live().describe()
        return events

    def reload(self) -> None:
        """A weight update (graphs cleared, weights released, loaded again)."""
        run_here(self._live().reload)

    def reports(self) -> list[dict[str, Any]]:
        """This rank's timings, speed and memory."""
        report = self._live().report()
        self.info = {k: v for k, v in report.items() if k in self.info}
        return [report]

    def close(self, error: BaseException | None = None) -> None:
        """End the rank (the platform's fd_rank_end: "normal", or how `error` ended it) and release the model and its
        KV cache; `info` stays readable."""
        if self.worker is not None:
            worker, self.worker = self.worker, None
            worker.end(end_reason(error))

    def abort(self, error: BaseException | None = None) -> None:
        self.close(error or self.error or RuntimeError("aborted"))


class Session:
    """A plan running on its ranks: in this process at tp=1 (and under a launcher, this process's rank), else on
    `tp` ranks spawned here and kept until `close()`.

    One scheduler thread does every step for every caller (`submit` from any thread). A rank that fails
    stops the others and every pending and later call raises the RankError naming it. `rank_timeout` is how
    long stopping the others may take; `stall_timeout`, how long a rank may go without progress.
    `start_method` "fork" starts the ranks with this process's imports done: only for a caller that has run
    no paddle op and started no thread (fd run).
    """

    def __init__(
        self, plan: Plan, plugins: PluginSet, *, backend: Backend | None = None, rank_timeout: float = 30.0,
        stall_timeout: float = DEFAULT_STALL_S, start_method: Literal["spawn", "fork"] = "spawn",
    ) -> None:
        run = plan.run
        # The ranks start after this process tokenized: a tokenizer thread pool started before a fork
        # would make the library warn (and fall back) in every rank.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.launched = launched_rank()
        self.driver: InProcess | RankPool
        if self.launched is not None:
            # Started by paddle.distributed.launch: this process is one rank of the group.
            at = time.time()
            rank, world = init_rank()
            before = {"at": at, "rendezvous": time.time() - at}
            self.driver = InProcess(
                run_here(lambda: RankWorker.start(plan, rank, world, plugins=plugins, before=before))
            )
        elif run.tp == 1:
            self.driver = InProcess(run_here(lambda: RankWorker.start(plan, plugins=plugins, backend=backend)))
        else:
            if run.progress:
                print(f"fd: starting {run.tp} ranks on {plan.platform} ({plan.dist_backend})", file=sys.stderr,
                      flush=True)
            # Before the clock: spawning needs it, and its import belongs to "start".
            import paddle.distributed  # noqa: F401

            plan = dataclasses.replace(plan, run=dataclasses.replace(run, spawned_at=time.time()))
            self.driver = RankPool(plan, run.tp, rank_timeout, stall_timeout, start_method)
        self.plan = plan
        in_process = isinstance(self.driver, InProcess)
        # At tp=1 a failed step fails the sequences it held and the session goes on; across ranks, the ranks are gone.
        fatal = not in_process or self.launched is not None
        self.scheduler = Scheduler(self.driver.tick, fatal=lambda error: fatal, name="fd-session")
        self.closed = False

    # -- what it runs ----------------------------------------------------------------------
    @property
    def info(self) -> dict[str, Any]:
        """Rank 0's description (platform, model, graph decision, timings), as of the last sequence that ended or
        report."""
        return dict(self.driver.info)

    @property
    def worker(self) -> RankWorker | None:
        """The rank in this process (tp=1, or this process's rank under a launcher), for a caller that inspects its
        model or engine; None when the ranks are other processes."""
        return self.driver.worker if isinstance(self.driver, InProcess) else None

    @property
    def pids(self) -> list[int]:
        """The process ids of the ranks this session spawned (none when they run in this process)."""
        return list(self.driver.pids) if isinstance(self.driver, RankPool) else []

    @property
    def error(self) -> BaseException | None:
        """The failure that stopped the ranks (every later call raises it); None while the session can generate."""
        return self.scheduler.error or self.driver.error

    # -- generating ------------------------------------------------------------------------
    def submit(self, jobs: Sequence[Job], share: int | None = None) -> list[Submission]:
        """Queue jobs from any thread; they join the running batch at the next step boundary (one request for the
        engine's fair shares, with the other jobs of `share` from new_share())."""
        return self.scheduler.submit(jobs, share)

    def new_share(self) -> int:
        """A request's share, for submit()s that make one request together."""
        return self.scheduler.new_share()

    def generate(self, request: Request, on_text: Callable[[int, str], None] | None = None) -> list[Completion]:
        """Every prompt's completion, in order; `on_text(prompt index, text)` as text is produced. Interrupted
        (Ctrl-C), the sequences are cancelled and the interruption raised."""
        submissions = self.submit(jobs_of(request))
        try:
            if on_text is not None:
                for index, submission in enumerate(submissions):
                    for piece in submission:
                        on_text(index, piece)
            return [s.result() for s in submissions]
        except BaseException:
            for submission in submissions:
                submission.cancel()
            raise

    # -- between requests -------------------------------------------------------------------
    def reload(self) -> None:
        """A weight update on every rank, between steps."""
        self.scheduler.call(self.driver.reload).result()

    def reports(self) -> list[dict[str, Any]]:
        """Every rank's timings, speed and memory (under a launcher, this process's rank only), in rank order."""
        return list(self.scheduler.call(self.driver.reports).result())

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the scheduler (what still runs fails with SchedulerClosed), then the ranks; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.scheduler.close()
        self.driver.close()

    def abort(self, error: BaseException | None = None) -> None:
        """Stop the ranks now (`error`: an error or a signal in the caller; a step in progress then fails), then the
        scheduler."""
        if self.closed:
            return
        self.closed = True
        if isinstance(self.driver, InProcess):
            # The step in progress runs on the scheduler's thread: it ends before the rank (and its device) does.
            self.scheduler.close()
            self.driver.abort(error)
        else:
            self.driver.abort()
            self.scheduler.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if error is not None:
            self.abort(error)
        else:
            self.close()
