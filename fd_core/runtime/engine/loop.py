"""The one generation loop on one rank: sequences in the blocks of the paged KV cache, admitted at step
boundaries and retired when they end (continuous batching); prompts prefilled in chunks beside the running
decodes, full blocks shared by prefix, the latest sequence preempted (and later recomputed) when blocks run out;
sampling, and per-sequence stopping at end-of-sequence ids, stop strings or the token limit."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Sequence

from fd_core.error_lines import error_line
from fd_core.errors import CheckpointError, ConfigError, FdError, NumericsError, PluginError, setting
from fd_core.kernels import set_compute_threads
from fd_core.kvcache import KVBatch
from fd_core.lifecycle import RankContext
from fd_core.models import host_tensor
from fd_core.runtime import progress
from fd_core.runtime.engine.blocks import NULL_BLOCK, BlockPool, block_hash
from fd_core.runtime.engine.checked_graphs import float_sums
from fd_core.runtime.engine.runner import ModelRunner
from fd_core.runtime.engine.sampling import (
    Sampler,
    SamplingParams,
    TokenLogprob,
    process_logits,
    token_logprobs,
)
from fd_core.runtime.engine.speculation import BACKOFF_MAX, NgramProposer, Proposer, Speculation
from fd_core.runtime.memory import DEFAULT_MAX_PREFILL_TOKENS, MemoryPlan
from fd_core.runtime.request import Request
from fd_core.runtime.text.streaming import StreamDecoder, TextState
from fd_core.transfer import KVTransport, TransferState

if TYPE_CHECKING:
    from fd_core.runtime.text.grammar import Constraint, Grammars
    from fd_core.runtime.text.tokenizer import Tokenizer

# What fills a shorter prompt's left padding and a free slot's decode input (masked; any id in the vocabulary would do).
# The shortest span (in positions) a decode step is captured for; wider block tables take the next power of two.
MIN_CAPTURED_POSITIONS = 64
PAD_ID = 0
# The most prompt tokens of a scored prompt (SamplingParams.prompt_logprobs) one step prefills: its logits come back
# for every position ([tokens, vocab] float32: 75 MB at 128 tokens of a 150k vocabulary).
SCORED_CHUNK = 128
# The most scored prompts one step prefills: with SCORED_CHUNK, what bounds the logits a scored prefill returns
# ([rows, chunk, vocab], padding included: 300 MB at 4 x 128 positions of a 150k vocabulary in float32).
SCORED_ROWS = 4
# At tp > 1, every this many steps (the first included) each rank fingerprints what every all-reduce of the step's
# eager model calls returned (their sums and absolute sums, in float64) and the session compares them across ranks:
# an all-reduce's result is the same tensor on every rank, so a rank whose all-reduce returns something else (a stale
# buffer, its own partial) is told even when the tokens agree. A captured step's replay is not fingerprinted.
FINGERPRINT_EVERY = 8
# How far two ranks' fingerprints may differ, relative to the absolute sum, by the run's dtype: an all-reduce gives
# every rank the same tensor, but one that sums in another order on each rank would move them by rounding only; a
# stale or partial result moves them by its own size.
FINGERPRINT_RTOL = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


@dataclass
class Completion:
    """One prompt's output: the generated ids, their text (None without a tokenizer), and why it ended.

    `finish_reason` is "eos" (an end-of-sequence id, kept as the last id), "stop" (a stop string; the
    text is cut before it), "length" (max_new_tokens reached), "handoff" (its first token chosen, its prompt's keys and
    values went to a decode instance: Job.handoff), "cancelled" (its caller cancelled it) or "error" (what
    handling this sequence alone failed on: its grammar, its bias, its scoring, its pictures; `failure` says what, and
    every other sequence of the step went on).
    `logprobs` (when its SamplingParams asked) has one TokenLogprob per id of token_ids, in order;
    `prompt_logprobs` (when asked) one per id of prompt_ids, the first None (nothing comes before it); fewer when
    the sequence was cancelled before its prompt was scored.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    failure: "SequenceFailure | None" = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"text": self.text, "ids": self.token_ids, "finish_reason": self.finish_reason,
                               "prompt_tokens": len(self.prompt_ids)}
        if self.failure is not None:
            out["error"] = self.failure.message
        if self.logprobs is not None:
            out["logprobs"] = [_logprob_dict(p) for p in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [None if p is None else _logprob_dict(p) for p in self.prompt_logprobs]
        return out


@dataclass(frozen=True)
class SequenceFailure:
    """Why one sequence ended with "error", in one line (plain data: it crosses process boundaries); `request` is True
    when what the request asked for is at fault (its grammar cannot be followed, say), False for the engine's side."""

    message: str
    request: bool

    @classmethod
    def of(cls, exc: BaseException) -> "SequenceFailure":
        """The one-line failure of `exc`: an FdError's own message, else its type and the informative line of its
        message (error_line: Paddle's multi-line reports open with boilerplate)."""
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        message = lines[0] if isinstance(exc, FdError) and lines else error_line(exc)
        return cls(message, isinstance(exc, ConfigError))


def _logprob_dict(p: TokenLogprob) -> dict[str, Any]:
    return {"token": p.token, "logprob": p.logprob, "top": [list(t) for t in p.top]}


@dataclass(frozen=True)
class KVHandoff:
    """A job's part in disaggregation (plain data). `key` names its prompt's keys and values in the transfer. With
    `send_to` (a decode instance's transfer address) its prompt is prefilled here, and once its first token is chosen
    the keys and values are sent there (each rank to the same rank) and it ends with finish_reason "handoff". Without,
    they are received here under `key` and it goes on from `tokens`, what the prefill instance chose (and their
    `logprobs`, when its sampling asks), decoding here."""

    key: str
    send_to: str | None = None
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None


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
    # The key of its prompt's first choice when the prompt asks for several (SamplingParams.n), else None.
    group: int | None = None
    # The request it belongs to (its prompts and choices share one fair share of the batch; None: a request alone).
    owner: int | None = None
    # Its prompt's keys and values sent to another instance, or received from one (None: neither).
    handoff: KVHandoff | None = None


@dataclass(frozen=True)
class Event:
    """What one step did for one sequence: the token it chose (None: none this step), the text that token
    completed, the completion when the sequence ended, and the token's logprob data when its sampling asked; the
    event of its first token carries its prompt's logprobs when its sampling asked (prompt_logprobs)."""

    key: int
    token: int | None = None
    text: str = ""
    done: Completion | None = None
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


def jobs_of(request: Request, first_key: int = 0) -> list[Job]:
    """One job per choice of each prompt of `request` (SamplingParams.n, prompt by prompt), keyed first_key,
    first_key + 1, ...; choice j of prompt i has index i * n + j (its sampler's seed); all owned by first_key."""
    n = request.sampling.n
    return [Job(first_key + i * n + j, tuple(p), request.sampling, tuple(request.eos_ids), tuple(request.images),
                i * n + j, first_key + i * n if n > 1 else None, first_key)
            for i, p in enumerate(request.prompts) for j in range(n)]


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


def scores_in_prefill(model: Any) -> bool:
    """Whether a prompt is scored in `model`'s prefill: it has prefill_every (contract 1.5), defined by its own class
    or one below where its prefill is, so a package that overrides prefill and inherits prefill_every from fd's
    decoder (written before 1.5) is scored a token a step, through its own prefill's path."""
    if not callable(getattr(model, "prefill_every", None)):
        return False
    mro = type(model).__mro__

    def owner(name: str) -> int:
        return next((i for i, cls in enumerate(mro) if name in vars(cls)), len(mro))

    return owner("prefill_every") <= owner("prefill")


def fingerprints_agree(a: tuple[int, float, float], b: tuple[int, float, float], dtype: str = "float32") -> bool:
    """Whether two ranks' fingerprints of one step agree (FINGERPRINT_RTOL of the absolute sum, by the dtype)."""
    tolerance = FINGERPRINT_RTOL.get(dtype, FINGERPRINT_RTOL["bfloat16"]) * max(abs(a[2]), abs(b[2]), 1e-30)
    return a[0] == b[0] and abs(a[1] - b[1]) <= tolerance and abs(a[2] - b[2]) <= tolerance


def _host_rows(logits: Any, rows: Sequence[int]) -> Any:
    """Rows of logits [B, vocab] (a tensor or an array) on the host as a float32 numpy array [len(rows), vocab]: a
    tensor's rows gathered where they are first, so that only those rows travel (the copy costs by its size)."""
    import numpy as np

    picked = list(rows)
    if not hasattr(logits, "numpy"):
        return np.asarray(logits, dtype=np.float32)[picked]
    if picked != list(range(int(logits.shape[0]))):
        logits = logits[picked]
    if not str(logits.dtype).endswith("float32"):
        logits = logits.astype("float32")
    return np.asarray(logits.numpy())


@dataclass
class _Seq:
    """One sequence: its ids so far (prompt, then what it generated), the blocks holding them, how many are
    computed (their keys and values in the cache), its sampler, text and stop state, and its tokens' logprobs (None:
    not asked)."""

    job: Job
    sampler: Sampler
    text: TextState | None
    eos: frozenset[int]
    ids: list[int]
    order: int  # admission order: the latest admitted is preempted first
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    hashes: list[bytes] = field(default_factory=list)  # the chain over its published full blocks
    rope_delta: int = 0
    reason: str | None = None
    admitted: bool = False
    logprobs: list[TokenLogprob] | None = None
    constraint: "Constraint | None" = None  # its grammar's state (SamplingParams.grammar), made at its first token
    # Its prompt's logprobs when asked (SamplingParams.prompt_logprobs; filled on the reporting rank only), and how
    # many prompt positions are scored, on every rank alike (position 0 has nothing to score).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    scored: int = 1
    failure: SequenceFailure | None = None  # what ended it with "error"
    # Its prompt is scored a token a decode step: the model has no prefill_every (else it is scored in its prefill).
    by_step: bool = False
    # Speculation: how many tokens it proposes next (None: the most), verify steps in a row that accepted none of its
    # proposals, and the steps it still waits before proposing again.
    depth: int | None = None
    misses: int = 0
    wait: int = 0
    # Disaggregation: its prompt's keys and values are still to arrive from the prefill instance (awaiting), or have
    # arrived and wait for its blocks (parts: [meta, layer 0's keys, its values, ...] as host arrays).
    awaiting: bool = False
    parts: list[Any] | None = None
    arrive_by: float | None = None  # time.monotonic() past which they are late
    # The tokens the prefill instance chose, as events to give out once their keys and values are here.
    handed: list["Event"] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.ids[len(self.job.prompt):]

    @property
    def pending(self) -> int:
        return len(self.ids) - self.computed

    @property
    def scoring(self) -> bool:
        """Whether its prompt's logprobs are asked and not all scored yet."""
        return self.job.sampling.prompt_logprobs is not None and self.scored < len(self.job.prompt)

    @property
    def stepwise(self) -> bool:
        """Whether it still runs its prompt a token a step: scoring, with a model whose prefill gives the logits of
        each row's last position only (no prefill_every)."""
        return self.by_step and self.scoring

    @property
    def scored_in_prefill(self) -> bool:
        """Whether its prompt is still to be scored in its prefill chunks (through the model's prefill_every)."""
        return self.scoring and not self.by_step

    @property
    def cacheable(self) -> bool:
        """Whether its blocks are shared by prefix: prompts with pictures are not (their tokens do not say the
        pictures' content)."""
        return not self.job.images


@dataclass
class _Chunk:
    """What one sequence computes in a step: `count` pending tokens from position seq.computed."""

    seq: _Seq
    count: int


def _digest(ids: Sequence[int]) -> int:
    """A prompt's ids as one int64 (a hand-over's check that both instances hold the same prompt)."""
    return int.from_bytes(block_hash(None, ids)[:8], "little", signed=True)


def _bucket(value: int, limit: int) -> int:
    """The power of two at or above `value`, at most `limit` (at least `value`)."""
    return max(value, min(limit, 1 << max(0, value - 1).bit_length()))


def capture_sizes_for(declared: Sequence[int], max_batch: int) -> list[int]:
    """The capture sizes a run uses: the platform's up to the max batch and the first one at or above it (a batch is
    never padded past that), or, none declared, the powers of two below the max batch and the max batch itself."""
    if not declared:
        return [n for n in (1 << i for i in range(max_batch.bit_length())) if n < max_batch] + [max_batch]
    ordered = sorted(set(declared))
    above = [n for n in ordered if n >= max_batch][:1]
    return [n for n in ordered if n < max_batch] + above


def capture_size(rows: int, sizes: Sequence[int], max_batch: int) -> int | None:
    """The batch a decode step of `rows` rows is captured at: the smallest of capture_sizes_for(sizes, max_batch) at or
    above it; None above the largest: eager."""
    return min((n for n in capture_sizes_for(sizes, max_batch) if n >= rows), default=None)


@dataclass
class Engine:
    """The one generation loop: every caller (fd run, LLM, fd serve, fd check, the reference tests, the
    benchmarks) generates through it, with a loaded and decided ModelRunner.

    `add` queues a sequence and `cancel` ends one; each `step` retires cancelled sequences, gives every running
    sequence the blocks its next tokens need (preempting the latest admitted when the pool runs out), admits
    waiting sequences in order while the batch, the prefill budget and the blocks allow, then runs the step's
    prompt chunks (at most `max_prefill_tokens` prompt tokens) and one decode token for every sequence whose
    prompt is done. Every decision depends only on what was added and cancelled before the step, so ranks given
    the same calls in the same order decide the same.
    """

    runner: ModelRunner
    tokenizer: "Tokenizer | None" = None
    max_batch: int = 8
    # The plan's memory: how many blocks the pool has and their size (None: a pool for max_batch sequences of
    # the model's whole context, in blocks of 16).
    memory: MemoryPlan | None = None
    # The rank as the plan made it: before each phase the kernels get its compute threads (compute_threads) and the
    # platform its fd_before_step, on the calling thread. None: neither (a check's engine, one thread).
    rank: RankContext | None = None
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    # The most prompts one step prefills (None: as many as the token budget allows; a platform may say 1).
    max_prefill_prompts: int | None = None
    prefix_caching: bool = True
    decoded_tokens: int = 0
    # Decode steps run eagerly although graphs are on: their batch was above the platform's largest capture size.
    eager_steps: int = 0
    # Steps whose decode rows rode in the prefill call beside its prompt chunks (a model that packs rows).
    mixed_steps: int = 0
    decode_s: float = 0.0
    # Core time this rank got while decoding (below decode_s: the machine was shared), and when the
    # first token of the first request was chosen (time.time()), for the time to first token.
    decode_core_s: float = 0.0
    first_token_at: float | None = None
    # Of the decode time: choosing tokens (the non-finite check and the sample op) and how many times (a per-step
    # breakdown).
    choose_s: float = 0.0
    choose_calls: int = 0
    steps: int = 0
    preemptions: int = 0
    # When a dict: every sequence's logits of each token it chose (float64 numpy rows by key), for checks that compare
    # the ways of computing a sequence (prefix hits, chunks, preemption) more closely than their tokens.
    trace: dict[int, list[Any]] | None = None
    # Every this many steps (0: never) the results of the step's all-reduces are fingerprinted into `fingerprint`:
    # (step, their sum, their absolute sum), which the session compares across ranks (FINGERPRINT_EVERY).
    fingerprint_every: int = 0
    fingerprint: tuple[int, float, float] | None = None
    # Speculative decoding (None: off): each step a sequence's proposer guesses its next tokens, and one step of the
    # model checks them all (_verify); how many were proposed and accepted, and in how many verify steps.
    speculation: Speculation | None = None
    # What guesses the tokens (None: the speculation's own, an NgramProposer; a draft's is built by the caller).
    proposer: Proposer | None = None
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0
    # Disaggregation (None: off): this rank's end of the KV transport, how long a hand-over may take, and what went
    # through it (prompt positions and bytes each way, and the seconds spent sending and receiving).
    transport: KVTransport | None = None
    transfer_timeout: float = 30.0
    kv_sent_tokens: int = 0
    kv_sent_bytes: int = 0
    kv_received_tokens: int = 0
    kv_received_bytes: int = 0
    transfer_s: float = 0.0
    _waiting: deque[_Seq] = field(default_factory=deque)
    _running: list[_Seq] = field(default_factory=list)  # in admission order
    _cancelled: set[int] = field(default_factory=set)
    _grammars: "Grammars | None" = None  # built at the first sequence with a grammar (SamplingParams.grammar)
    _order: Any = field(default_factory=count)
    _ended: list[Event] = field(default_factory=list)  # sequences scheduling ended (a hand-over it could not write)

    def __post_init__(self) -> None:
        context = self.runner.config.max_position_embeddings
        if self.memory is not None and self.memory.blocks is not None:
            blocks, block_size = self.memory.blocks, self.memory.block_size
        else:
            block_size = self.memory.block_size if self.memory is not None else 16
            blocks = self.max_batch * -(-context // block_size)
        # One block more than the plan's: block 0 is the null block padding writes to and tables are padded with. The
        # model's cache is allocated at the first step (the model may not be loaded yet).
        self.pool = BlockPool(blocks + 1, block_size, caching=self.prefix_caching)
        self.allocated = False
        self.block_size = block_size
        # The widest block table a sequence can need (the model's context), and the narrowest a decode step is captured
        # for (64 positions), for graph buckets: a power of two of blocks in between.
        self.max_table = -(-context // block_size)
        self.min_table = min(self.max_table, max(1, MIN_CAPTURED_POSITIONS // block_size))
        # The batch sizes the platform's graphs capture (Detection.capture_sizes; none: powers of two).
        self.capture_sizes = tuple(sorted(set(self.runner.backend.detection.capture_sizes)))
        if self.proposer is None and self.speculation is not None:
            if self.speculation.method != "ngram":
                raise ConfigError(f"{setting('speculative', self.speculation.method)} needs its proposer built with "
                                  f"the draft model (RankWorker builds it); pass Engine(proposer=...)")
            self.proposer = NgramProposer()
        model = self.runner.model
        if self.proposer is not None and model is not None and not callable(getattr(model, "prefill_every", None)):
            raise ConfigError(f"{setting('speculative')} checks proposals with the model's prefill_every (contract "
                              f"1.5), and {self.runner.arch.name}'s model has none: run without it")

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
        """Sequences waiting or running."""
        return len(self._waiting) + len(self._running)

    @property
    def running(self) -> list[int]:
        """The keys of the running sequences, in admission order."""
        return [seq.job.key for seq in self._running]

    def block_tables(self) -> dict[int, list[int]]:
        """The blocks each running sequence holds, in position order, by key."""
        return {seq.job.key: list(seq.blocks) for seq in self._running}

    def add(self, job: Job) -> None:
        """Queue a sequence; a later step admits it."""
        text = TextState(StreamDecoder(self.tokenizer), job.sampling.stop) if self.tokenizer else None
        eos = frozenset() if job.sampling.ignore_eos else frozenset(job.eos_ids)
        logprobs: list[TokenLogprob] | None = [] if job.sampling.logprobs is not None else None
        scoring = job.sampling.prompt_logprobs is not None
        # build_request refuses it first (here, on the engine's thread, it would fail the whole step).
        assert not (scoring and job.images), "prompt_logprobs with pictures"
        by_step = scoring and not scores_in_prefill(self.runner.model)
        seq = _Seq(job, Sampler(job.sampling, [job.index]), text, eos, list(job.prompt), order=0, logprobs=logprobs,
                   prompt_logprobs=[None] if scoring else None, by_step=by_step)
        handoff = job.handoff
        if handoff is not None and handoff.send_to is None:
            # Where the prefill instance left it: its tokens, their text, and its generator past their draws.
            seq.awaiting = True
            seq.ids += handoff.tokens
            if seq.logprobs is not None and handoff.logprobs is not None:
                seq.logprobs += handoff.logprobs
            if not job.sampling.greedy:
                for rng in seq.sampler.rngs:
                    rng.random(len(handoff.tokens))
            for i, token in enumerate(handoff.tokens):
                shown = text.push(token) if text is not None else ""
                logprob = handoff.logprobs[i] if seq.logprobs is not None and handoff.logprobs else None
                seq.handed.append(Event(job.key, token, shown, logprob=logprob))
        self._waiting.append(seq)

    def cancel(self, key: int) -> None:
        """End a sequence at the next step (its completion's finish_reason is "cancelled"); an unknown key is
        ignored."""
        self._cancelled.add(key)

    def reset(self) -> None:
        """Drop every sequence and its blocks (after a failed step: their state is unknown)."""
        for seq in self._running:
            self.pool.free(seq.blocks)
        for seq in self._waiting:
            self._discard(seq)
        self._waiting.clear()
        self._running.clear()
        self._cancelled.clear()

    def forget_prefixes(self) -> None:
        """Forget every cached prefix (after a weight reload their keys and values are stale)."""
        self.pool.forget_all()

    def kv_stats(self) -> dict[str, int]:
        """The pool and the scheduler's counts: blocks, blocks held, prefix tokens queried and found, preemptions, and
        the tokens speculation proposed and had accepted."""
        stats = self.pool.stats
        return {"blocks_total": self.pool.usable, "blocks_used": self.pool.used, "block_size": self.block_size,
                "prefix_cache_queried_tokens": stats.prefix_queried_tokens,
                "prefix_cache_hit_tokens": stats.prefix_hit_tokens, "preemptions": self.preemptions,
                "spec_proposed_tokens": self.spec_proposed, "spec_accepted_tokens": self.spec_accepted,
                "kv_sent_tokens": self.kv_sent_tokens, "kv_sent_bytes": self.kv_sent_bytes,
                "kv_received_tokens": self.kv_received_tokens, "kv_received_bytes": self.kv_received_bytes}

    def speculation_stats(self) -> dict[str, Any] | None:
        """How speculation went (None: off): the proposer, the most tokens it proposes a step, the tokens proposed
        and accepted, and the verify steps."""
        if self.speculation is None:
            return None
        return {"proposer": self.speculation.method, "k": self.speculation.tokens, "proposed": self.spec_proposed,
                "accepted": self.spec_accepted, "verify_steps": self.spec_steps}

    def step(self) -> list[Event]:
        """Retire the cancelled, schedule (blocks, preemption, admission, chunks), then run the step's prefill chunks
        and its decode tokens."""
        events: list[Event] = []
        if not self.allocated:
            self.runner.allocate_cache(self.pool.num_blocks, self.block_size)
            self.allocated = True
        try:
            self._retire(events)
            self._arrive(events)
            prefills, decodes = self._schedule()
            events += self._ended
            self._ended.clear()
            riders = self._riders(prefills, decodes)
            if riders:
                decodes = [seq for seq in decodes if seq not in riders]
                self._mixed([c for c in prefills if not c.seq.scored_in_prefill], riders, events)
                prefills = [c for c in prefills if c.seq.scored_in_prefill]
            if prefills:
                self._prefill(prefills, events)
            if decodes and self.proposer is not None:
                decodes = self._speculate(decodes, events)
            if decodes:
                self._decode(decodes, events)
        except BaseException:
            self.reset()
            raise
        self.steps += 1
        return events

    # -- scheduling --------------------------------------------------------------------------
    def _retire(self, events: list[Event]) -> None:
        if not self._cancelled:
            return
        cancelled, self._cancelled = self._cancelled, set()
        for seq in [s for s in self._waiting if s.job.key in cancelled]:
            self._waiting.remove(seq)
            self.pool.free(seq.blocks)
            self._discard(seq)
            seq.reason = "cancelled"
            events.append(self._finish(seq, final=False))
        for seq in [s for s in self._running if s.job.key in cancelled]:
            seq.reason = "cancelled"
            events.append(self._finish(seq, final=False))

    def _blocks_for(self, seq: _Seq, upto: int) -> int:
        """Blocks `seq` lacks to hold positions [0, upto)."""
        return max(0, -(-upto // self.block_size) - len(seq.blocks))

    def _preempt(self, seq: _Seq) -> None:
        """Take `seq` off the running batch, freeing its blocks; it waits first in line and is recomputed from its
        ids (its prompt and what it generated) when admitted again."""
        self._running.remove(seq)
        self.pool.free(seq.blocks)
        seq.blocks, seq.computed, seq.hashes, seq.admitted = [], 0, [], False
        self._waiting.appendleft(seq)
        self.preemptions += 1

    def _schedule(self) -> tuple[list[_Chunk], list[_Seq]]:
        """This step's prefill chunks and decode sequences, their blocks allocated.

        Fair shares: while another request's sequence waits or prefills, one request (Job.owner: its n choices, its
        prompts) holds at most half the batch's slots (its latest sequences past that are preempted, to be recomputed)
        and prefills at most half the step's prompt tokens, so that a short request behind a large one (eight
        1,000-token prompts scored, n=8) starts within a few steps."""
        budget = self.max_prefill_tokens
        prefills: list[_Chunk] = []
        decodes: list[_Seq] = []
        pictures = False
        slots = max(1, self.max_batch // 2)
        half = max(1, self.max_prefill_tokens // 2)
        held: dict[int | None, int] = {}
        for seq in self._running:
            held[seq.job.owner] = held.get(seq.job.owner, 0) + 1
        # A request past its share while another waits gives its latest sequences back (recomputed when readmitted).
        for seq in reversed(list(self._running)):
            owner = seq.job.owner
            if held[owner] > slots and any(w.job.owner != owner for w in self._waiting):
                self._preempt(seq)
                held[owner] -= 1
        spent: dict[int | None, int] = {}
        # Running sequences first, in admission order; the latest admitted gives its blocks up when they run out.
        index = 0
        while index < len(self._running):
            seq = self._running[index]
            if seq.pending == 1 or seq.stepwise:
                take = 1
            elif seq.job.images:
                if prefills:
                    index += 1
                    continue  # a prompt with pictures is prefilled alone, whole
                take = seq.pending
            else:
                take = self._chunk(seq, budget)
                if self._contested(seq.job.owner):
                    take = min(take, half - spent.get(seq.job.owner, 0))
                if take <= 0 or self._prompts_full(prefills) or self._scored_rows_full(seq, prefills):
                    index += 1
                    continue
            need = self._blocks_for(seq, seq.computed + take)
            while need > self.pool.available and self._running[-1] is not seq:
                self._preempt(self._running[-1])
            if need > self.pool.available:
                if len(self._running) == 1:
                    raise FdError(
                        f"a sequence of {len(seq.ids)} tokens needs more KV-cache blocks than the pool's "
                        f"{self.pool.usable}; raise --kv-cache-blocks or --memory-fraction"
                    )
                self._preempt(seq)
                continue
            seq.blocks += self.pool.allocate(need)
            if take == 1 and (seq.pending == 1 or seq.stepwise):
                decodes.append(seq)
            else:
                prefills.append(_Chunk(seq, take))
                pictures = pictures or bool(seq.job.images)
                budget -= min(budget, take)
                spent[seq.job.owner] = spent.get(seq.job.owner, 0) + take
            index += 1
        # Then the waiting, in order, while the batch, the budget and the blocks allow: nothing overtakes, but a
        # request past its share of the slots while another request waits, which goes first.
        index = 0
        while index < len(self._waiting) and len(self._running) < self.max_batch and not pictures:
            seq = self._waiting[index]
            owner = seq.job.owner
            if held.get(owner, 0) >= slots and any(w.job.owner != owner for w in self._waiting):
                index += 1
                continue
            if seq.awaiting:  # its keys and values are not here yet: the others are not held up by it
                index += 1
                continue
            if seq.parts is not None:  # its prompt's keys and values arrived: into its blocks, then it decodes
                need = self._blocks_for(seq, len(seq.ids))
                if need > self.pool.available:
                    break
                seq.blocks += self.pool.allocate(need)
                del self._waiting[index]
                try:
                    self._write_parts(seq)
                except Exception as exc:  # noqa: BLE001 - this sequence ends with it; the others go on
                    self.pool.free(seq.blocks)
                    seq.blocks, seq.parts = [], None
                    seq.reason, seq.failure = "error", SequenceFailure.of(exc)
                    self._ended.append(self._finish(seq, final=False))
                    continue
                seq.admitted, seq.order = True, next(self._order)
                self._running.append(seq)
                held[owner] = held.get(owner, 0) + 1
                decodes.append(seq)
                continue
            if seq.job.images and prefills:
                break
            if (not seq.job.images and budget <= 0) or self._prompts_full(prefills):
                break
            if self._sibling_prefilling(seq, prefills):
                break  # next step, once its prompt's blocks are published, it finds them cached
            hits = self._lookup(seq)
            take = 1 if seq.stepwise else seq.pending if seq.job.images else self._chunk(seq, budget)
            if not (seq.stepwise or seq.job.images) and self._contested(owner):
                take = min(take, half - spent.get(owner, 0))
                if take <= 0:
                    index += 1
                    continue
            if self._scored_rows_full(seq, prefills):
                break
            need = self._blocks_for(seq, seq.computed + take)
            if need > self.pool.available:
                self.pool.free(hits)
                seq.blocks, seq.computed, seq.hashes = [], 0, []
                break
            seq.blocks += self.pool.allocate(need)
            del self._waiting[index]
            seq.admitted, seq.order = True, next(self._order)
            self._running.append(seq)
            held[owner] = held.get(owner, 0) + 1
            if seq.pending == 1 or seq.stepwise:  # all but its last token found cached, or a token a step
                decodes.append(seq)
            else:
                prefills.append(_Chunk(seq, take))
                budget -= min(budget, take)
                spent[owner] = spent.get(owner, 0) + take
                pictures = bool(seq.job.images)
        return prefills, decodes

    # -- disaggregation ------------------------------------------------------------------------
    def _arrive(self, events: list[Event]) -> None:
        """Look, once a step, for the keys and values of each waiting sequence handed over from a prefill instance (the
        other sequences go on meanwhile). One whose parts are here on every rank becomes admissible; one whose parts
        did not come within transfer_timeout, or are not this model's, ends with an error on every rank."""
        awaiting = [s for s in self._waiting if s.awaiting]
        if not awaiting:
            return
        now = time.monotonic()
        problems: list[BaseException | None] = []
        for seq in awaiting:
            handoff = seq.job.handoff
            assert handoff is not None
            problem: BaseException | None = None
            try:
                if self.transport is None:
                    raise ConfigError(f"a handed-over request needs a KV transport on this instance: pass "
                                      f"{setting('kv_transport')}")
                seq.arrive_by = seq.arrive_by or now + self.transfer_timeout
                if seq.parts is None:
                    parts = self.transport.receive(handoff.key)
                    if parts is not None:
                        self._check_parts(seq, parts)
                        seq.parts = parts
                        self.kv_received_tokens += len(seq.job.prompt)
                        self.kv_received_bytes += sum(int(p.nbytes) for p in parts)
                if seq.parts is None and now > seq.arrive_by:
                    raise FdError(f"the keys and values of handed-over request {handoff.key!r} did not arrive within "
                                  f"{self.transfer_timeout:g} s; the prefill instance reports a hand-over only once "
                                  f"they are here: check that it sent them to this instance's transfer address")
            except Exception as exc:  # noqa: BLE001 - this sequence ends with it; the others go on
                problem = exc
            problems.append(problem)
        # Every rank decides alike: a sequence goes on once its parts are here on every rank, and ends on every rank
        # when any rank found them late or wrong.
        here = self._agree([int(seq.parts is not None) for seq in awaiting], every=True)
        failed = self._agree([int(p is not None) for p in problems], every=False)
        for seq, ready, fails, problem in zip(awaiting, here, failed, problems, strict=True):
            if fails:
                self._waiting.remove(seq)
                self._discard(seq)
                self._fail(seq, problem or FdError("another rank could not take this handed-over request's keys and "
                                                   "values (its error is in that rank's report)"), events)
            elif ready:
                seq.awaiting = False
                # Its stream begins with what the prefill instance chose, as if chosen here.
                events += seq.handed
                seq.handed = []

    def _agree(self, flags: list[int], every: bool) -> list[bool]:
        """Each flag combined over the ranks (one all-reduce at tp > 1): true on every rank (`every`), or on any."""
        if self.runner.backend.parallel.tp_size == 1 or not flags:
            return [bool(f) for f in flags]
        import numpy as np

        ranks = self.runner.backend.parallel.tp_size
        summed = self.runner.backend.all_reduce(host_tensor(np.asarray(flags, dtype=np.float32))).numpy()
        return [bool(v >= ranks - 0.5) if every else bool(v > 0.5) for v in summed.tolist()]

    def _discard(self, seq: _Seq) -> None:
        """A handed-over sequence that ends before its keys and values were taken: the transport drops them, and
        whatever still arrives under its key."""
        if seq.awaiting and seq.job.handoff is not None and self.transport is not None:
            self.transport.abort(seq.job.handoff.key)
        seq.awaiting, seq.parts = False, None

    def _check_parts(self, seq: _Seq, parts: list[Any]) -> None:
        """The parts are this model's at this rank: the prompt's length, the sender's identity (ModelRunner.identity:
        the same architecture, dtype, tp rank and weights), then a key and a value [prompt, kv_h, d] per layer in the
        cache's dtype (bfloat16 as its bits, uint16)."""
        prompt = len(seq.job.prompt)
        key = seq.job.handoff.key if seq.job.handoff is not None else "?"
        ours = self.runner.identity()
        theirs = bytes(parts[1]).decode(errors="replace") if len(parts) > 1 else "none"
        if theirs != ours:
            raise ConfigError(f"handed-over request {key!r}: the prefill instance computes with other weights or "
                              f"another model, dtype or tp ({theirs}; here {ours}): run both instances with the same "
                              f"model, checkpoint, dtype and tp")
        sent = parts[0].tolist()
        if sent != [prompt, _digest(seq.job.prompt)]:
            raise ConfigError(f"handed-over request {key!r}: the prefill instance prefilled other prompt ids "
                              f"({sent[0]} positions) than this request's ({prompt}): both instances must make the "
                              f"same ids of a request (the same checkpoint: tokenizer and chat template)")
        dtype = {"bfloat16": "uint16"}.get(self.runner.config.dtype, self.runner.config.dtype)
        shapes = self._handoff_shapes(prompt)
        if ([tuple(p.shape) for p in parts[2:]] != shapes
                or any(str(p.dtype) != dtype for p in parts[2:])):
            raise ConfigError(f"handed-over request {key!r}: the prefill instance sent keys and values that are not "
                              f"{len(shapes)} arrays of {shapes[0]} ({dtype}) for its prompt of {prompt} positions: "
                              f"its transport changed them; check it with fd's TransportSuite")

    def _handoff_shapes(self, positions: int) -> list[tuple[int, ...]]:
        """What read_kv gives for `positions` positions here: a key and a value [positions, kv_h, d] per layer."""
        config = self.runner.config
        heads = config.num_key_value_heads // self.runner.backend.parallel.tp_size
        return [(positions, heads, config.resolved_head_dim)] * (2 * config.num_hidden_layers)

    def _write_parts(self, seq: _Seq) -> None:
        """Its handed-over prompt's keys and values into its blocks (the model's write_kv); its prompt is computed."""
        assert seq.parts is not None
        prompt = len(seq.job.prompt)
        slots = self._prompt_slots(seq)
        dtype = self.runner.config.dtype
        parts = [host_tensor(p).astype(dtype) for p in seq.parts[2:]]
        self.runner.model.write_kv(slots, parts)  # type: ignore[union-attr]
        seq.parts, seq.computed = None, prompt
        self._publish(seq)

    def _hand_off(self, seq: _Seq) -> None:
        """Send its prompt's keys and values to the decode instance (its first token chosen), and wait until they are
        there on every rank: the caller then hands the request over, and the decode instance finds them at once."""
        handoff = seq.job.handoff
        assert handoff is not None and handoff.send_to is not None
        start = time.perf_counter()
        state, problem, sent = TransferState.FAILED, None, 0
        try:
            state, sent = self._send(seq, handoff.key, handoff.send_to)
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank has said how its part went
            problem = exc
        self.transfer_s += time.perf_counter() - start
        # Handed over only when every rank's part is there: one rank's failure fails the request on all of them.
        agreed = self._agree([int(problem is None and state is TransferState.DONE)], every=True)[0]
        if problem is not None:
            raise problem
        if not agreed:
            why = ("this rank's part went, another rank's did not" if state is TransferState.DONE
                   else f"it ended {state.value if state.final else 'unfinished'}")
            raise FdError(f"sending the keys and values of request {handoff.key!r} to {handoff.send_to!r} failed "
                          f"({why}): the decode instance is gone or does not listen there; its blocks here are freed")
        self.kv_sent_tokens += len(seq.job.prompt)
        self.kv_sent_bytes += sent

    def _send(self, seq: _Seq, key: str, peer: str) -> tuple[TransferState, int]:
        """Its prompt's keys and values read out (read_kv) and sent; the send's final state and its bytes."""
        import numpy as np

        if self.transport is None:
            raise ConfigError(f"handing a request over needs a KV transport on this instance: pass "
                              f"{setting('kv_transport')}")
        if seq.job.images:
            raise ConfigError("a prompt with pictures is not handed over yet (its pictures' positions): run it on an "
                              "instance that prefills and decodes")
        model = self.runner.model
        if not callable(getattr(model, "write_kv", None)) or not callable(getattr(model, "read_kv", None)):
            raise ConfigError(f"{self.runner.arch.name}'s model has no read_kv and write_kv (contract 1.9): its "
                              f"requests cannot be handed over; run prefill and decode on one instance")
        start = time.perf_counter()
        prompt = len(seq.job.prompt)
        slots = self._prompt_slots(seq)
        parts: list[Any] = [np.asarray([prompt, _digest(seq.job.prompt)], dtype=np.int64),
                            np.frombuffer(self.runner.identity().encode(), dtype=np.uint8)]
        parts += [np.ascontiguousarray(t.numpy()) for t in model.read_kv(slots)]  # type: ignore[union-attr]
        self.transport.send(key, peer, parts, self.transfer_timeout)
        state = self.transport.state(key)
        while state is TransferState.PENDING:
            if time.perf_counter() - start > self.transfer_timeout + 1.0:  # the transport's own timeout did not end it
                self.transport.abort(key)
                break
            time.sleep(0.0005)
            state = self.transport.state(key)
        return state, sum(int(p.nbytes) for p in parts)

    def _chunk(self, seq: _Seq, budget: int) -> int:
        """How many of a text prompt's pending tokens the step may prefill within `budget` (a scored prompt's at most
        SCORED_CHUNK: its logits come back for every position)."""
        return min(seq.pending, budget, SCORED_CHUNK if seq.scoring else budget)

    def _scored_rows_full(self, seq: _Seq, prefills: Sequence[_Chunk]) -> bool:
        """Whether `seq` is to be scored in its prefill and the step already prefills SCORED_ROWS such prompts."""
        return seq.scored_in_prefill and sum(c.seq.scored_in_prefill for c in prefills) >= SCORED_ROWS

    def _contested(self, owner: int | None) -> bool:
        """Whether a sequence of another request than `owner` waits, or has prompt tokens to prefill."""
        return (any(seq.job.owner != owner for seq in self._waiting)
                or any(seq.job.owner != owner and seq.pending > 1 for seq in self._running))

    def _sibling_prefilling(self, seq: _Seq, prefills: Sequence[_Chunk]) -> bool:
        """Whether another choice of its prompt is prefilling this step and it has a full block to share."""
        group = seq.job.group
        if group is None or not (self.prefix_caching and seq.cacheable) or len(seq.ids) <= self.block_size:
            return False
        return any(chunk.seq.job.group == group for chunk in prefills)

    def _prompts_full(self, prefills: Sequence[_Chunk]) -> bool:
        """Whether the step prefills as many prompts as it may (max_prefill_prompts)."""
        return self.max_prefill_prompts is not None and len(prefills) >= self.max_prefill_prompts

    def _lookup(self, seq: _Seq) -> list[int]:
        """Its prompt's leading full blocks found cached (held now), set as its first blocks and computed; a sequence
        always computes at least its last token, so the last block of a whole-block prompt is computed again."""
        if not (self.prefix_caching and seq.cacheable) or seq.scoring:  # a scored prompt needs every position
            return []
        full = (len(seq.ids) - 1) // self.block_size
        hashes: list[bytes] = []
        previous: bytes | None = None
        for i in range(full):
            previous = block_hash(previous, seq.ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(previous)
        hits = self.pool.lookup(hashes)
        if not seq.tokens:  # a new prompt (a preempted sequence's recompute is not a query)
            self.pool.stats.prefix_queried_tokens += len(seq.ids)
            self.pool.stats.prefix_hit_tokens += len(hits) * self.block_size
        seq.blocks, seq.computed, seq.hashes = list(hits), len(hits) * self.block_size, hashes[: len(hits)]
        return hits

    def _publish(self, seq: _Seq, ids: Sequence[int] | None = None) -> None:
        """Make its newly computed full blocks findable by their prefix hash (`ids`: its ids with the tokens a verify
        step accepted, before they go out)."""
        if not (self.prefix_caching and seq.cacheable):
            return
        ids = seq.ids if ids is None else ids
        full = seq.computed // self.block_size
        previous = seq.hashes[-1] if seq.hashes else None
        for i in range(len(seq.hashes), full):
            previous = block_hash(previous, ids[i * self.block_size:(i + 1) * self.block_size])
            seq.hashes.append(previous)
            self.pool.publish(seq.blocks[i], previous)

    # -- running a step ------------------------------------------------------------------------
    def _tables(self, seqs: Sequence[_Seq], width: int) -> Any:
        import numpy as np

        tables = np.full((len(seqs), width), NULL_BLOCK, dtype=np.int64)
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.blocks)] = seq.blocks
        return tables

    def _slot(self, seq: _Seq, position: int) -> int:
        return seq.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def _prompt_slots(self, seq: _Seq) -> Any:
        """The cache slots of its prompt's positions, as the model's read_kv and write_kv take them (a hand-over)."""
        import numpy as np

        return host_tensor(np.asarray([self._slot(seq, p) for p in range(len(seq.job.prompt))], dtype=np.int64))

    @contextlib.contextmanager
    def _fingerprinting(self) -> Iterator[None]:
        """On a fingerprinted step (fingerprint_every), every all-reduce the model calls adds its result's sum and
        absolute sum to `fingerprint`; the Backend's all-reduce is itself again afterwards."""
        if not self.fingerprint_every or self.steps % self.fingerprint_every:
            yield
            return
        backend = self.runner.backend
        real = backend.all_reduce
        sums = [0.0, 0.0]

        def fingerprinted(tensor: Any) -> Any:
            out = real(tensor)
            found = float_sums(out)  # every rank's copy of an all-reduce's result gives the same two numbers
            sums[0] += found[0]
            sums[1] += found[1]
            return out

        backend.all_reduce = fingerprinted
        try:
            yield
        finally:
            backend.all_reduce = real
        before = self.fingerprint if self.fingerprint is not None and self.fingerprint[0] == self.steps else None
        self.fingerprint = (self.steps, sums[0] + (before[1] if before else 0.0),
                            sums[1] + (before[2] if before else 0.0))

    def _use_threads(self, rows: int | None) -> None:
        """Compute the coming prefill (`rows` None) or decode step of `rows` rows on its phase's threads."""
        if self.rank is not None:
            set_compute_threads(self.rank.threads)
            self.runner.backend.before_step(self.rank, rows)

    def _riders(self, prefills: Sequence[_Chunk], decodes: Sequence[_Seq]) -> list[_Seq]:
        """The decode rows that ride in this step's prefill call beside its prompt chunks: one forward pass reads the
        weights once for both (stall-free batching), where the model packs rows (CausalModel.packs_rows: a one-token
        row costs one token, not the chunk's width). Not when decode steps are captured graphs (the replay is the
        faster), while speculating (the verify step is its own), beside pictures (prefilled alone) or for a prompt
        scored a token a step."""
        plain = [c for c in prefills if not c.seq.scored_in_prefill]
        if (not plain or not decodes or self.proposer is not None or self.runner.graphs_allowed
                or not getattr(self.runner.model, "packs_rows", False) or any(c.seq.job.images for c in plain)):
            return []
        return [seq for seq in decodes if not seq.stepwise]

    def _mixed(self, chunks: Sequence[_Chunk], riders: Sequence[_Seq], events: list[Event]) -> None:
        """Prompt chunks and decode rows in one prefill call. It counts as prefill time, its choosing included: the
        decode figures (tokens_per_s, the decode step's breakdown) stay those of decode-only steps, whose cost a
        rider's token does not have."""
        choose_s, choose_calls = self.choose_s, self.choose_calls
        self._prefill_batch([*chunks, *(_Chunk(seq, 1) for seq in riders)], events, every=False)
        self.choose_s, self.choose_calls = choose_s, choose_calls
        self.mixed_steps += 1

    def _prefill(self, chunks: Sequence[_Chunk], events: list[Event]) -> None:
        """The step's prompt chunks, right-padded into one batch (a prompt with pictures alone, whole), the chunks of
        scored prompts in a batch of their own that returns every position's logits; a chunk that finishes its
        sequence's pending tokens gives it its next token."""
        scored = [c for c in chunks if c.seq.scored_in_prefill]
        plain = [c for c in chunks if not c.seq.scored_in_prefill]
        if plain:
            self._prefill_batch(plain, events, every=False)
        if scored:
            self._prefill_batch(scored, events, every=True)

    def _prefill_batch(self, chunks: Sequence[_Chunk], events: list[Event], every: bool) -> None:
        """The chunks in one prefill call."""
        import numpy as np

        model = self.runner.model
        assert model is not None
        seqs = [c.seq for c in chunks]
        width = max(c.count for c in chunks)
        ids = np.full((len(chunks), width), PAD_ID, dtype=np.int64)
        slots = np.full((len(chunks), width), NULL_BLOCK * self.block_size, dtype=np.int64)
        for row, chunk in enumerate(chunks):
            seq, start = chunk.seq, chunk.seq.computed
            ids[row, : chunk.count] = seq.ids[start : start + chunk.count]
            slots[row, : chunk.count] = [self._slot(seq, p) for p in range(start, start + chunk.count)]
        batch = KVBatch(self._tables(seqs, max(len(s.blocks) for s in seqs)),
                        np.asarray([s.computed for s in seqs], dtype=np.int64),
                        np.asarray([c.count for c in chunks], dtype=np.int64), slots,
                        np.asarray([s.rope_delta for s in seqs], dtype=np.int64))
        image = list(seqs[0].job.images) if seqs[0].job.images else None
        self._use_threads(None)
        start_time = time.perf_counter()
        progress.report("prefill")
        with self._fingerprinting():
            if every:
                logits = self._scored_prefill(chunks, ids, batch, events)
            elif image is None:
                logits = model.prefill(ids, image, batch)
            else:
                # A prompt with pictures is prefilled alone: what its pictures fail on (the vision tower, their
                # placeholders) is its own, and every rank fails it alike (they hold the same pictures).
                try:
                    logits = model.prefill(ids, image, batch)
                except (ValueError, ConfigError, CheckpointError) as exc:  # what pictures are refused with
                    self.runner.add_time("prefill", time.perf_counter() - start_time)
                    self._fail(seqs[0], exc, events)
                    return
        self.runner.add_time("prefill", time.perf_counter() - start_time)
        done = []
        for row, chunk in enumerate(chunks):
            seq = chunk.seq
            if seq.failure is not None:  # ended while its prompt was scored: its blocks are gone
                continue
            seq.computed += chunk.count
            seq.rope_delta = int(batch.rope_deltas[row])
            self._publish(seq)
            if seq.pending == 0:
                done.append(row)
        if done:
            finished = [seqs[row] for row in done]
            picked = self._choose(logits, finished, done, events)
            for seq, token in zip(finished, picked, strict=True):
                if token is not None:
                    self._push(seq, token, events)

    def _scored_prefill(self, chunks: Sequence[_Chunk], ids: Any, batch: KVBatch, events: list[Event]) -> Any:
        """Scored prompts' chunks through the model's prefill_every: each position's logits score the prompt's next
        id (once: a prompt recomputed after a preemption scores nothing twice); the last positions' logits [B, vocab]
        returned for the rows that finish their prompts."""
        import numpy as np
        import paddle

        model = self.runner.model
        every = model.prefill_every(ids, batch)  # type: ignore[union-attr]
        rows, width = int(every.shape[0]), int(every.shape[1])
        last = (np.asarray(batch.lengths, dtype=np.int64) - 1) + np.arange(rows, dtype=np.int64) * width
        reporting = self.rank is None or self.rank.rank == 0
        asking: list[tuple[_Seq, int, list[int]]] = []  # (sequence, its row, the positions it scores now)
        for row, chunk in enumerate(chunks):
            seq, start = chunk.seq, chunk.seq.computed
            prompt = len(seq.job.prompt)
            # Position p's logits score prompt id p + 1, for the ids not scored yet.
            fresh = [p for p in range(start, start + chunk.count) if seq.scored <= p + 1 < prompt]
            if fresh:
                seq.scored = fresh[-1] + 2
                if reporting and seq.prompt_logprobs is not None:
                    asking.append((seq, row, fresh))
        # Every rank checks what it scores (a rank that stopped alone would leave the others waiting); only rank 0
        # computes the logprobs it reports, which fail no sequence (the ranks' decisions stay the same).
        for row, chunk in enumerate(chunks):
            check_finite(every[row, : chunk.count], self.steps, [True] * chunk.count)
        for seq, row, fresh in asking:
            start = fresh[0] - int(batch.starts[row])
            host = _host_rows(every[row], range(start, start + len(fresh)))
            assert seq.prompt_logprobs is not None
            seq.prompt_logprobs.extend(token_logprobs(host, [seq.ids[p + 1] for p in fresh],
                                                      [seq.job.sampling.prompt_logprobs or 0] * len(fresh)))
        flat = every.reshape([rows * width, int(every.shape[2])])
        return paddle.gather(flat, host_tensor(last))

    def _decode(self, seqs: Sequence[_Seq], events: list[Event]) -> None:
        """One token for every sequence whose prompt is done: the captured step of its (batch, table width) bucket
        when graphs are on (free rows ride along on the null block), else eagerly at exactly these sizes."""
        import numpy as np

        model = self.runner.model
        assert model is not None
        rows, width = len(seqs), max(len(s.blocks) for s in seqs)
        captured = capture_size(rows, self.capture_sizes, self.max_batch) if self.runner.graphs_allowed else None
        if captured is not None:
            rows, width = captured, _bucket(max(width, self.min_table), self.max_table)
        elif self.runner.graphs_allowed:
            self.eager_steps += 1  # above the platform's largest capture size
        # The phase's threads before a capture too: it traces what this step runs.
        self._use_threads(rows)
        if captured is not None:
            self.runner.ensure_captured(rows, width)
        tokens = np.full([rows, 1], PAD_ID, dtype=np.int64)
        starts = np.zeros(rows, dtype=np.int64)
        slots = np.zeros([rows, 1], dtype=np.int64)  # a free row writes the null block's first slot
        deltas = np.zeros(rows, dtype=np.int64)
        for row, seq in enumerate(seqs):
            # Its next uncomputed id: the last one, or a stepwise prompt's next.
            tokens[row, 0], starts[row] = seq.ids[seq.computed], seq.computed
            slots[row, 0], deltas[row] = self._slot(seq, seq.computed), seq.rope_delta
        tables = self._tables(seqs, width)
        if rows > len(seqs):
            tables = np.concatenate([tables, np.zeros((rows - len(seqs), width), dtype=np.int64)])
        batch = KVBatch(tables, starts, np.ones(rows, dtype=np.int64), slots, deltas)
        start, core_start = time.perf_counter(), time.process_time()
        progress.report("decode")
        # A captured step is replayed, not called: nothing to fingerprint (nor to trace a wrapper into).
        with self._fingerprinting() if captured is None else contextlib.nullcontext():
            logits = model.decode_step(tokens, batch)
        for seq in seqs:
            seq.computed += 1
            self._publish(seq)
        prompting = [row for row, seq in enumerate(seqs) if seq.pending > 0]
        if prompting:
            self._score(logits, [seqs[row] for row in prompting], prompting)
        at = [row for row, seq in enumerate(seqs) if seq.pending == 0]
        choosing = [seqs[row] for row in at]
        picked = self._choose(logits, choosing, at, events) if choosing else []
        for seq, token in zip(choosing, picked, strict=True):
            if token is not None:
                self._push(seq, token, events)
        elapsed = time.perf_counter() - start
        self.runner.add_time("decode", elapsed)
        self.decode_s += elapsed
        self.decode_core_s += time.process_time() - core_start
        self.decoded_tokens += sum(token is not None for token in picked)

    # -- speculative decoding -------------------------------------------------------------------
    def _speculate(self, seqs: Sequence[_Seq], events: list[Event]) -> list[_Seq]:
        """Ask the proposer for each decoding sequence's next tokens; when any proposes, verify every sequence that may
        speculate in one step (those proposing nothing ride along a position each) and return the rest (a prompt
        still scored a token a step, a grammar not started yet) for the plain decode step."""
        assert self.proposer is not None and self.speculation is not None
        able = [seq for seq in seqs
                if not seq.stepwise and (seq.job.sampling.grammar is None or seq.constraint is not None)]
        context = self.max_table * self.block_size
        rooms = []
        for seq in able:
            room = min(seq.depth or self.speculation.tokens, seq.job.sampling.max_new_tokens - len(seq.tokens) - 1,
                       context - seq.computed - 1)
            if seq.wait > 0:
                seq.wait -= 1
                room = 0
            rooms.append(max(0, room))
        # A proposer that guesses for many sequences at once (a draft model's batch) is asked once. Its time is decode
        # time: a draft model's steps are part of what a token costs.
        begin = time.perf_counter()
        many = getattr(self.proposer, "propose_many", None)
        if many is not None and any(rooms):
            guesses = many([(seq.ids, room) for seq, room in zip(able, rooms, strict=True)])
        else:
            guesses = [self.proposer.propose(seq.ids, room) if room else [] for seq, room in zip(able, rooms,
                                                                                                   strict=True)]
        proposals: list[list[int]] = []
        masks: dict[int, list[Any]] = {}
        for n, (seq, room, guess) in enumerate(zip(able, rooms, guesses, strict=True)):
            # The blocks its proposals' keys and values go to, as far as the pool has them (no preemption for a guess).
            fits = (len(seq.blocks) + self.pool.available) * self.block_size - seq.computed - 1
            guess = [int(t) for t in guess[: max(0, min(room, fits))]]
            if seq.constraint is not None:
                # A grammar masks every position; a proposal it forbids could never be accepted: the run ends there.
                try:
                    taken, masks[n] = seq.constraint.ahead(guess)
                except Exception as exc:  # noqa: BLE001 - the sequence ends with its grammar's error; the others go on
                    self._fail(seq, exc, events)
                    proposals.append([])
                    continue  # its blocks went back with it
                guess = guess[:taken]
            seq.blocks += self.pool.allocate(self._blocks_for(seq, seq.computed + 1 + len(guess)))
            proposals.append(guess)
        spent = time.perf_counter() - begin
        self.runner.add_time("propose", spent)
        self.decode_s += spent
        if not any(proposals):
            return [seq for seq in seqs if seq.reason is None]
        kept = [n for n, seq in enumerate(able) if seq.reason is None]
        self._verify([able[n] for n in kept], [proposals[n] for n in kept], events,
                     [masks.get(n) for n in kept])
        return [seq for seq in seqs if seq not in able]

    def _verify(self, seqs: Sequence[_Seq], proposals: Sequence[list[int]], events: list[Event],
                masks: Sequence[list[Any] | None]) -> None:
        """One step of the model over each sequence's last token and its proposals (the prefill path over its cached
        prefix, every position's logits), then the accept_draft op: the accepted proposals and one token more go out
        as they would have one a step; the blocks past what was accepted go back to the pool."""
        import numpy as np

        model = self.runner.model
        assert model is not None
        counts = [1 + len(guess) for guess in proposals]
        rows, width = len(seqs), max(counts)
        ids = np.full((rows, width), PAD_ID, dtype=np.int64)
        slots = np.full((rows, width), NULL_BLOCK * self.block_size, dtype=np.int64)
        for row, (seq, guess) in enumerate(zip(seqs, proposals, strict=True)):
            ids[row, : counts[row]] = [seq.ids[seq.computed], *guess]
            slots[row, : counts[row]] = [self._slot(seq, p) for p in range(seq.computed, seq.computed + counts[row])]
        batch = KVBatch(self._tables(seqs, max(len(s.blocks) for s in seqs)),
                        np.asarray([s.computed for s in seqs], dtype=np.int64), np.asarray(counts, dtype=np.int64),
                        slots, np.asarray([s.rope_delta for s in seqs], dtype=np.int64))
        self._use_threads(None)  # several positions a row: the library products of a prefill, not a one-row step's
        start, core_start = time.perf_counter(), time.process_time()
        progress.report("decode")
        with self._fingerprinting():
            logits = model.prefill_every(ids, batch)  # type: ignore[attr-defined]
        for row, positions in enumerate(counts):
            check_finite(logits[row, :positions], self.steps, [True] * positions)
        chosen, logprobs = self._accept(logits, seqs, proposals, events, masks)
        emitted = 0
        for n, (seq, guess, tokens) in enumerate(zip(seqs, proposals, chosen, strict=True)):
            if tokens is None:
                continue
            accepted = len(tokens) - 1
            self.spec_proposed += len(guess)
            self.spec_accepted += accepted
            if guess:
                seq.misses = 0 if accepted else seq.misses + 1
                seq.wait = min(BACKOFF_MAX, (1 << seq.misses) - 1)
                # Propose as far as the last verify kept, one more after a run kept whole: each position scored costs
                # compute once the step is bound by arithmetic (a batch of several).
                assert self.speculation is not None  # a verify step runs only under speculation
                limit = self.speculation.tokens
                seq.depth = min(limit, (seq.depth or limit) + 1) if accepted == len(guess) else accepted + 1
            # Its last token and the accepted proposals are in the cache now (what the rejected wrote is past them):
            # their full blocks are published before the tokens go out, as a decode step's are, even if one ends it.
            seq.computed += 1 + accepted
            self._publish(seq, [*seq.ids, *tokens[:accepted]])
            for i, token in enumerate(tokens):
                if seq.reason is not None:
                    break
                if n in logprobs and seq.logprobs is not None:
                    seq.logprobs.append(logprobs[n][i])
                if self.trace is not None:
                    self.trace.setdefault(seq.job.key, []).append(
                        np.asarray(_host_rows(logits[n], [i])[0], dtype=np.float64))
                self._push(seq, token, events)
                emitted += 1
            if seq.reason is None:
                keep = -(-seq.computed // self.block_size)
                self.pool.free(seq.blocks[keep:])
                del seq.blocks[keep:]
        elapsed = time.perf_counter() - start
        self.runner.add_time("decode", elapsed)
        self.decode_s += elapsed
        self.decode_core_s += time.process_time() - core_start
        self.decoded_tokens += emitted
        self.spec_steps += 1

    def _accept(self, logits: Any, seqs: Sequence[_Seq], proposals: Sequence[list[int]], events: list[Event],
                masks: Sequence[list[Any] | None]) -> tuple[list[list[int] | None], dict[int, list[TokenLogprob]]]:
        """Each sequence's accepted proposals and next token through the Backend's accept_draft op (None for one that
        failed on its own): greedy rows that process nothing in one call; the others each with their own settings,
        their logits processed position by position as if the proposals before it had been chosen (a grammar's masks
        last); and the logprobs of those tokens by index, for the sequences that ask."""

        import numpy as np

        begin = time.perf_counter()
        accept = self.runner.backend.ops.accept_draft
        out: list[list[int] | None] = [None] * len(seqs)
        found: dict[int, list[TokenLogprob]] = {}
        plain = [n for n, seq in enumerate(seqs) if seq.job.sampling.greedy and not seq.job.sampling.processed]
        if plain:
            picked = logits if len(plain) == len(seqs) else logits[plain]
            greedy = accept(picked, [proposals[n] for n in plain], 0.0, 0, 1.0,
                            [[0.0] * (len(proposals[n]) + 1) for n in plain], None)
            for n, tokens in zip(plain, greedy, strict=True):
                out[n] = [int(t) for t in tokens]
        for n, (seq, guess) in enumerate(zip(seqs, proposals, strict=True)):
            if n in plain:
                continue
            p, count = seq.job.sampling, len(guess) + 1
            try:
                rows = _host_rows(logits[n], range(count))
                if p.processed:
                    outputs = [seq.tokens + guess[:i] for i in range(count)]
                    rows = process_logits(rows, [p] * count, [seq.job.prompt] * count, outputs, [seq.eos] * count,
                                          self._penalize)
                mask = masks[n]
                if mask is not None:
                    rows = np.where(np.stack(mask[:count]), rows, np.float32(-np.inf))
                draws = [0.0] * count if p.greedy else [float(u) for u in seq.sampler.rngs[0].random(count)]
                tokens = accept(host_tensor(rows[None]), [guess], p.temperature, p.top_k, p.top_p, [draws], None)[0]
                out[n] = [int(t) for t in tokens]
            except Exception as exc:  # noqa: BLE001 - the sequence ends with it; the others go on
                self._fail(seq, exc, events)
        # Only rank 0 reports logprobs (computing them fails no sequence: every rank ends the same ones).
        reporting = self.rank is None or self.rank.rank == 0
        for n, (seq, tokens) in enumerate(zip(seqs, out, strict=True)):
            if tokens is not None and seq.logprobs is not None and reporting:
                raw = _host_rows(logits[n], range(len(tokens)))
                found[n] = token_logprobs(raw, tokens, [seq.job.sampling.logprobs or 0] * len(tokens))
        self.choose_s += time.perf_counter() - begin
        self.choose_calls += 1
        return out, found

    def _score(self, logits: Any, seqs: Sequence[_Seq], at: Sequence[int]) -> None:
        """Stepwise prompts (sequence i at row at[i] of logits [B, vocab]) whose step computed position p: the
        logprob of their prompt's id p + 1 given the ids before it, appended once (a recomputed prompt, after a
        preemption, scores nothing twice)."""
        self._check_rows(logits, at)
        fresh = [(seq, i) for seq, i in zip(seqs, at, strict=True) if seq.computed == seq.scored]
        for seq, _ in fresh:
            seq.scored += 1
        if not (self.rank is None or self.rank.rank == 0):
            return  # only rank 0 reports logprobs; every rank counts what is scored alike
        asking = [(seq, i) for seq, i in fresh if seq.prompt_logprobs is not None]
        if asking:
            rows = _host_rows(logits, [i for _, i in asking])
            found = token_logprobs(rows, [seq.ids[seq.computed] for seq, _ in asking],
                                   [seq.job.sampling.prompt_logprobs or 0 for seq, _ in asking])
            for (seq, _), logprob in zip(asking, found, strict=True):
                assert seq.prompt_logprobs is not None
                seq.prompt_logprobs.append(logprob)

    def _check_rows(self, logits: Any, at: Sequence[int]) -> None:
        """check_finite on the rows `at` of logits [B, vocab] (the others are padding or not read)."""
        live = [False] * int(logits.shape[0])
        for i in at:
            live[i] = True
        check_finite(logits, self.steps, live)

    def _choose(self, logits: Any, seqs: Sequence[_Seq], at: Sequence[int], events: list[Event]) -> list[int | None]:
        """Each sequence's next token from logits [B, vocab] (sequence i at row at[i]) through the Backend's sample op,
        once its rows' logits are known to be finite; a sequence whose sampling asks for logprobs gets the token's
        appended to its own (the rows that do not ask cost nothing). None for a sequence that failed on its own (its
        grammar, bias, sampling or logprobs): it ended with its error, the others go on."""
        start = time.perf_counter()
        self._check_rows(logits, at)
        if self.trace is not None:
            import numpy as np

            host = logits.astype("float32").numpy() if hasattr(logits, "numpy") else logits
            rows = np.asarray(host, dtype=np.float64)
            for seq, i in zip(seqs, at, strict=True):
                self.trace.setdefault(seq.job.key, []).append(rows[i])
        ops = self.runner.backend.ops
        sample = ops.sample
        processed, failed = self._process(logits, seqs, at, events)
        chosen: list[int | None]
        if not processed and all(seq.job.sampling.greedy for seq in seqs):
            # One call for the whole batch: greedy draws nothing, so the rows need no sampler of their own.
            every = sample(logits, 0.0, 0, 1.0, [0.0] * int(logits.shape[0]))
            if len(every) == int(logits.shape[0]):
                chosen = [None if n in failed else int(every[i]) for n, i in enumerate(at)]
            else:  # a kernel that answered for another number of rows: found row by row, its sequences failed alone
                chosen = self._draw(logits, seqs, at, processed, failed, events)
        else:
            chosen = self._draw(logits, seqs, at, processed, failed, events)
        # Only rank 0 reports them (the others send their tokens alone); computing them fails no sequence, so every
        # rank ends the same sequences.
        reporting = self.rank is None or self.rank.rank == 0
        asking = [(n, token, kept) for n, (seq, token) in enumerate(zip(seqs, chosen, strict=True))
                  if (kept := seq.logprobs) is not None and token is not None and reporting]
        if asking:
            # The raw logits of the asking rows only, to the host as float32; the log-softmax in float64 there.
            rows = _host_rows(logits, [at[n] for n, _, _ in asking])
            found = token_logprobs(rows, [token for _, token, _ in asking],
                                   [seqs[n].job.sampling.logprobs or 0 for n, _, _ in asking])
            for (_, _, kept), logprob in zip(asking, found, strict=True):
                kept.append(logprob)
        self.choose_s += time.perf_counter() - start
        self.choose_calls += 1
        return chosen

    def _draw(self, logits: Any, seqs: Sequence[_Seq], at: Sequence[int], processed: dict[int, Any], failed: set[int],
              events: list[Event]) -> list[int | None]:
        """Each sequence's token through one sample call for all the rows that share temperature, top-k and top-p
        (the op takes a batch: a device kernel draws them together), each row at its own sequence's uniform. Those
        are drawn once, before the call: a call that fails is retried row by row (_each) at the same numbers, so the
        sequences it does not fail for get the tokens they would have got."""
        import paddle

        sample = self.runner.backend.ops.sample
        chosen: list[int | None] = [None] * len(seqs)
        # Rows processed on the host apart from the model's own (which may be on a device): one call never mixes them.
        groups: dict[tuple[float, int, float, bool], list[int]] = {}
        for n, seq in enumerate(seqs):
            if n not in failed:
                p = seq.job.sampling
                params = (0.0, 0, 1.0) if p.greedy else (p.temperature, p.top_k, p.top_p)
                groups.setdefault((*params, n in processed), []).append(n)
        whole = list(at) == list(range(int(logits.shape[0])))
        for (temperature, top_k, top_p, _), members in groups.items():
            rows = [processed[n] if n in processed else logits[at[n] : at[n] + 1] for n in members]
            uniforms = [seqs[n].sampler.uniforms()[0] for n in members]
            # Every row of the logits, in order, in one group: the logits as they are, no copy.
            everyone = logits if whole and len(members) == len(seqs) and not processed else None

            def draw(picked: list[int], rows: list[Any] = rows, uniforms: list[float] = uniforms,
                     params: tuple[float, int, float] = (temperature, top_k, top_p), everyone: Any = everyone,
                     ) -> list[int]:
                if everyone is not None and len(picked) == len(rows):
                    batch = everyone
                else:
                    batch = rows[picked[0]] if len(picked) == 1 else paddle.concat([rows[k] for k in picked])
                out = [int(t) for t in sample(batch, *params, [uniforms[k] for k in picked])]
                if len(out) != len(picked):
                    raise PluginError(f"sample returned {len(out)} token(s) for {len(picked)} row(s); a kernel must "
                                      f"return one token a row (kernels.OPS)")
                return out

            for n, token in zip(members, self._each([seqs[n] for n in members], events, draw), strict=True):
                chosen[n] = token
        return chosen

    def _process(self, logits: Any, seqs: Sequence[_Seq], at: Sequence[int],
                 events: list[Event]) -> tuple[dict[int, Any], set[int]]:
        """({index in seqs: its logits row [1, V] as a tensor}, the indexes that failed) for the sequences whose
        sampling changes the logits before the sample op (penalties through the Backend's apply_penalties op, bias,
        min_tokens, min_p, grammar). A sequence that fails there ends with its own error (_fail)."""
        asking = [n for n, seq in enumerate(seqs) if seq.job.sampling.processed]
        if not asking:
            return {}, set()

        chosen = [seqs[n] for n in asking]
        raw = _host_rows(logits, [at[n] for n in asking])
        rows = self._each(chosen, events, lambda picked: list(process_logits(
            raw[picked], [chosen[k].job.sampling for k in picked], [chosen[k].job.prompt for k in picked],
            [chosen[k].tokens for k in picked], [chosen[k].eos for k in picked], self._penalize)))
        out: dict[int, Any] = {}
        for n, seq, row in zip(asking, chosen, rows, strict=True):
            if row is None:
                continue
            if seq.job.sampling.grammar is not None:
                try:
                    row = self._constraint(seq, int(row.shape[0])).mask(row)
                except Exception as exc:  # noqa: BLE001 - the sequence ends with it; the others go on
                    self._fail(seq, exc, events)
                    continue
            out[n] = host_tensor(row[None, :])
        return out, {n for n in asking if n not in out}

    def _penalize(self, *arrays: Any) -> Any:
        """The Backend's apply_penalties op on host arrays, as process_logits calls it: given as the op's semantics give
        them (output_counts int32), which the suite's cases check a kernel with; the new logits back on the host."""
        return self.runner.backend.ops.apply_penalties(*(host_tensor(a) for a in arrays)).numpy()

    def _each(self, seqs: Sequence[_Seq], events: list[Event], fn: Callable[[list[int]], Sequence[Any]]) -> list[Any]:
        """fn(indexes) over every sequence at once (one result per index, in order); when that fails, over each alone,
        so that a sequence it fails for ends with its own error (its result None) and the others get theirs."""
        try:
            return list(fn(list(range(len(seqs)))))
        except Exception:  # noqa: BLE001 - found below, sequence by sequence
            pass
        out: list[Any] = []
        for n, seq in enumerate(seqs):
            try:
                out.append(fn([n])[0])
            except Exception as exc:  # noqa: BLE001 - the sequence ends with it; the others go on
                self._fail(seq, exc, events)
                out.append(None)
        return out

    def _fail(self, seq: _Seq, exc: BaseException, events: list[Event]) -> None:
        """End `seq` alone with what it failed on (finish_reason "error"); its blocks are freed, the step goes on."""
        seq.reason, seq.failure = "error", SequenceFailure.of(exc)
        events.append(self._finish(seq, final=False))

    def _constraint(self, seq: _Seq, vocab: int) -> "Constraint":
        """Its grammar's constraint, made at its first token from the engine's Grammars (built once: it reads every
        token of the vocabulary)."""
        if seq.constraint is None:
            from fd_core.runtime.text.grammar import grammars_for

            if self.tokenizer is None:
                raise ConfigError("structured output needs the checkpoint's tokenizer, and it has none")
            if self._grammars is None:
                self._grammars = grammars_for(self.tokenizer, vocab, seq.job.eos_ids or None)
            seq.constraint = self._grammars.matcher(seq.job.sampling.grammar or "")
            for token in seq.tokens:  # a handed-over sequence's tokens, chosen under the same grammar there
                seq.constraint.advance(token)
        return seq.constraint

    def _push(self, seq: _Seq, token: int, events: list[Event]) -> None:
        """A sequence's new token: its text, and whether it ends the sequence (then its blocks are freed); its event
        carries the token's logprob data when its sampling asks (_choose appended it)."""
        if self.first_token_at is None:
            self.first_token_at = time.time()
        try:
            self._take(seq, token, events)
        except Exception as exc:  # noqa: BLE001 - its text, stop or grammar state failed: it ends, the others go on
            if not any(e.key == seq.job.key and e.done is not None for e in events):  # not ended already
                self._fail(seq, exc, events)

    def _take(self, seq: _Seq, token: int, events: list[Event]) -> None:
        seq.ids.append(token)
        logprob = seq.logprobs[-1] if seq.logprobs else None
        shown = ""
        if token in seq.eos:
            seq.reason = "eos"
        elif seq.text is not None:
            shown = seq.text.push(token)
            if seq.text.stopped:
                seq.reason = "stop"
        if seq.constraint is not None and seq.reason is None:
            seq.constraint.advance(token)  # allowed: the mask let nothing else through
            if seq.constraint.done:
                seq.reason = "stop"  # the output is complete: only an end-of-sequence id could follow
        if seq.reason is None and len(seq.tokens) >= seq.job.sampling.max_new_tokens:
            seq.reason = "length"
        if seq.reason is None and seq.job.handoff is not None and seq.job.handoff.send_to is not None:
            self._hand_off(seq)
            seq.reason = "handoff"
        # The first token's event brings the prompt's logprobs, which are whole from then on.
        scored = None
        if seq.prompt_logprobs is not None and len(seq.tokens) == 1:
            scored = tuple(seq.prompt_logprobs)
        if seq.reason is None:
            events.append(Event(seq.job.key, token, shown, logprob=logprob, prompt_logprobs=scored))
            return
        end = self._finish(seq, final=True)
        events.append(Event(seq.job.key, token, shown + end.text, end.done, logprob, scored))

    def _finish(self, seq: _Seq, final: bool) -> Event:
        """Free its blocks; its completion, with the rest of its text when it ended by itself."""
        if seq in self._running:
            self._running.remove(seq)
            self.pool.free(seq.blocks)
        seq.blocks = []
        state = seq.text
        rest = state.finish() if state is not None and final else ""
        text = None if state is None else (state.text if final else state.text[: state.shown])
        assert seq.reason is not None
        logprobs = None if seq.logprobs is None else list(seq.logprobs)
        scored = None if seq.prompt_logprobs is None else list(seq.prompt_logprobs)
        return Event(seq.job.key, None, rest,
                     Completion(list(seq.job.prompt), seq.tokens, text, seq.reason, logprobs, scored, seq.failure))
