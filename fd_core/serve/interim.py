"""A stand-in for LLM.submit() until the engine batches requests as they arrive: requests run one at a
time through LLM.generate under a lock, each one's text delivered whole when it is done."""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:
    from fd_core.runtime.engine import Completion
    from fd_core.runtime.sampling import SamplingParams
    from fd_core.runtime.session import LLM


class InterimSubmission:
    """One request waiting for, or run by, the worker thread."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.prompt_tokens = 0
        self.first_token_at: float | None = None
        self.done = threading.Event()
        self.cancelled = False
        self.completion: "Completion | None" = None
        self.error: BaseException | None = None

    def __iter__(self) -> Iterator[str]:
        completion = self.result()
        if completion.text:
            yield completion.text

    def result(self, timeout: float | None = None) -> "Completion":
        if not self.done.wait(timeout):
            raise TimeoutError("the request has not finished")
        if self.error is not None:
            raise self.error
        assert self.completion is not None
        return self.completion

    def cancel(self) -> None:
        self.cancelled = True  # honoured only before the request starts


class InterimSubmitter:
    """submit() and queued() over today's LLM, serialised."""

    def __init__(self, llm: "LLM") -> None:
        self.llm = llm
        self.jobs: queue.Queue[InterimSubmission] = queue.Queue()
        self.waiting = 0
        threading.Thread(target=self.work, name="fd-serve-interim", daemon=True).start()

    def submit(self, prompt: Any, sampling: "SamplingParams | None" = None, *, chat: bool = False, images: Sequence[Any] = ()) -> InterimSubmission:
        self.llm.stream(prompt, sampling, chat=chat, images=images)  # checks the request now, as submit() will
        job = InterimSubmission(lambda: self.llm.generate(prompt, sampling, chat=chat, images=images)[0])
        self.waiting += 1
        self.jobs.put(job)
        return job

    def queued(self) -> int:
        return self.waiting

    def work(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job.cancelled:
                    raise RuntimeError("cancelled")
                job.completion = job.run()
                job.prompt_tokens = len(job.completion.prompt_ids)
                job.first_token_at = time.time()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                job.error = exc
            self.waiting -= 1
            job.done.set()
