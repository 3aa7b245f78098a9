"""Drawn sampling over the batch: the rows that share temperature, top-k and top-p reach the sample op in one call,
each at its own sequence's uniform. The oracle is the same request decoded one sequence at a time (max_batch 1: every
call one row), and, for the numbers, each sequence's own generator as SamplingParams defines it (seeded with the
request's seed and the prompt's index), drawn once a token; a batched call that fails is retried row by row at the
same numbers, with the same tokens."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from fd_core.runtime.engine.loop import jobs_of
from fd_core.runtime.engine.sampling import SamplingParams
from fd_core.runtime.request import Request
from tiny_engine import run_jobs, tiny_engine

PROMPTS = [tuple(int(t) for t in np.random.default_rng(b).integers(3, 500, size=5 + 3 * b)) for b in range(7)]
SAMPLING = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, top_p=0.9, top_k=40, seed=5)
# Beside SAMPLING's four rows: a greedy one, one at another temperature, and one whose logits the host processes
# (logit_bias): three more groups, one of them the host's.
OTHERS = (SamplingParams(max_new_tokens=10, ignore_eos=True),
          SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.6, seed=2),
          SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, top_p=0.9, top_k=40, seed=5,
                         logit_bias=((7, 3.0), (11, -2.0))))


def _run(max_batch: int, fail_batches: bool = False) -> tuple[list[tuple[int, ...]], list[int], Counter[float]]:
    engine = tiny_engine(max_batch=max_batch)
    ops = engine.runner.backend.ops
    native = ops.sample
    rows: list[int] = []
    given: Counter[float] = Counter()  # every uniform the sample op was given, drawn rows only

    def sample(logits: Any, temperature: float, top_k: int, top_p: float, uniform: list[float]) -> list[int]:
        rows.append(int(logits.shape[0]))
        if temperature:
            given.update(uniform)
        if fail_batches and len(uniform) > 1:
            raise RuntimeError("a kernel that fails on batches")
        return native(logits, temperature, top_k, top_p, uniform)

    ops.sample = sample
    jobs = jobs_of(Request(list(PROMPTS[:4]), SAMPLING))
    for n, params in enumerate(OTHERS):
        jobs += jobs_of(Request([PROMPTS[4 + n]], params), first_key=100 * (n + 1))
    done = run_jobs(engine, jobs)
    assert all(c.finish_reason == "length" for c in done.values()), [c.finish_reason for c in done.values()]
    return [tuple(done[job.key].token_ids) for job in jobs], rows, given


def _streams() -> Counter[float]:
    """Each drawn sequence's ten uniforms, from its own generator: seed and index as SamplingParams defines them."""
    seeded = [(SAMPLING.seed, i) for i in range(4)] + [(OTHERS[1].seed, 0), (OTHERS[2].seed, 0)]
    return Counter(float(u) for seed, i in seeded for u in np.random.default_rng([seed, i]).random(10))


def test_rows_sharing_their_settings_are_drawn_together_with_the_tokens_of_one_at_a_time() -> None:
    alone, alone_rows, _ = _run(1)
    together, together_rows, given = _run(8)
    assert set(alone_rows) == {1}
    assert max(together_rows) == 4 and 1 in together_rows, together_rows  # SAMPLING's four; the others' apart
    assert together == alone
    assert given == _streams()


def test_a_batched_call_that_fails_is_retried_row_by_row_at_the_same_numbers() -> None:
    together, _, _ = _run(8)
    retried, rows, given = _run(8, fail_batches=True)
    assert 4 in rows and retried == together
    # The failed batch's numbers given once more, row by row: the same numbers, none drawn anew.
    assert set(given) == set(_streams())
