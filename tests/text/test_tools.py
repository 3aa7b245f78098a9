"""Tool calling's pieces: OpenAI's tools and tool_choice checked in one line each, the calls parsed out of the
model's text, and "required" / a named function enforced as a grammar (random walks through its mask always parse
into calls of the offered tools with arguments of their schemas)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from fd_core.runtime.text.tools import ToolError, Tools, check_tools
from fd_core.serve.tiny import CHAT_TEMPLATE
from kit import tokenizer_dirs  # noqa: F401 - fixture

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "maximum": 9}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": [], "properties": {}}}}


@pytest.mark.parametrize(("tools", "choice", "says"), [
    ([{"type": "web"}], None, 'tools[0] must be {"type": "function"'),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name must be 1 to 64"),
    ([WEATHER, WEATHER], None, "names a second tool of that name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "parameters must be a JSON schema"),
    ([WEATHER], "sometimes", 'tool_choice must be "none", "auto", "required" or a function'),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "names function 'nope', which is not among"),
    ([], "required", 'tool_choice "required" needs tools'),
    ([], "auto", 'tool_choice "auto" needs tools'),
])
def test_malformed_tools_are_one_line_errors_naming_the_field(tools: Any, choice: Any, says: str) -> None:
    with pytest.raises(ToolError) as caught:
        check_tools(tools, choice, CHAT_TEMPLATE)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_template_without_tool_calls_refuses_tools_but_not_tool_choice_none() -> None:
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ToolError, match="defines no tool calls fd can parse"):
        check_tools([WEATHER], "auto", plain)
    assert check_tools([WEATHER], "none", plain).for_template() is None
    assert check_tools(None, None, plain).choice == "none"


def test_calls_are_parsed_out_of_the_text_and_anything_else_stays_content() -> None:
    tools = check_tools([WEATHER, TIME], "auto", CHAT_TEMPLATE)
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_call>not json</tool_call>')
    content, calls = tools.parse(text)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Rome"}, {}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # The whitespace before each call taken out goes with it (as a stream shows it, test_a_stream_shows_...).
    assert content == ('Let me check.<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
                       "<tool_call>not json</tool_call>")
    assert tools.parse("no calls") == ("no calls", [])
    assert check_tools([WEATHER], "none", CHAT_TEMPLATE).parse(text) == (text, [])


def _walk(tools: Tools, tokenizer: Any, seed: int) -> str:
    """A random walk through the choice's grammar: a random allowed token each step, until it is complete."""
    from fd_core.runtime.text.grammar import Grammars

    constraint = Grammars(tokenizer, 512).matcher(tools.grammar() or "")
    rng, ids = np.random.default_rng(seed), []
    for _ in range(400):
        if constraint.done:
            break
        allowed = np.flatnonzero(constraint.allowed())
        eos = set(constraint.grammars.eos_ids)
        if eos & set(allowed.tolist()) and rng.random() < 0.5:
            break  # the output may end here: end it half the time
        choices = [int(t) for t in allowed if int(t) not in eos]
        token = choices[int(rng.integers(len(choices)))]
        constraint.advance(token)
        ids.append(token)
    return str(tokenizer.decode(ids))


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_required_or_named_choice_only_lets_calls_of_the_offered_tools_through(
    tokenizer_dirs: dict[str, Any], choice: str,  # noqa: F811
) -> None:
    from fd_core.runtime.text.tokenizer import load_tokenizer

    pytest.importorskip("llguidance")
    tokenizer = load_tokenizer(tokenizer_dirs["bpe"])
    tools = check_tools([WEATHER, TIME], choice if choice == "required" else
                        {"type": "function", "function": {"name": choice}}, CHAT_TEMPLATE)
    for seed in range(6):
        text = _walk(tools, tokenizer, seed)
        content, calls = tools.parse(text)
        assert calls and not content, text
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            if choice != "required":
                assert call["function"]["name"] == choice
            if call["function"]["name"] == "get_weather":
                assert arguments["city"] in ("Paris", "Rome") and set(arguments) <= {"city", "days"}
            else:
                assert arguments == {}
    assert check_tools([WEATHER], "auto", CHAT_TEMPLATE).grammar() is None


