"""Logprobs (SamplingParams.logprobs): each generated token's log-softmax of its step's raw logits, with the k most
likely tokens sorted, computed only for the sequences that ask; through the engine (a mixed batch, the engine's own
logits as the oracle), the Python API (generate, submit's pieces) and two gloo ranks (equal to one rank). The
comparison with transformers' log_softmax is tests/models/test_reference.py's."""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from fd_core.errors import ConfigError
from fd_core.host.loading import PluginSet, load_plugins
from fd_core.runtime import LLM, Completion, SamplingParams, TokenLogprob
from fd_core.runtime.engine.loop import Engine, Event, Job
from fd_core.runtime.engine.sampling import most_likely, token_logprobs
from fd_core.runtime.memory import MemoryPlan

TEXTS = ["Hello world", "The quick brown fox", "Привет", "Numbers 12345 and more"]
# Sampled with a temperature and filters that change the distribution a token is drawn from, not its logprobs.
SAMPLED = dict(temperature=0.6, top_k=4, top_p=0.9, seed=11)


def log_softmax(row: np.ndarray) -> np.ndarray:
    """The oracle of the unit tests: log_softmax written out in Python floats (math.fsum), no numpy reductions."""
    values = [float(x) for x in np.asarray(row, dtype=np.float32)]
    top = max(values)
    total = math.log(math.fsum(math.exp(v - top) for v in values))
    return np.asarray([v - top - total for v in values])


def sorted_top(logprob: TokenLogprob) -> bool:
    """Whether its alternatives are by logprob descending, ties by ascending id."""
    return list(logprob.top) == sorted(logprob.top, key=lambda entry: (-entry[1], entry[0]))


@pytest.mark.parametrize("value", [-1, 21, 2.5, "3", True])
def test_logprobs_is_checked_like_the_other_fields(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^logprobs must be") as error:
        SamplingParams(logprobs=value)  # type: ignore[arg-type]
    assert "\n" not in str(error.value)
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=20).logprobs == 20
    assert SamplingParams().logprobs is None


def test_alternatives_are_sorted_by_logprob_then_id_ties_at_the_boundary_included() -> None:
    row = np.asarray([0.5, 2.0, 2.0, 3.0, 2.0, -1.0, 3.0], dtype=np.float32)
    expected = log_softmax(row)
    [chosen] = token_logprobs(row[None], [4], [4])
    assert chosen.token == 4 and chosen.logprob == pytest.approx(expected[4], abs=1e-12)
    # 3 and 6 tie first; 1, 2 and 4 tie next and the boundary takes the lower ids.
    assert [t for t, _ in chosen.top] == [3, 6, 1, 2]
    assert all(v == pytest.approx(expected[t], abs=1e-12) for t, v in chosen.top)
    assert most_likely(expected, 0) == () and len(most_likely(expected, 50)) == len(row)
    # Only the chosen token's, with 0.
    assert token_logprobs(row[None], [5], [0])[0].top == ()


@pytest.fixture(scope="module")
def plugins() -> PluginSet:
    return load_plugins()


def _engine(plugins: PluginSet, max_batch: int = 4, by_step: bool = False) -> Engine:
    """The tiny ERNIE-4.5 preset on an engine of its own (as tests/text/test_continuous_batching.py builds it);
    `by_step`: as a model package without prefill_every (contract 1.5) is run, scoring a prompt a decode step."""
    from fd_core.host.backend import Backend
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for

    arch = plugins.registry.get("ernie4_5")
    runner = ModelRunner(Backend(plugins), arch, model_config_for(arch, None), graph="off")
    runner.load()
    runner.decide()
    if by_step:
        runner.model.prefill_every = None  # type: ignore[union-attr]
    memory = MemoryPlan(1.0, runner.config.dtype, 1, 0, 1, block_size=16, blocks=12, blocks_from="the test")
    return Engine(runner, max_batch=max_batch, memory=memory)


def _run(engine: Engine, jobs: list[Job]) -> tuple[dict[int, Completion], dict[int, list[Event]]]:
    for job in jobs:
        engine.add(job)
    done: dict[int, Completion] = {}
    events: dict[int, list[Event]] = {}
    while engine.pending:
        for event in engine.step():
            events.setdefault(event.key, []).append(event)
            if event.done is not None:
                done[event.key] = event.done
    return done, events


