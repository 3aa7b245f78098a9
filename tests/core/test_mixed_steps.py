"""Mixed steps: a model that packs rows (CausalModel.packs_rows) gets a step's decode rows in the same prefill call as
its prompt chunks, one forward pass. The oracle is the same engine with the rows apart (packs_rows off: prefill and
decode steps as before), and, for the model's packed prefill itself, the model run one row at a time."""

from __future__ import annotations

from typing import Any

import numpy as np

from fd_core.runtime.engine.sampling import SamplingParams
from fd_core.runtime.request import Request
from tiny_engine import tiny_engine


def _engine(packs: bool, **options: Any) -> Any:
    engine = tiny_engine(**options)
    engine.runner.model.packs_rows = packs  # the instance's, over the class's True
    return engine


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(3, 500, size=n)] for n in (40, 7, 90, 23, 61)]


def test_mixed_steps_give_the_tokens_and_logprobs_of_separate_steps() -> None:
    """Five prompts of 7 to 90 tokens in chunks of 16 beside running decodes, greedy with logprobs, and sampled with
    a seed each and a repetition penalty: the same tokens (and logprobs within float32 rounding) with the decode rows
    riding in the prefill calls as with decode steps of their own; every block back in the pool."""
    results = {}
    for packs in (True, False):
        engine = _engine(packs, max_batch=4, max_prefill_tokens=16)
        greedy = engine.generate(Request([tuple(p) for p in _prompts()],
                                         SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2)))
        sampled = engine.generate(Request([tuple(p) for p in _prompts()],
                                          SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9,
                                                         top_p=0.9, seed=5, repetition_penalty=1.2)))
        results[packs] = (greedy, sampled, engine.mixed_steps)
        assert engine.kv_stats()["blocks_used"] == 0
    mixed, apart = results[True], results[False]
    assert mixed[2] > 0 and apart[2] == 0, (mixed[2], apart[2])
    for got, want in ((mixed[0], apart[0]), (mixed[1], apart[1])):
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for got, want in zip(mixed[0], apart[0], strict=True):
        for a, b in zip(got.logprobs or [], want.logprobs or [], strict=True):
            assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert np.allclose([a.logprob, *(v for _, v in a.top)], [b.logprob, *(v for _, v in b.top)], atol=1e-4)


def _rows(starts: list[int], lengths: list[int], only: int | None = None) -> Any:
    """Three rows owning blocks 1 + 6b onward (blocks of 4), new tokens at starts[b] onward; `only`: that row alone,
    in the same blocks."""
    from fd_core.kvcache import KVBatch

    batch = KVBatch.contiguous(3, starts, lengths, 4, 6)
    if only is None:
        return batch
    n = int(batch.lengths[only])
    return KVBatch(batch.block_tables[only:only + 1], batch.starts[only:only + 1], batch.lengths[only:only + 1],
                   batch.slot_mapping[only:only + 1, :n], batch.rope_deltas[only:only + 1])


def test_a_packed_prefill_equals_each_row_alone() -> None:
    """The model's prefill of rows of 1, 9 and 4 new tokens after prefixes of 5, 0 and 12 (packed end to end: more
    than one row) gives each row's last logits as prefilling that row alone does (one row: the padded path)."""
    engine = _engine(True)
    model = engine.runner.model
    model.allocate_kv_cache(1 + 3 * 6, 4)
    rng = np.random.default_rng(0)
    prefixes, news = [5, 0, 12], [1, 9, 4]
    ids = [rng.integers(3, 500, size=p + n).tolist() for p, n in zip(prefixes, news, strict=True)]
    for b, p in enumerate(prefixes):
        if p:
            model.prefill(np.asarray([ids[b][:p]]), None, _rows([0] * 3, [p] * 3, only=b))
    padded = np.zeros((3, max(news)), dtype=np.int64)
    for b, n in enumerate(news):
        padded[b, :n] = ids[b][prefixes[b]:]
    together = model.prefill(padded, None, _rows(prefixes, news)).numpy()
    for b, p in enumerate(prefixes):
        alone = model.prefill(np.asarray([ids[b][p:]]), None, _rows(prefixes, news, only=b)).numpy()
        np.testing.assert_allclose(together[b], alone[0], rtol=1e-4, atol=1e-4)
