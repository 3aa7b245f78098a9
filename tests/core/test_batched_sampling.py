"""Drawn sampling over the batch: the rows that share temperature, top-k and top-p reach the sample op in one call,
each at its own sequence's uniform. The oracle is the same request decoded one sequence at a time (max_batch 1: every
call one row); a batched call that fails is retried row by row at the same numbers, with the same tokens."""

from __future__ import annotations

from typing import Any

import numpy as np

from fd_core.runtime.engine.sampling import SamplingParams
from fd_core.runtime.request import Request
from tiny_engine import tiny_engine

PROMPTS = [tuple(int(t) for t in np.random.default_rng(b).integers(3, 500, size=5 + 3 * b)) for b in range(4)]
SAMPLING = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, top_p=0.9, top_k=40, seed=5)


def _run(max_batch: int, fail_batches: bool = False) -> tuple[list[tuple[int, ...]], list[int]]:
    engine = tiny_engine(max_batch=max_batch)
    ops = engine.runner.backend.ops
    native = ops.sample
    rows: list[int] = []

    def sample(logits: Any, temperature: float, top_k: int, top_p: float, uniform: list[float]) -> list[int]:
        rows.append(int(logits.shape[0]))
        if fail_batches and len(uniform) > 1:
            raise RuntimeError("a kernel that fails on batches")
        return native(logits, temperature, top_k, top_p, uniform)

    ops.sample = sample
    done = engine.generate(Request(list(PROMPTS), SAMPLING))
    assert all(c.finish_reason == "length" for c in done), [c.finish_reason for c in done]
    return [tuple(c.token_ids) for c in done], rows


def test_rows_sharing_their_settings_are_drawn_together_with_the_tokens_of_one_at_a_time() -> None:
    alone, alone_rows = _run(1)
    together, together_rows = _run(4)
    assert set(alone_rows) == {1}
    assert max(together_rows) == 4, together_rows
    assert together == alone


def test_a_batched_call_that_fails_is_retried_row_by_row_at_the_same_numbers() -> None:
    together, _ = _run(4)
    retried, rows = _run(4, fail_batches=True)
    assert 4 in rows and retried == together
