"""Requests as they arrive, from any thread: each becomes a Submission, and one thread feeds them to the engine
(or the ranks) at step boundaries, step after step while any runs, handing each its text as it is produced."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

from fd_core.errors import FdError, SequenceError
from fd_core.runtime.engine.loop import Completion, Event, Job
from fd_core.runtime.engine.sampling import TokenLogprob

# One step for the jobs added and the keys cancelled since the last: every sequence's events of that step.
Tick = Callable[[Sequence[Job], Sequence[int]], Sequence[Event]]
_END = object()  # the end of a submission's text queue


class SchedulerClosed(FdError):
    """The scheduler stopped (its LLM was closed, or its ranks failed) before this request ended."""


@dataclass(frozen=True)
class Piece:
    """New text of a sequence with the ids and the logprob data (empty when its sampling asked for none) of the tokens
    chosen since the previous piece. A token that completes no character yet (half of one, an end-of-sequence id)
    rides with the next piece, unless the pieces are asked for every token; the last piece may have no text, only
    the last tokens."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    token_ids: tuple[int, ...] = ()


class Submission:
    """One prompt on its way through the running batch: its text as produced (with its tokens' logprobs, when asked),
    its completion, and a way to cancel it."""

    def __init__(self, key: int, prompt_tokens: int, cancel: Callable[[int], None],
                 prompt_ids: Sequence[int] = ()) -> None:
        self.key = key
        self.prompt_tokens = prompt_tokens
        self.prompt_ids = prompt_ids
        self.first_token_at: float | None = None  # time.time() when its first token reached this process
        self.generated_tokens = 0
        # Its prompt's logprobs (SamplingParams.prompt_logprobs), set before its first piece is handed on.
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        self._cancel = cancel
        self._pieces: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._error: BaseException | None = None

    def __iter__(self) -> Iterator[str]:
        """The new text pieces as they are produced (blocking); ends when the sequence ends; raises the failure that
        ended it."""
        for text, _, _ in self._steps():
            if text:
                yield text

    def pieces(self, every_token: bool = False) -> Iterator[Piece]:
        """The new text as it is produced, each Piece with the ids and the logprob data of the tokens chosen since the
        previous one (blocking); `every_token`: a Piece for each token, its text possibly empty (a client reading ids,
        or a checkpoint without a tokenizer, sees each token as it comes). Ends when the sequence ends; raises the
        failure that ended it. Iterate this or the submission itself, not both."""
        held: list[TokenLogprob] = []
        ids: list[int] = []
        for text, logprob, token in self._steps():
            if logprob is not None:
                held.append(logprob)
            if token is not None:
                ids.append(token)
            if text or (every_token and token is not None):
                yield Piece(text, tuple(held), tuple(ids))
                held, ids = [], []
        if held or ids:
            yield Piece("", tuple(held), tuple(ids))

    def _steps(self) -> Iterator[tuple[str, TokenLogprob | None, int | None]]:
        """Each step's (new text, the token's logprob data, the token) as it arrives; raises the failure that ended
        it."""
        while True:
            step = self._pieces.get()
            if step is _END:
                self._pieces.put(_END)  # a second iteration ends at once too
                break
            assert isinstance(step, tuple)
            yield step
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> Completion:
        """The completion, once the sequence ended (TimeoutError after `timeout` seconds); raises the failure that
        ended it."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion

    def cancel(self) -> None:
        """End the sequence at the next step boundary, freeing its slot; iteration then ends (finish_reason
        "cancelled")."""
        if not self._done.is_set():
            self._cancel(self.key)

    @property
    def done(self) -> bool:
        """Whether the sequence has ended (finished, cancelled or failed)."""
        return self._done.is_set()

    # -- the scheduler's side --------------------------------------------------------------
    def deliver(self, event: Event) -> None:
        """One step's event for this sequence."""
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.token is not None:
            self.generated_tokens += 1
            if self.first_token_at is None:
                self.first_token_at = time.time()
        if event.text or event.logprob is not None or event.token is not None:
            self._pieces.put((event.text, event.logprob, event.token))
        if event.done is not None and event.done.failure is not None:
            failure = event.done.failure
            self.fail(SequenceError(failure.message, failure.request))
        elif event.done is not None:
            self._completion = event.done
            self._close()

    def fail(self, error: BaseException) -> None:
        """End the sequence with `error` (iteration and result() raise it)."""
        if not self._done.is_set():
            self._error = error
            self._close()

    def _close(self) -> None:
        self._done.set()
        self._pieces.put(_END)


@dataclass(frozen=True)
class Pending:
    """A job with the submission that receives its events."""

    job: Job
    submission: Submission


