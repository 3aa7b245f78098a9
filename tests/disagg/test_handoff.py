"""Prefill on one instance, decode on another (contract 1.9), through the Python API: the same tokens as one instance
gives, for every built-in architecture, greedy and seeded sampling, 8 requests at once; and the failures, each one
line with nothing held afterwards. The instances run in this process with the `local` transport (the `shm` transport
between rank processes is test_handoff_ranks.py's)."""

from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest

from fd_core.errors import ConfigError, FdError
from fd_core.runtime import LLM, SamplingParams

ARCHS = ("ernie4_5", "ernie4_5_vl", "qwen3_vl")
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11, logprobs=2)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: Any) -> Iterator[tuple[LLM, LLM]]:
    """A prefill instance and a decode instance of one architecture's tiny preset (same seed: the same weights)."""
    with LLM(model=request.param, kv_transport="local") as prefill, \
            LLM(model=request.param, kv_transport="local", kv_timeout=2.0) as decode:
        yield prefill, decode


def _blocks(*llms: LLM) -> list[int]:
    return [llm.kv_cache["blocks_used"] for llm in llms]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_handed_over_tokens_equal_one_instances(pair: tuple[LLM, LLM], sampling: SamplingParams) -> None:
    """The decode instance's tokens (and logprobs) after a hand-over equal what it generates alone from the prompt, for
    prompts ending inside a block and on a block's end; nothing is held on either side afterwards."""
    prefill, decode = pair
    for prompt in (list(range(3, 40)), list(range(7, 39))):  # 37 positions, then 32: two whole blocks of 16
        alone = decode.generate(prompt, sampling)[0]
        handoff = prefill.prefill(prompt, sampling, to=decode.kv_address)
        assert not handoff.finished and handoff.completion.finish_reason == "handoff"
        assert list(handoff.token_ids) == alone.token_ids[:1]
        resumed = decode.resume(handoff, sampling)
        streamed = [t for piece in resumed.pieces(every_token=True) for t in piece.token_ids]
        done = resumed.result()
        assert done.token_ids == alone.token_ids
        assert streamed == alone.token_ids, "the stream begins with the handed-over token, as one instance's does"
        assert done.finish_reason == alone.finish_reason == "length"
        if sampling.logprobs is not None:
            assert done.logprobs is not None and alone.logprobs is not None
            assert [p.token for p in done.logprobs] == [p.token for p in alone.logprobs]
            assert [p.logprob for p in done.logprobs] == pytest.approx([p.logprob for p in alone.logprobs], abs=1e-4)
    assert _blocks(prefill, decode) == [0, 0]
    assert prefill.kv_cache["kv_sent_tokens"] > 0 and decode.kv_cache["kv_received_tokens"] > 0


def test_eight_requests_at_once(pair: tuple[LLM, LLM]) -> None:
    """Eight clients prefilling and resuming concurrently each get one instance's tokens for their own prompt."""
    prefill, decode = pair
    prompts = [list(range(5 + i, 30 + 3 * i)) for i in range(8)]
    alone = decode.generate(prompts, GREEDY)
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            handoff = prefill.prefill(prompts[i], GREEDY, to=decode.kv_address)
            got[i] = decode.resume(handoff, GREEDY).result().token_ids
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[0]
    assert [got[i] for i in range(8)] == [c.token_ids for c in alone]
    assert _blocks(prefill, decode) == [0, 0]


def test_a_request_that_ends_at_its_first_token_sends_nothing(pair: tuple[LLM, LLM]) -> None:
    prefill, decode = pair
    before = prefill.kv_cache["kv_sent_tokens"]
    handoff = prefill.prefill(list(range(3, 20)), SamplingParams(max_new_tokens=1), to=decode.kv_address)
    assert handoff.finished and handoff.completion.finish_reason in ("length", "eos")
    assert prefill.kv_cache["kv_sent_tokens"] == before
    with pytest.raises(ConfigError, match="nothing was sent"):
        decode.resume(handoff, SamplingParams(max_new_tokens=1))


def test_no_decode_instance_there_fails_the_request_in_one_line(pair: tuple[LLM, LLM]) -> None:
    """A hand-over to an address nobody listens at fails that request (its blocks freed); the instance goes on."""
    prefill, decode = pair
    with pytest.raises(FdError) as caught:
        prefill.prefill(list(range(3, 30)), GREEDY, to="nobody-listens-here")
    message = str(caught.value)
    assert "\n" not in message and "the decode instance is gone or does not listen there" in message
    assert _blocks(prefill) == [0]
    assert prefill.generate(list(range(3, 9)), SamplingParams(max_new_tokens=2))[0].token_ids


