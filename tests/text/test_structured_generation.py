"""Structured output through the engine (SamplingParams.grammar): whatever the model's logits, greedy or sampled, the
text is what the grammar asks for, checked by json.loads, a schema check written here, and re.fullmatch."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from fd_core.errors import ConfigError
from fd_core.runtime import LLM, SamplingParams

pytest.importorskip("llguidance", reason="structured output needs llguidance: pip install -e '.[test]'")

from fd_core.runtime.text.grammar import GrammarError, constraint_spec  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "count"],
          "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer", "maximum": 999}}}
REGEX = r"(yes|no), [0-9]{2}"


def _matches_schema(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) == {"answer", "count"} and value["answer"] in ("yes", "no")
            and isinstance(value["count"], int) and not isinstance(value["count"], bool) and value["count"] <= 999)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    from fd_core.serve.tiny import write_tiny_checkpoint

    checkpoint: Path = write_tiny_checkpoint(tmp_path_factory.mktemp("structured") / "tiny")
    with LLM(checkpoint, tp=1, graph="off") as session:
        yield session


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_output_parses_and_validates(llm: LLM, temperature: float) -> None:
    spec = constraint_spec({"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}})
    settings = SamplingParams(max_new_tokens=48, grammar=spec, temperature=temperature, seed=5, n=4)
    for completion in llm.generate(["Hello world", "Is it so?"], settings):
        assert completion.finish_reason == "stop", completion.text
        assert _matches_schema(json.loads(completion.text)), completion.text
        assert json.dumps(json.loads(completion.text)) == completion.text  # json.dumps's layout, no stray whitespace


def test_a_json_object_and_a_regex_are_followed(llm: LLM) -> None:
    anything = llm.generate("Hello world", SamplingParams(max_new_tokens=32, temperature=1.0, seed=2, n=3,
                                                          grammar=constraint_spec({"type": "json_object"})))
    assert all(isinstance(json.loads(c.text), dict) for c in anything if c.finish_reason == "stop")
    assert any(c.finish_reason == "stop" for c in anything)
    pattern = llm.generate("Hello world", SamplingParams(max_new_tokens=16, temperature=1.0, seed=1, n=4,
                                                         grammar=constraint_spec(None, REGEX)))
    assert all(re.fullmatch(REGEX, c.text) and c.finish_reason == "stop" for c in pattern), [c.text for c in pattern]


def test_the_free_text_differs_so_the_mask_did_the_work(llm: LLM) -> None:
    """Without the grammar the same request is not JSON: the constraint, not the model, made it valid."""
    free = llm.generate("Hello world", SamplingParams(max_new_tokens=24, temperature=1.0, seed=5))[0].text
    with pytest.raises(ValueError):
        json.loads(free)


def test_a_bad_grammar_or_a_missing_tokenizer_is_refused_before_it_queues(llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(GrammarError) as bad:
        llm.generate("Hello", SamplingParams(grammar="%grammar nonsense {"))
    assert "\n" not in str(bad.value) and str(bad.value).startswith("grammar: ")
    from fd_core.runtime.save_random import save_random_checkpoint

    bare = tmp_path / "bare"
    save_random_checkpoint("ernie4_5", str(bare), seed=0)
    with LLM(bare, tp=1, graph="off") as plain, pytest.raises(ConfigError, match="without the checkpoint's tokenizer"):
        plain.generate([[1, 2, 3]], SamplingParams(grammar=constraint_spec({"type": "json_object"})))
