"""Prefill and decode instances at tp=2, their ranks processes of their own, handing over through the `shm`
transport (rank r to rank r): the decode instance's tokens equal its own from the prompt."""

from __future__ import annotations

from typing import Iterator

import pytest

from fd_core.runtime import LLM, SamplingParams


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[LLM, LLM]]:
    with LLM(model="ernie4_5", tp=2, kv_transport="shm") as prefill, \
            LLM(model="ernie4_5", tp=2, kv_transport="shm") as decode:
        yield prefill, decode


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=8, ignore_eos=True),
                                      SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.7, seed=5)],
                         ids=["greedy", "sampled"])
def test_tp2_ranks_hand_over_through_shared_memory(pair: tuple[LLM, LLM], sampling: SamplingParams) -> None:
    prefill, decode = pair
    prompt = list(range(11, 60))
    alone = decode.generate(prompt, sampling)[0]
    handoff = prefill.prefill(prompt, sampling, to=decode.kv_address)
    assert decode.resume(handoff, sampling).result().token_ids == alone.token_ids
    assert prefill.kv_cache["kv_sent_tokens"] >= len(prompt)
    assert decode.kv_cache["blocks_used"] == prefill.kv_cache["blocks_used"] == 0
