"""n choices per prompt (SamplingParams.n): each its own seeded stream, the prompt's blocks shared, and the calls that
return one result refuse n > 1 instead of dropping choices."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

import kit
from fd_core.errors import ConfigError
from fd_core.runtime import LLM, SamplingParams

PROMPT = list(range(5, 30))  # 25 ids: six full blocks of 4 before its last token


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    checkpoint: Path = kit.text_checkpoint(tmp_path_factory.mktemp("choices") / "ernie", "ernie4_5")
    with LLM(checkpoint, tp=1, graph="off", kv_block_size=4) as session:
        yield session


def test_each_choice_is_the_stream_of_its_index(llm: LLM) -> None:
    """Choice j of prompt i is sampled as the (i * n + j)-th prompt of a request of copies is: n choices are n
    different samples, the first of them the n=1 sample, and a second prompt's choices follow the first's."""
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    choices = llm.generate([PROMPT, PROMPT[:9]], SamplingParams(**{**sampled.__dict__, "n": 3}))
    copies = llm.generate([PROMPT] * 3 + [PROMPT[:9]] * 3, sampled)
    assert [c.token_ids for c in choices] == [c.token_ids for c in copies]
    assert len({tuple(c.token_ids) for c in choices[:3]}) == 3
    assert choices[0].token_ids == llm.generate([PROMPT], sampled)[0].token_ids


def test_greedy_choices_are_equal(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_new_tokens=6, n=4, ignore_eos=True))
    assert len(out) == 4 and len({tuple(c.token_ids) for c in out}) == 1


def test_the_choices_share_the_prompts_blocks(llm: LLM) -> None:
    """The other choices wait one step for the first's prefill and find its six full blocks cached."""
    other = [p + 400 for p in PROMPT]  # a prompt not cached by an earlier test
    before = llm.kv_cache["prefix_cache_hit_tokens"]
    llm.generate(other, SamplingParams(max_new_tokens=3, n=3, ignore_eos=True))
    assert llm.kv_cache["prefix_cache_hit_tokens"] - before == 2 * 6 * 4


def test_calls_that_return_one_result_refuse_several_choices(llm: LLM) -> None:
    several = SamplingParams(max_new_tokens=3, n=2)
    with pytest.raises(ConfigError, match=r"n=2 asks for several; use submit_choices\(\)"):
        llm.submit(PROMPT, several)
    with pytest.raises(ConfigError, match="stream\\(\\) gives one text"):
        llm.stream(PROMPT, several)
    submissions = llm.submit_choices(PROMPT, several)
    assert len(submissions) == 2 and all(len(s.result().token_ids) >= 1 for s in submissions)
    with pytest.raises(ConfigError, match="n must be in 1..64"):
        SamplingParams(n=0)