def test_a_mixed_batch_gives_each_the_log_softmax_of_its_raw_logits(plugins: PluginSet) -> None:
    """Rows that ask (greedy and sampled, k 0, 3 and 20) beside rows that do not, admitted at different steps: each
    token's logprob is the log-softmax of the logits it was chosen from (the engine's trace), whatever the temperature
    and filters; the rows that do not ask get none; and every row gets what it gets alone."""
    asks = [
        SamplingParams(max_new_tokens=7, ignore_eos=True, logprobs=3),
        SamplingParams(max_new_tokens=9, ignore_eos=True),
        SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=20, **SAMPLED),  # type: ignore[arg-type]
        SamplingParams(max_new_tokens=8, ignore_eos=True, **SAMPLED),  # type: ignore[arg-type]
        SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=0),
    ]
    jobs = [Job(i, tuple([1, 2, 3 + i] + [7 + i] * (3 * i)), s, index=i) for i, s in enumerate(asks)]
    engine = _engine(plugins, max_batch=3)  # five jobs, three rows: two join later
    engine.trace = {}
    done, events = _run(engine, jobs)
    for job in jobs:
        completion, k = done[job.key], job.sampling.logprobs
        steps = [e for e in events[job.key] if e.token is not None]
        if k is None:
            assert completion.logprobs is None and all(e.logprob is None for e in steps)
            continue
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
        assert [e.logprob for e in steps] == completion.logprobs  # the events carry them as they come
        for logprob, token, logits in zip(completion.logprobs, completion.token_ids, engine.trace[job.key], strict=True):
            expected = log_softmax(logits)
            assert logprob.token == token and logprob.logprob == pytest.approx(expected[token], abs=1e-9)
            assert len(logprob.top) == k and sorted_top(logprob)
            assert [v for _, v in logprob.top] == pytest.approx([expected[t] for t, _ in logprob.top], abs=1e-9)
            assert [t for t, _ in logprob.top] == list(np.argsort(-expected, kind="stable")[:k])
    # Sampled with top_k 4: the alternatives are the whole distribution's (20 of them), not the filtered one's.
    assert done[2].logprobs is not None and all(len(p.top) == 20 for p in done[2].logprobs)
    # Alone, each row gets the same tokens and logprobs (the batch changes nothing).
    for job in jobs:
        alone, _ = _run(_engine(plugins), [job])
        assert alone[job.key].token_ids == done[job.key].token_ids
        if job.sampling.logprobs is not None:
            assert alone[job.key].logprobs is not None
            for a, b in zip(alone[job.key].logprobs, done[job.key].logprobs or [], strict=True):
                assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
                assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_events_and_completions_stay_plain_picklable_data() -> None:
    """At tp > 1 rank 0 sends its events through a pipe."""
    logprob = TokenLogprob(5, -0.25, ((5, -0.25), (9, -1.5)))
    completion = Completion([1, 2], [5], "x", "length", [logprob])
    event = Event(3, 5, "x", completion, logprob)
    assert pickle.loads(pickle.dumps(event)) == event
    assert completion.to_dict()["logprobs"] == [{"token": 5, "logprob": -0.25, "top": [[5, -0.25], [9, -1.5]]}]
    assert "logprobs" not in Completion([1], [5], "x", "length").to_dict()


# -- the Python API ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fd serve's tiny checkpoint (byte-level BPE): "Hello world" meets its end-of-sequence id at the 7th token."""
    from fd_core.serve.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("logprobs") / "tiny")


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> Iterator[LLM]:
    with LLM(checkpoint, tp=1, graph="off") as session:
        yield session


def test_greedy_chooses_the_most_likely_token_and_keeps_the_eos(llm: LLM) -> None:
    ended = 0
    for text in TEXTS:
        plain = llm.generate(text, SamplingParams(max_new_tokens=12))[0]
        completion = llm.generate(text, SamplingParams(max_new_tokens=12, logprobs=5))[0]
        assert completion.token_ids == plain.token_ids and plain.logprobs is None  # asking changes no token
        assert completion.logprobs is not None
        assert [p.token for p in completion.logprobs] == completion.token_ids
        for p in completion.logprobs:
            assert len(p.top) == 5 and sorted_top(p) and p.logprob <= 0
            assert p.top[0] == (p.token, p.logprob)  # greedy: the chosen is the most likely
        ended += completion.finish_reason == "eos"
        only = llm.generate(text, SamplingParams(max_new_tokens=12, logprobs=0))[0]
        assert only.logprobs is not None and [(p.token, p.logprob, p.top) for p in only.logprobs] == [
            (p.token, p.logprob, ()) for p in completion.logprobs]
    assert ended, "no prompt met the end-of-sequence id: the eos token's logprob went unchecked"