def test_parallel_tool_calls_false_allows_one_call(tokenizer_dirs: dict[str, Any]) -> None:  # noqa: F811
    """OpenAI's parallel_tool_calls false: "required" lets exactly one call through the grammar, and a second call the
    model writes anyway (tool choice "auto") stays text."""
    from fd_core.runtime.text.tokenizer import load_tokenizer

    pytest.importorskip("llguidance")
    one = check_tools([WEATHER, TIME], "required", CHAT_TEMPLATE, parallel=False)
    tokenizer = load_tokenizer(tokenizer_dirs["bpe"])
    counts = {len(one.parse(_walk(one, tokenizer, seed))[1]) for seed in range(6)}
    many = check_tools([WEATHER, TIME], "required", CHAT_TEMPLATE)
    assert counts == {1} and max(len(many.parse(_walk(many, tokenizer, s))[1]) for s in range(12)) > 1
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    content, calls = check_tools([WEATHER, TIME], "auto", CHAT_TEMPLATE, parallel=False).parse(text)
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    assert content == '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'


def test_a_stream_shows_the_content_before_the_calls_and_parses_them_at_the_end() -> None:
    from fd_core.runtime.text.tools import ToolStream

    tools = check_tools([WEATHER], "auto", CHAT_TEMPLATE)
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for size in (1, 3, 7, len(text)):
        stream = ToolStream(tools)
        shown = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
        rest, calls = stream.finish()
        assert shown == "Sure." and rest is None, (size, shown, rest)
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    plain = ToolStream(tools)
    assert plain.feed("a <tool") == "a" and plain.feed("s and more") == " <tools and more"
    assert plain.feed("x <") == "x" and plain.finish() == (" <", [])


@pytest.mark.parametrize("text", [
    '\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
    "no call at all  \n",
    "x <tool_call>not json</tool_call>",
    'Checking. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone, see above.\n',
    '  lead <tool_call>{"name": "get_time", "arguments": {}}</tool_call> mid <tool_call>{"name": "get_time", '
    '"arguments": {}}</tool_call> end',
    'two <tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_time", '
    '"arguments": {}}</tool_call>',
])
def test_a_stream_shows_the_content_the_whole_answer_has(text: str) -> None:
    """Streamed piece by piece, the content shown adds up to the whole answer's (whitespace before a call included,
    text after one too), and the calls are the same."""
    from fd_core.runtime.text.tools import ToolStream

    tools = check_tools([WEATHER, TIME], "auto", CHAT_TEMPLATE)
    content, calls = tools.parse(text)
    for size in (1, 2, 5, len(text)):
        stream = ToolStream(tools)
        shown = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
        rest, streamed = stream.finish()
        assert shown + (rest or "") == (content or ""), (size, shown, rest)
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    if "Done" in text:  # the text after a call is kept, separated from the text before as written
        assert content == "Checking.\nDone, see above." and len(calls) == 1


def test_a_schema_with_definitions_is_enforced_through_its_references(tokenizer_dirs: dict[str, Any]) -> None:  # noqa: F811
    """Pydantic-made schemas refer to their $defs from the top of the schema: moved into the calls' grammar with the
    references renamed, a random walk still writes only what they allow."""
    from fd_core.runtime.text.tokenizer import load_tokenizer

    pytest.importorskip("llguidance")
    unit = {"type": "function", "function": {"name": "convert", "parameters": {
        "$defs": {"Unit": {"enum": ["m", "ft"]}}, "type": "object", "additionalProperties": False,
        "required": ["unit"], "properties": {"unit": {"$ref": "#/$defs/Unit"}}}}}
    tools = check_tools([unit, TIME], {"type": "function", "function": {"name": "convert"}},
                        CHAT_TEMPLATE)
    tokenizer = load_tokenizer(tokenizer_dirs["bpe"])
    for seed in range(4):
        _, calls = tools.parse(_walk(tools, tokenizer, seed))
        assert [json.loads(c["function"]["arguments"]) for c in calls] in ([{"unit": "m"}], [{"unit": "ft"}])


def test_a_tool_schema_bound_near_minus_two_to_the_63_is_refused_not_crashed() -> None:
    """A required tool choice compiles its parameters' schema: a bound past 2^53 - 1 is refused naming tools before
    llguidance sees it (llguidance 1.9.1 crashes the process on integer ranges near -2^63)."""
    from fd_core.runtime.text.grammar import GrammarError

    tool = {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": -2**63, "maximum": -2**63}}}}}
    with pytest.raises(GrammarError, match=r"^tools: minimum -9223372036854775808 is past"):
        check_tools([tool], "required", CHAT_TEMPLATE).grammar()