def test_keys_and_values_that_never_come_fail_the_request_after_kv_timeout(pair: tuple[LLM, LLM]) -> None:
    """resume() of a hand-over whose parts were never sent here ends that request after kv_timeout (2 s), naming
    it; the decode instance goes on."""
    import dataclasses

    prefill, decode = pair
    handoff = prefill.prefill(list(range(3, 30)), GREEDY, to=decode.kv_address)
    decode.resume(handoff, GREEDY).result()  # its parts are taken; the same key again finds none
    with pytest.raises(FdError, match="did not arrive within 2 s"):
        decode.resume(dataclasses.replace(handoff), GREEDY).result()
    assert _blocks(decode) == [0]


def test_another_prompt_than_the_prefilled_one_is_refused(pair: tuple[LLM, LLM]) -> None:
    """The decode instance's request must hold the prompt the prefill instance prefilled (a router sends each the
    same body; instances that tokenized it differently would decode from the wrong keys and values)."""
    import dataclasses

    prefill, decode = pair
    handoff = prefill.prefill(list(range(3, 30)), GREEDY, to=decode.kv_address)
    with pytest.raises(FdError, match=r"prefilled other prompt ids \(27 positions\) than this request's \(27\)"):
        decode.resume(dataclasses.replace(handoff, prompt_ids=tuple(range(4, 31))), GREEDY).result()
    assert _blocks(decode) == [0]


@pytest.mark.parametrize("other", [{"model": "qwen3_vl"}, {"model": "ernie4_5", "seed": 1}],
                         ids=["another-model-of-the-same-shapes", "other-weights"])
def test_instances_of_different_models_or_weights_are_refused_in_one_line(other: dict[str, Any]) -> None:
    """The tiny presets' caches have the same shapes, and a seed changes only the weights: the keys and values would
    fit and give wrong tokens, so the sender's identity (architecture, dtype, tp rank, a sample of its weights) must
    be the receiver's."""
    with LLM(model="ernie4_5", kv_transport="local") as prefill, LLM(kv_transport="local", **other) as decode:
        handoff = prefill.prefill(list(range(3, 30)), GREEDY, to=decode.kv_address)
        with pytest.raises(FdError, match="run both instances with the same model, checkpoint, dtype and tp") as caught:
            decode.resume(handoff, GREEDY).result()
        assert "\n" not in str(caught.value)
        assert _blocks(prefill, decode) == [0, 0]


def test_no_transport_and_an_unknown_one_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"kv_transport='nope'\) is not a KV transport any plugin registered \(registered: .*shm"):
        LLM(model="ernie4_5", kv_transport="nope")
    with LLM(model="ernie4_5") as plain:
        assert plain.kv_address is None
        with pytest.raises(ConfigError, match=r"pass LLM\(kv_transport=...\)"):
            plain.prefill([1, 2, 3], GREEDY, to="x")


def test_a_resume_that_fails_drops_what_arrives_later_under_its_key() -> None:
    """A decode-side sequence whose keys and values never came ends with an error after transfer_timeout while another
    sequence decodes on (the wait holds up no one), and its key is aborted at the transport: parts sent under it
    afterwards are not kept (they would sit in the inbox for nobody)."""
    import numpy as np

    from fd_core.runtime.engine.loop import Job, KVHandoff
    from fd_plugins.transfer.local import LocalTransport
    from tiny_engine import tiny_engine

    engine = tiny_engine(transfer_timeout=0.2)
    engine.transport = LocalTransport("late-receiver", 0)
    sender = LocalTransport("late-sender", 0)
    try:
        import time

        engine.add(Job(1, tuple(range(3, 20)), GREEDY, handoff=KVHandoff("late", tokens=(5,))))
        engine.add(Job(2, tuple(range(4, 12)), SamplingParams(max_new_tokens=1000, ignore_eos=True)))
        ended: dict[int, Any] = {}
        others = 0
        start = time.monotonic()
        while 1 not in ended and time.monotonic() - start < 10:
            for event in engine.step():
                others += event.key == 2 and event.token is not None
                if event.done is not None:
                    ended[event.key] = event.done
        done = ended[1]
        assert done.finish_reason == "error" and "did not arrive within 0.2 s" in done.failure.message
        assert others >= 2, "the other sequence waited for the hand-over"
        engine.cancel(2)
        engine.step()
        sender.send("late", "late-receiver", [np.zeros(3)], 5.0)
        assert engine.transport.receive("late") is None
        assert engine.pool.used == 0
    finally:
        engine.transport.close()
        sender.close()