def test_sampled_logprobs_follow_the_seed_and_the_raw_distribution(llm: LLM) -> None:
    settings = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=4, **SAMPLED)  # type: ignore[arg-type]
    first, again = (llm.generate(TEXTS[1], settings)[0] for _ in range(2))
    assert first.logprobs == again.logprobs
    assert first.logprobs is not None and all(sorted_top(p) for p in first.logprobs)
    # Raw logits: a token sampled below the most likely has a logprob below the top's.
    assert all(p.logprob <= p.top[0][1] for p in first.logprobs)


def test_pieces_carry_the_logprobs_of_their_tokens(llm: LLM) -> None:
    settings = SamplingParams(max_new_tokens=16, logprobs=2)
    whole = llm.generate(TEXTS[2], settings)[0]
    submission = llm.submit(TEXTS[2], settings)
    pieces = list(submission.pieces())
    assert "".join(p.text for p in pieces) == whole.text
    assert [lp for p in pieces for lp in p.logprobs] == whole.logprobs == submission.result().logprobs
    assert all(p.text or p is pieces[-1] for p in pieces)  # only the last may bring logprobs alone
    # Iterated as before, a submission gives its text.
    assert "".join(llm.submit(TEXTS[2], settings)) == whole.text


@pytest.fixture(scope="module")
def llm_tp2(checkpoint: Path) -> Iterator[LLM]:
    with LLM(checkpoint, tp=2, graph="off") as session:
        yield session


def test_two_ranks_give_the_logprobs_of_one(llm: LLM, llm_tp2: LLM) -> None:
    """The same tokens and alternatives; the values agree to the all-reduce's rounding (the row-parallel layers sum in
    another order at tp=2, so the logits differ in their last bits)."""
    for settings in (SamplingParams(max_new_tokens=10, logprobs=5),
                     SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=5, **SAMPLED)):  # type: ignore[arg-type]
        for text in TEXTS[:2]:
            one, two = llm.generate(text, settings)[0], llm_tp2.generate(text, settings)[0]
            assert two.token_ids == one.token_ids and one.logprobs is not None and two.logprobs is not None
            for a, b in zip(one.logprobs, two.logprobs, strict=True):
                assert (a.token, [t for t, _ in a.top]) == (b.token, [t for t, _ in b.top])
                assert b.logprob == pytest.approx(a.logprob, abs=1e-5)
                assert [v for _, v in b.top] == pytest.approx([v for _, v in a.top], abs=1e-5)


# -- the prompt's logprobs (SamplingParams.prompt_logprobs: what /v1/completions' echo shows) -----------------------
PROMPT = [1, 5, 9, 13, 2, 7, 40, 41, 42, 3, 3, 3, 17, 60, 61, 8, 9, 10, 30, 31, 32, 33]


def _prefix_oracle(plugins: PluginSet, prompt: list[int]) -> list[np.ndarray]:
    """For each position p >= 1, the log-softmax (written out in Python floats) of the logits a prefill of prompt[:p]
    chooses its first token from: the other way of computing what scoring prompt[p] reads."""
    engine = _engine(plugins)
    engine.trace = {}
    jobs = [Job(p, tuple(prompt[:p]), SamplingParams(max_new_tokens=1, ignore_eos=True)) for p in range(1, len(prompt))]
    _run(engine, jobs)
    return [log_softmax(engine.trace[p][0]) for p in range(1, len(prompt))]


def _check_scored(scored: list[TokenLogprob | None] | None, prompt: list[int], oracle: list[np.ndarray],
                  k: int) -> None:
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    for p, (logprob, expected) in enumerate(zip(scored[1:], oracle, strict=True), start=1):
        assert logprob is not None and logprob.token == prompt[p]
        # A decode step against a prefill: the same float32 numbers summed in another order.
        assert logprob.logprob == pytest.approx(expected[prompt[p]], abs=1e-4), p
        assert len(logprob.top) == k and sorted_top(logprob)
        assert [v for _, v in logprob.top] == pytest.approx([expected[t] for t, _ in logprob.top], abs=1e-4)


