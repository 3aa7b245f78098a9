"""Prefill and decode instances at tp=2, their ranks processes of their own, handing over rank to rank through the
`shm` transport and through the `tcp` one between two loopback addresses (127.0.0.1 and 127.0.0.2, as two hosts
would be): the decode instance's tokens equal its own from the prompt."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from fd_core.runtime import LLM, SamplingParams
from test_transports import free_ports


@pytest.fixture(scope="module", params=["shm", "tcp"])
def pair(request: Any) -> Iterator[tuple[LLM, LLM]]:
    listen: tuple[Any, Any] = (None, None)
    if request.param == "tcp":
        pytest.importorskip("zmq", reason="the tcp transport needs pyzmq (the transfer extra)")
        listen = (free_ports(), free_ports().replace("127.0.0.1", "127.0.0.2"))
    with LLM(model="ernie4_5", tp=2, kv_transport=request.param, kv_listen=listen[0]) as prefill, \
            LLM(model="ernie4_5", tp=2, kv_transport=request.param, kv_listen=listen[1]) as decode:
        yield prefill, decode


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=8, ignore_eos=True),
                                      SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.7, seed=5)],
                         ids=["greedy", "sampled"])
def test_tp2_ranks_hand_over_rank_to_rank(pair: tuple[LLM, LLM], sampling: SamplingParams) -> None:
    prefill, decode = pair
    prompt = list(range(11, 60))
    alone = decode.generate(prompt, sampling)[0]
    handoff = prefill.prefill(prompt, sampling, to=decode.kv_address)
    assert decode.resume(handoff, sampling).result().token_ids == alone.token_ids
    assert prefill.kv_cache["kv_sent_tokens"] >= len(prompt)
    assert decode.kv_cache["blocks_used"] == prefill.kv_cache["blocks_used"] == 0
