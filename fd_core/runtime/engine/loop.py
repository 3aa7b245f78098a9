"""The one generation loop on one rank: sequences admitted into the slots of a fixed-shape KV cache at step
boundaries and retired when they end (continuous batching), sampling, and per-sequence stopping at
end-of-sequence ids, stop strings or the token limit."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Sequence

from fd_core.errors import NumericsError
from fd_core.runtime import progress
from fd_core.runtime.engine.runner import ModelRunner
from fd_core.runtime.engine.sampling import Sampler, SamplingParams
from fd_core.runtime.memory import MemoryPlan, cache_length
from fd_core.runtime.request import Request
from fd_core.runtime.text.streaming import StreamDecoder, TextState
from fd_core.runtime.threads import Threads, apply_phase

if TYPE_CHECKING:
    from fd_core.runtime.text.tokenizer import Tokenizer

# What fills a shorter prompt's left padding and a free slot's decode input (masked; any id in the vocabulary would do).
PAD_ID = 0


@dataclass
class Completion:
    """One prompt's output: the generated ids, their text (None without a tokenizer), and why it ended.

    `finish_reason` is "eos" (an end-of-sequence id, kept as the last id), "stop" (a stop string; the
    text is cut before it), "length" (max_new_tokens reached) or "cancelled" (its caller cancelled it).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "ids": self.token_ids, "finish_reason": self.finish_reason,
                "prompt_tokens": len(self.prompt_ids)}


@dataclass(frozen=True)
class Job:
    """One sequence to generate, as every rank receives it (plain data): its caller's key, prompt ids,
    sampling, end-of-sequence ids, pictures, and its index in its request (which seeds its sampler)."""

    key: int
    prompt: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    eos_ids: tuple[int, ...] = ()
    images: tuple[Any, ...] = ()
    index: int = 0


@dataclass(frozen=True)
class Event:
    """What one step did for one sequence: the token it chose (None: none this step), the text that token
    completed, and the completion when the sequence ended."""

    key: int
    token: int | None = None
    text: str = ""
    done: Completion | None = None


def jobs_of(request: Request, first_key: int = 0) -> list[Job]:
    """One job per prompt of `request`, keyed first_key, first_key + 1, ..."""
    return [Job(first_key + i, tuple(p), request.sampling, tuple(request.eos_ids), tuple(request.images), i)
            for i, p in enumerate(request.prompts)]


def check_finite(logits: Any, step: int, live: Sequence[bool]) -> None:
    """Non-finite logits [B, vocab] of a sequence still generating stop the run instead of becoming a plausible token.

    The test runs where the logits are (one isfinite-and-all reduction): one bool per row comes to
    the host, not the vocabulary (400 KB a row at 100k tokens); the count is taken on failure only.
    Where the logits are host memory already a copy would cost a little less: a step's rounding error
    either way (docs/benchmarks.md, "Threads").
    """
    import numpy as np

    if hasattr(logits, "isfinite"):  # a tensor
        finite = np.asarray(logits.isfinite().all(axis=-1).numpy()).reshape(-1)
    else:
        finite = np.isfinite(np.asarray(logits)).all(axis=-1).reshape(-1)
    bad = [b for b, alive in enumerate(live) if alive and not finite[b]]
    if bad:
        row = np.asarray(logits[bad[0]].numpy() if hasattr(logits, "numpy") else logits[bad[0]])
        count = int((~np.isfinite(row)).sum())
        raise NumericsError(
            f"step {step} produced {count} non-finite logit(s) (NaN or Inf) for prompt {bad[0] + 1}; the weights, "
            f"the inputs or the platform's kernels or all-reduce produce non-finite numbers (fd check tests the "
            f"all-reduce)"
        )


@dataclass
class _Row:
    """A sequence in a cache slot: what it generated, its text, and where its next token goes."""

    job: Job
    slot: int
    sampler: Sampler
    text: TextState | None
    eos: frozenset[int]
    position: int = 0  # the cache slot the next decode step writes for it
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None