@pytest.mark.parametrize("by_step", [False, True], ids=["in-the-prefill", "a-token-a-step"])
def test_prompt_logprobs_score_each_token_as_a_prefill_of_its_prefix_would(plugins: PluginSet, by_step: bool) -> None:
    """Beside a plain sequence and a chunk of another prompt, and after the same prompt's blocks were cached: every
    prompt token scored, against a prefill of each prefix (the oracle); the tokens generated are those of the same
    request without the field; the cached prefix was not used (it would skip positions). Scored in its prefill
    (prefill_every), and a token a decode step (a model without it)."""
    oracle = _prefix_oracle(plugins, PROMPT)
    engine = _engine(plugins, by_step=by_step)
    plain = SamplingParams(max_new_tokens=6, ignore_eos=True)
    first, _ = _run(engine, [Job(0, tuple(PROMPT), plain)])  # caches the prompt's first full block
    hits = engine.kv_stats()["prefix_cache_hit_tokens"]
    scoring = SamplingParams(max_new_tokens=6, ignore_eos=True, prompt_logprobs=3, logprobs=2)
    jobs = [Job(1, (4, 5, 6), SamplingParams(max_new_tokens=30, ignore_eos=True)),
            Job(2, tuple(PROMPT), scoring), Job(3, tuple(range(50, 75)), plain)]
    done, events = _run(engine, jobs)
    completion = done[2]
    _check_scored(completion.prompt_logprobs, PROMPT, oracle, 3)
    assert completion.token_ids == first[0].token_ids and len(completion.logprobs or []) == 6
    assert engine.kv_stats()["prefix_cache_hit_tokens"] == hits  # job 2 did not look (job 3 had nothing to find)
    # The first token's event brings them; the others none.
    assert [e.prompt_logprobs is not None for e in events[2] if e.token is not None] == [True] + [False] * 5
    assert list(events[2][0].prompt_logprobs or ()) == completion.prompt_logprobs
    assert done[1].prompt_logprobs is None and "prompt_logprobs" not in done[1].to_dict()
    assert completion.to_dict()["prompt_logprobs"][0] is None


@pytest.mark.parametrize("by_step", [False, True], ids=["in-the-prefill", "a-token-a-step"])
def test_a_preempted_scoring_prompt_scores_each_token_once(plugins: PluginSet, by_step: bool) -> None:
    from fd_core.host.backend import Backend
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for

    arch = plugins.registry.get("ernie4_5")
    runner = ModelRunner(Backend(plugins), arch, model_config_for(arch, None), graph="off")
    runner.load()
    runner.decide()
    if by_step:
        runner.model.prefill_every = None  # type: ignore[union-attr]
    # Four blocks of 16: the long sequence admitted first grows into the scoring one's blocks, which gives them up
    # (prefilled 8 tokens a step, so that scoring in the prefill takes steps too).
    engine = Engine(runner, max_batch=4, max_prefill_tokens=8,
                    memory=MemoryPlan(1.0, runner.config.dtype, 1, 0, 1, block_size=16, blocks=4, blocks_from="test"))
    long = Job(0, tuple(range(100, 130)), SamplingParams(max_new_tokens=30, ignore_eos=True))
    scoring = Job(1, tuple(PROMPT), SamplingParams(max_new_tokens=3, ignore_eos=True, prompt_logprobs=2))
    done, _ = _run(engine, [long, scoring])
    assert engine.preemptions >= 1
    alone, _ = _run(_engine(plugins), [scoring])
    _check_scored(done[1].prompt_logprobs, PROMPT, _prefix_oracle(plugins, PROMPT), 2)
    assert done[1].token_ids == alone[1].token_ids
    assert [p.token if p else None for p in done[1].prompt_logprobs or []] == [None, *PROMPT[1:]]


@pytest.mark.parametrize("value", [-1, 21, 2.5])
def test_prompt_logprobs_is_checked_like_logprobs(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


def test_prompt_logprobs_with_pictures_are_refused_when_the_request_is_built(plugins: PluginSet) -> None:
    """Before any rank sees it: on the engine's thread it would fail the whole step (every request in it)."""
    from fd_core.runtime.plan import model_config_for
    from fd_core.runtime.request import build_request

    arch = plugins.registry.get("qwen3_vl")
    with pytest.raises(ConfigError, match=r"^prompt_logprobs scores text prompts only"):
        build_request([[1, 2, 3]], SamplingParams(prompt_logprobs=1), arch=arch, config=model_config_for(arch, None),
                      checkpoint=None, images=[np.zeros((3, 32, 32), dtype=np.float32)])


def test_a_package_that_overrides_prefill_is_not_scored_through_an_inherited_prefill_every() -> None:
    """A model package written before contract 1.5 that subclasses fd's decoder and overrides prefill would otherwise
    be scored through the base class's prefill_every, past its own prefill: it is scored a token a step."""
    from fd_core.runtime.engine.loop import scores_in_prefill

    class Base:
        def prefill(self) -> None: ...

        def prefill_every(self) -> None: ...

    class Overrides(Base):
        def prefill(self) -> None: ...

    class Both(Overrides):
        def prefill_every(self) -> None: ...

    class Plain:
        def prefill(self) -> None: ...

    assert scores_in_prefill(Base()) and not scores_in_prefill(Overrides()) and scores_in_prefill(Both())
    assert not scores_in_prefill(Plain())
    plain = Base()
    plain.prefill_every = None  # type: ignore[assignment,method-assign]
    assert not scores_in_prefill(plain)
