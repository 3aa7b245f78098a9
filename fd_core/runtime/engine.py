"""Batched generation on one rank: left-padded prefill, one captured decode graph per batch size,
sampling, and per-sequence stopping at end-of-sequence ids, stop strings or the token limit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Sequence

from fd_core.errors import NumericsError
from fd_core.runtime import progress
from fd_core.runtime.lifecycle import ModelRunner
from fd_core.runtime.memory import MemoryPlan, cache_length
from fd_core.runtime.request import Request
from fd_core.runtime.sampling import Sampler
from fd_core.runtime.streaming import StreamDecoder, TextState

if TYPE_CHECKING:
    from fd_core.runtime.tokenizer import Tokenizer

PAD_ID = 0  # what fills a shorter prompt's left padding (masked; any id in the vocabulary would do)


@dataclass
class Completion:
    """One prompt's output: the generated ids, their text (None without a tokenizer), and why it ended.

    `finish_reason` is "eos" (an end-of-sequence id, kept as the last id), "stop" (a stop string; the
    text is cut before it) or "length" (max_new_tokens reached).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "ids": self.token_ids, "finish_reason": self.finish_reason, "prompt_tokens": len(self.prompt_ids)}


def check_finite(logits: Any, step: int, live: Sequence[bool]) -> None:
    """Non-finite logits [B, vocab] of a sequence still generating stop the run instead of becoming a plausible token.

    The test runs where the logits are (one isfinite-and-all reduction): one bool per row comes to
    the host, not the vocabulary (400 KB a row at 100k tokens); the count is taken on failure only.
    Where the logits are host memory already a copy would cost less (0.03 ms against the two ops'
    0.09 ms for a 103424-token row on a 2-core host): a step's rounding error either way.
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
            f"step {step} produced {count} non-finite logit(s) (NaN or Inf) for prompt {bad[0] + 1}; the weights, the inputs or "
            f"the platform's kernels or all-reduce produce non-finite numbers (fd check tests the all-reduce)"
        )


@dataclass
class Engine:
    """The one generation loop: every caller (fd run, LLM, fd check, the reference tests, the benchmarks)
    generates through it, with a loaded and decided ModelRunner; it yields text as it is produced."""

    runner: ModelRunner
    tokenizer: "Tokenizer | None" = None
    max_batch: int = 8
    decoded_tokens: int = 0
    decode_s: float = 0.0
    # Core time this rank got while decoding (below decode_s: the machine was shared), and when the
    # first token of the first request was chosen (time.time()), for the time to first token.
    decode_core_s: float = 0.0
    first_token_at: float | None = None
    # Of the decode time: choosing tokens (the non-finite check and the sample op) and how many times (a per-step breakdown).
    choose_s: float = 0.0
    choose_calls: int = 0
    # The plan's KV-cache capacity: prompts decode together in batches whose cache fits it (None: up to max_batch).
    memory: MemoryPlan | None = None

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput of everything generated so far (tokens from decode steps, all sequences)."""
        return self.decoded_tokens / self.decode_s if self.decode_s > 0 else 0.0

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
        """Yields (prompt index, new text) while generating; returns every completion."""
        pictures = list(request.images)
        # Prompts with pictures run one at a time (their rotary positions are not padded); text in batches.
        size = 1 if pictures else self.max_batch
        if self.memory is not None and request.prompts:
            longest = max(len(p) for p in request.prompts)
            size = self.memory.batch_size(size, self._cache_len(longest + request.sampling.max_new_tokens))
        results: list[Completion] = []
        for first in range(0, len(request.prompts), size):
            rows = list(range(first, min(first + size, len(request.prompts))))
            results += yield from self._batch(request, rows, pictures or None)
        return results

    def _cache_len(self, needed: int) -> int:
        return cache_length(needed, self.runner.config.max_position_embeddings)

    def _choose(self, logits: Any, step: int, live: Sequence[bool], sampler: Sampler) -> list[int]:
        """Each row's next token through the Backend's sample op, once its live rows' logits are known to be finite."""
        start = time.perf_counter()
        check_finite(logits, step, live)
        chosen = sampler.choose(logits, self.runner.backend.ops.sample)
        self.choose_s += time.perf_counter() - start
        self.choose_calls += 1
        return chosen

    def _batch(self, request: Request, rows: Sequence[int], image: Any) -> Generator[tuple[int, str], None, list[Completion]]:
        import numpy as np

        model, params = self.runner.model, request.sampling
        assert model is not None
        prompts = [list(request.prompts[i]) for i in rows]
        width = max(map(len, prompts))
        pads = [width - len(p) for p in prompts]
        ids = np.asarray([[PAD_ID] * pad + p for pad, p in zip(pads, prompts, strict=True)], dtype="int64")
        length = model.prefill_length(ids, image)
        self.runner.prepare(len(rows), self._cache_len(length + params.max_new_tokens))
        sampler = Sampler(params, rows)
        texts = [TextState(StreamDecoder(self.tokenizer), params.stop) if self.tokenizer else None for _ in rows]
        tokens: list[list[int]] = [[] for _ in rows]
        reasons: list[str | None] = [None] * len(rows)
        eos = set() if params.ignore_eos else set(request.eos_ids)

        start = time.perf_counter()
        progress.report("prefill")
        logits = model.prefill(ids, image, pad=pads) if any(pads) else model.prefill(ids, image)
        self.runner.add_time("prefill", time.perf_counter() - start)
        decode_s, decoded = 0.0, 0
        core_start = time.process_time()
        for step in range(params.max_new_tokens):
            start = time.perf_counter()
            progress.report("decode")
            chosen = self._choose(logits, step, [reasons[b] is None for b in range(len(rows))], sampler)
            if self.first_token_at is None:
                self.first_token_at = time.time()
            for b, token in enumerate(chosen):
                if reasons[b] is not None:
                    continue
                tokens[b].append(token)
                state = texts[b]
                if token in eos:
                    reasons[b] = "eos"
                elif state is not None:
                    shown = state.push(token)
                    if shown:
                        yield rows[b], shown
                    if state.stopped:
                        reasons[b] = "stop"
                if reasons[b] is None and len(tokens[b]) == params.max_new_tokens:
                    reasons[b] = "length"
            if step:
                decode_s += time.perf_counter() - start
                decoded += sum(1 for b in range(len(rows)) if len(tokens[b]) == step + 1)
            if all(r is not None for r in reasons):
                break
            start = time.perf_counter()
            # Finished sequences ride along (fixed batch shape for the captured graph); their tokens are dropped.
            logits = model.decode_step(np.asarray(chosen, dtype="int64").reshape(-1, 1), length + step)
            decode_s += time.perf_counter() - start
        self.runner.add_time("decode", decode_s)
        self.decode_s += decode_s
        self.decode_core_s += time.process_time() - core_start
        self.decoded_tokens += decoded
        completions = []
        for b, row in enumerate(rows):
            state = texts[b]
            if state is not None:
                rest = state.finish()
                if rest:
                    yield row, rest
            completions.append(Completion(prompts[b], tokens[b], state.text if state else None, reasons[b] or "length"))
        return completions
