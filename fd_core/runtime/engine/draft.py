"""Speculative decoding's draft model as a proposer: a second model's greedy tokens, from an engine of its own."""

from __future__ import annotations

from typing import Sequence

from fd_core.runtime.engine.loop import Engine, Job
from fd_core.runtime.engine.sampling import SamplingParams


class DraftProposer:
    """A draft model's greedy continuation: an Engine of its own over the draft (its own paged cache, prefix caching
    on), asked for every sequence's next tokens at once. Each ask is a job of the sequence's ids and `count` tokens:
    the blocks of its earlier asks are found cached, so only the ids since (and the last partial block) are
    prefilled."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def propose(self, ids: Sequence[int], count: int) -> list[int]:
        return self.propose_many([(ids, count)])[0]

    def propose_many(self, asks: Sequence[tuple[Sequence[int], int]]) -> list[list[int]]:
        """Each (ids, count)'s greedy continuation by the draft, all decoded together."""
        engine = self.engine
        context = engine.max_table * engine.block_size
        out: dict[int, list[int]] = {}
        try:
            for key, (ids, count) in enumerate(asks):
                if count > 0 and len(ids) + count <= context:  # past the draft's context it proposes nothing
                    engine.add(Job(key, tuple(int(t) for t in ids),
                                   SamplingParams(max_new_tokens=count, ignore_eos=True)))
                else:
                    out[key] = []
            while engine.pending:
                for event in engine.step():
                    if event.done is not None:
                        out[event.key] = list(event.done.token_ids)
        except BaseException:
            engine.reset()  # the model's step fails with it; nothing of this ask stays queued in the draft
            raise
        return [out.get(key, []) for key in range(len(asks))]