@dataclass
class Engine:
    """The one generation loop: every caller (fd run, LLM, fd serve, fd check, the reference tests, the
    benchmarks) generates through it, with a loaded and decided ModelRunner.

    `add` queues a sequence and `cancel` ends one; each `step` retires cancelled sequences, admits
    waiting ones into free cache slots (prefilled together, then decoding with the others) and runs one
    decode step for every sequence in a slot. Every decision depends only on what was added and
    cancelled before the step, so ranks given the same calls in the same order decide the same.
    """

    runner: ModelRunner
    tokenizer: "Tokenizer | None" = None
    max_batch: int = 8
    decoded_tokens: int = 0
    decode_s: float = 0.0
    # Core time this rank got while decoding (below decode_s: the machine was shared), and when the
    # first token of the first request was chosen (time.time()), for the time to first token.
    decode_core_s: float = 0.0
    first_token_at: float | None = None
    # Of the decode time: choosing tokens (the non-finite check and the sample op) and how many times (a per-step
    # breakdown).
    choose_s: float = 0.0
    choose_calls: int = 0
    # The plan's KV-cache capacity: the cache (slots x length) is kept within it (None: up to max_batch slots).
    memory: MemoryPlan | None = None
    # The plan's compute threads: each phase sets what it computes on (phase_threads), on the calling thread.
    threads: Threads | None = None
    steps: int = 0
    _waiting: deque[Job] = field(default_factory=deque)
    _rows: dict[int, _Row] = field(default_factory=dict)  # by cache slot
    _cancelled: set[int] = field(default_factory=set)
    _shape: tuple[int, int] | None = None  # the cache's (slots, length)
    _prefilled: list[tuple[Any, list[_Row]]] = field(default_factory=list)  # this step's prefill logits and their rows

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput of everything generated so far (tokens from decode steps, all sequences)."""
        return self.decoded_tokens / self.decode_s if self.decode_s > 0 else 0.0

    # -- the whole of one request (fd run, fd check, the tests) ---------------------------
    def generate(self, request: Request, on_text: Callable[[int, str], None] | None = None) -> list[Completion]:
        """Every prompt's completion, in order; `on_text(prompt index, text)` as text is produced."""
        stream = self.stream(request)
        while True:
            try:
                index, text = next(stream)
            except StopIteration as done:
                return list(done.value)
            if on_text is not None:
                on_text(index, text)

    def stream(self, request: Request) -> Generator[tuple[int, str], None, list[Completion]]:
        """Yields (prompt index, new text) while generating; returns every completion (all queued at once, then
        stepped)."""
        if self.pending:
            raise RuntimeError("this engine is already generating; queue the request with add() instead")
        jobs = jobs_of(request)
        for job in jobs:
            self.add(job)
        results: dict[int, Completion] = {}
        while self.pending:
            for event in self.step():
                if event.text:
                    yield event.key, event.text
                if event.done is not None:
                    results[event.key] = event.done
        return [results[job.key] for job in jobs]

    # -- sequences as they arrive (the LLM's scheduler, the ranks of fd serve) --------------
    @property
    def pending(self) -> int:
        """Sequences waiting or in a slot."""
        return len(self._waiting) + len(self._rows)

    @property
    def running(self) -> dict[int, int]:
        """The key of the sequence in each occupied cache slot, by slot."""
        return {slot: row.job.key for slot, row in sorted(self._rows.items())}

    def add(self, job: Job) -> None:
        """Queue a sequence; a later step admits it."""
        self._waiting.append(job)

    def cancel(self, key: int) -> None:
        """End a sequence at the next step (its completion's finish_reason is "cancelled"); an unknown key is
        ignored."""
        self._cancelled.add(key)

    def reset(self) -> None:
        """Drop every sequence (after a failed step: their state is unknown)."""
        self._waiting.clear()
        self._rows.clear()
        self._cancelled.clear()
        self._prefilled.clear()

    def step(self) -> list[Event]:
        """Retire the cancelled, admit the waiting that fit, decode one token for each sequence in a slot."""
        events: list[Event] = []
        try:
            self._retire(events)
            self._admit()
            self._decode(events)
        except BaseException:
            self.reset()
            raise
        self.steps += 1
        return events

    # -- the parts of a step ---------------------------------------------------------------
    def _retire(self, events: list[Event]) -> None:
        if not self._cancelled:
            return
        cancelled, self._cancelled = self._cancelled, set()
        for job in [j for j in self._waiting if j.key in cancelled]:
            self._waiting.remove(job)
            events.append(
                Event(job.key, done=Completion(list(job.prompt), [], "" if self.tokenizer else None, "cancelled"))
            )
        for row in [r for r in self._rows.values() if r.job.key in cancelled]:
            row.reason = "cancelled"
            events.append(self._finish(row, final=False))

    def _cache_len(self, needed: int) -> int:
        return cache_length(needed, self.runner.config.max_position_embeddings)

    def _need(self, job: Job) -> int:
        return self._cache_len(len(job.prompt) + job.sampling.max_new_tokens)

    def _fits(self, slots: int, length: int) -> bool:
        return self.memory is None or self.memory.fits(slots * length)

    def _admit(self) -> None:
        """Waiting sequences into the cache, in order: a fresh cache for a group when nothing runs, else free slots
        (the cache grows, keeping its rows, when the next needs more slots or a longer cache and the memory holds
        it)."""
        if not self._waiting:
            return
        if not self._rows:
            group = self._group()
            slots, length = len(group), max(self._need(j) for j in group)
            self.runner.prepare(slots, length)
            self._shape = (slots, length)
            self._prefill(group, list(range(slots)))
            return
        assert self._shape is not None
        jobs: list[Job] = []
        while self._waiting and len(self._rows) + len(jobs) < self.max_batch:
            job = self._waiting[0]
            if job.images and jobs:
                break  # a prompt with pictures is prefilled alone (its rotary positions are not padded)
            rows, need = len(self._rows) + len(jobs) + 1, self._need(job)
            if (rows > self._shape[0] or need > self._shape[1]) and not self._grow(rows, need):
                break  # it waits for a slot, in order: nothing overtakes it
            jobs.append(self._waiting.popleft())
            if job.images:
                break
        if jobs:
            free = [slot for slot in range(self._shape[0]) if slot not in self._rows]
            self._prefill(jobs, free[: len(jobs)])

    def _grow(self, rows: int, length: int) -> bool:
        """Make the cache hold `rows` sequences of `length` positions, keeping what its rows hold; False if it
        cannot."""
        assert self._shape is not None
        slots, have = self._shape
        if rows > self.max_batch:
            return False
        # Powers of two, so that a batch growing one sequence at a time captures few shapes.
        wanted = (min(self.max_batch, 1 << (rows - 1).bit_length()) if rows > slots else slots,
                  min(self.runner.config.max_position_embeddings, max(have, 1 << (length - 1).bit_length()))
                  if length > have else have)
        for size in (wanted, (max(rows, slots), max(have, length))):
            if self._fits(*size):
                self.runner.prepare(*size, keep=True)
                self._shape = size
                return True
        return False

    def _group(self) -> list[Job]:
        """The waiting sequences that start together in a fresh cache: pictures alone; text, in order, as many as
        fit."""
        first = self._waiting[0]
        if first.images:
            return [self._waiting.popleft()]
        group: list[Job] = []
        length = 0
        while self._waiting and len(group) < self.max_batch and not self._waiting[0].images:
            grown = max(length, self._need(self._waiting[0]))
            if group and not self._fits(len(group) + 1, grown):
                break
            group.append(self._waiting.popleft())
            length = grown
        return group

    def _use_threads(self, rows: int | None) -> None:
        """Compute the coming prefill (`rows` None) or decode step of `rows` cache rows on its phase's threads."""
        if self.threads is not None:
            # Every phase, not only on a change: MKL's count is the process's, which another engine may have set (cheap:
            # docs/benchmarks.md).
            apply_phase(self.threads, rows)

    def _prefill(self, jobs: Sequence[Job], slots: Sequence[int]) -> None:
        """Prefill `jobs` together (left-padded) into cache `slots`; their first tokens come from the step's choice."""
        import numpy as np

        model = self.runner.model
        assert model is not None
        width = max(len(j.prompt) for j in jobs)
        pads = [width - len(j.prompt) for j in jobs]
        ids = np.asarray([[PAD_ID] * pad + list(j.prompt) for pad, j in zip(pads, jobs, strict=True)], dtype="int64")
        image = list(jobs[0].images) if jobs[0].images else None
        position = model.prefill_length(ids, image)
        self._use_threads(None)
        start = time.perf_counter()
        progress.report("prefill")
        logits = model.prefill(ids, image, pad=pads if any(pads) else None, cache_rows=list(slots))
        self.runner.add_time("prefill", time.perf_counter() - start)
        for job, slot in zip(jobs, slots, strict=True):
            text = TextState(StreamDecoder(self.tokenizer), job.sampling.stop) if self.tokenizer else None
            eos = frozenset() if job.sampling.ignore_eos else frozenset(job.eos_ids)
            self._rows[slot] = _Row(job, slot, Sampler(job.sampling, [job.index]), text, eos, position)
        self._prefilled.append((logits, [self._rows[s] for s in slots]))

    def _decode(self, events: list[Event]) -> None:
        """The first tokens of what was prefilled, then one decode step over every cache row (a free row rides along,
        masked, in its own row); each live row's token pushed."""
        import numpy as np

        prefilled, self._prefilled = self._prefilled, []
        for logits, rows in prefilled:
            for row, token in zip(rows, self._choose(logits, rows), strict=True):
                self._push(row, token, events)
        if not self._rows:
            return
        model = self.runner.model
        assert model is not None and self._shape is not None
        slots = self._shape[0]
        rows = sorted(self._rows.values(), key=lambda r: r.slot)
        tokens = np.full([slots, 1], PAD_ID, dtype="int64")
        positions = [0] * slots  # a free row writes its own position 0, which the next prefill of it overwrites
        for row in rows:
            tokens[row.slot, 0] = row.tokens[-1]
            positions[row.slot] = row.position
        self._use_threads(slots)
        start, core_start = time.perf_counter(), time.process_time()
        progress.report("decode")
        logits = model.decode_step(tokens, positions)
        picked = self._choose(logits, rows, [row.slot for row in rows])
        for row, token in zip(rows, picked, strict=True):
            row.position += 1
            self._push(row, token, events)
        elapsed = time.perf_counter() - start
        self.runner.add_time("decode", elapsed)
        self.decode_s += elapsed
        self.decode_core_s += time.process_time() - core_start
        self.decoded_tokens += len(rows)

    def _choose(self, logits: Any, rows: Sequence[_Row], at: Sequence[int] | None = None) -> list[int]:
        """Each row's next token from logits [B, vocab] (row i at logits row at[i]) through the Backend's sample op,
        once its live rows' logits are known to be finite."""
        start = time.perf_counter()
        at = list(range(len(rows))) if at is None else list(at)
        live = [False] * int(logits.shape[0])
        for i in at:
            live[i] = True
        check_finite(logits, self.steps, live)
        sample = self.runner.backend.ops.sample
        if all(row.job.sampling.greedy for row in rows):
            # One call for the whole batch: greedy draws nothing, so the rows need no sampler of their own.
            every = sample(logits, 0.0, 0, 1.0, [0.0] * len(live))
            chosen = [int(every[i]) for i in at]
        else:
            chosen = [row.sampler.choose(logits[i : i + 1], sample)[0] for row, i in zip(rows, at, strict=True)]
        self.choose_s += time.perf_counter() - start
        self.choose_calls += 1
        return chosen

    def _push(self, row: _Row, token: int, events: list[Event]) -> None:
        """A row's new token: its text, and whether it ends the sequence (then the slot is free)."""
        if self.first_token_at is None:
            self.first_token_at = time.time()
        row.tokens.append(token)
        shown = ""
        if token in row.eos:
            row.reason = "eos"
        elif row.text is not None:
            shown = row.text.push(token)
            if row.text.stopped:
                row.reason = "stop"
        if row.reason is None and len(row.tokens) >= row.job.sampling.max_new_tokens:
            row.reason = "length"
        if row.reason is None:
            events.append(Event(row.job.key, token, shown))
            return
        end = self._finish(row, final=True)
        events.append(Event(row.job.key, token, shown + end.text, end.done))

    def _finish(self, row: _Row, final: bool) -> Event:
        """Free the row's slot; its completion, with the rest of its text when it ended by itself."""
        del self._rows[row.slot]
        state = row.text
        rest = state.finish() if state is not None and final else ""
        text = None if state is None else (state.text if final else state.text[: state.shown])
        assert row.reason is not None
        return Event(row.job.key, None, rest, Completion(list(row.job.prompt), row.tokens, text, row.reason))