class Scheduler:
    """Queues submissions from any thread and runs `tick` on one thread of its own, step after step while any is
    pending.

    A failing tick fails every pending submission with its error; `fatal(error)` says whether the
    scheduler stops for good (the ranks are gone), or goes on with the next submissions (the engine
    dropped its sequences and is ready again).
    """

    def __init__(
        self, tick: Tick, fatal: Callable[[BaseException], bool] = lambda error: True, name: str = "fd-scheduler",
    ) -> None:
        self._tick = tick
        self._fatal = fatal
        self._keys = itertools.count()
        self._shares = itertools.count()
        self._lock = threading.Condition()
        self._new: list[Pending] = []
        self._cancels: list[int] = []
        self._live: dict[int, Submission] = {}
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._closing = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, jobs: Sequence[Job], share: int | None = None) -> list[Submission]:
        """Queue jobs (their keys replaced by the scheduler's own, and their groups with them); they join the running
        batch together at the next step boundary. They are one request for the engine's fair shares (Job.owner): with
        the other jobs of `share` (from new_share()), or, None, by themselves."""
        with self._lock:
            self._check_open()
            keys = {job.key: next(self._keys) for job in jobs}
            owner = next(self._shares) if share is None else share
            out = []
            for job in jobs:
                key = keys[job.key]
                group = None if job.group is None else keys.get(job.group, key)
                submission = Submission(key, len(job.prompt), self.cancel, job.prompt)
                self._new.append(Pending(replace(job, key=key, group=group, owner=owner), submission))
                self._live[key] = submission
                out.append(submission)
            self._lock.notify_all()
            return out

    def new_share(self) -> int:
        """A new request's share: submit() calls given it count as one request for the engine's fair shares."""
        with self._lock:
            return next(self._shares)

    def call(self, fn: Callable[[], Any]) -> "Future[Any]":
        """Run `fn` on the scheduler's thread at the next step boundary (a weight reload, a report: what must not
        run beside a step); its result or error in the Future. A failure counts as a failed step does."""
        future: Future[Any] = Future()
        with self._lock:
            self._check_open()
            self._calls.append((fn, future))
            self._lock.notify_all()
        return future

    def cancel(self, key: int) -> None:
        """Cancel the sequence `key` at the next step boundary."""
        with self._lock:
            if key in self._live and not self._closing:
                self._cancels.append(key)
                self._lock.notify_all()

    def queued(self) -> int:
        """Sequences waiting or running."""
        with self._lock:
            return len(self._live)

    def close(self, error: BaseException | None = None) -> None:
        """Stop after the current step; every sequence still pending fails (with `error`, or SchedulerClosed)."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        closed = error or SchedulerClosed("the LLM was closed before this request finished")
        self._fail_all(closed)
        with self._lock:
            calls, self._calls = self._calls, []
        for _, future in calls:
            future.set_exception(closed)

    def _check_open(self) -> None:
        if self.error is not None:
            raise SchedulerClosed(f"this LLM can no longer generate: {self.error}")
        if self._closing:
            raise SchedulerClosed("this LLM is closed; create a new one")

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._live or self._calls or self._closing):
                    self._lock.wait()
                if self._closing:
                    return
                calls, self._calls = self._calls, []
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as error:  # noqa: BLE001 - handed to the caller waiting on the Future
                    future.set_exception(error)
                    if self._fatal(error):
                        with self._lock:
                            self.error, self._closing = error, True
                        self._fail_all(error)
                        return
            with self._lock:
                if not self._live:
                    continue
                new, self._new = self._new, []
                cancels, self._cancels = self._cancels, []
            try:
                events = self._tick([p.job for p in new], cancels)
            except BaseException as error:  # noqa: BLE001 - handed to every caller waiting on a submission
                fatal = self._fatal(error)
                with self._lock:
                    if fatal:
                        self.error = error
                        self._closing = True
                # Every sequence the engine held is lost; those queued since the tick began go on (unless fatal).
                self._fail_all(error, keep_new=not fatal)
                if fatal:
                    return
                continue
            with self._lock:
                for event in events:
                    submission = self._live.get(event.key)
                    if submission is None:
                        continue
                    if event.done is not None:
                        del self._live[event.key]
                    submission.deliver(event)

    def _fail_all(self, error: BaseException, keep_new: bool = False) -> None:
        with self._lock:
            kept = {p.job.key for p in self._new} if keep_new else set()
            failed = [s for k, s in self._live.items() if k not in kept]
            self._live = {k: s for k, s in self._live.items() if k in kept}
            if not keep_new:
                self._new = []
        for submission in failed:
            submission.fail(error)
