"""Structured output (fd_core.runtime.text.grammar): random walks through the allowed tokens of real tokenizers (byte-level
BPE and SentencePiece) always spell a JSON object, a schema's object or a regex's match, as json.loads, a schema check
written here and re.fullmatch judge them; EOS is allowed exactly where the output is complete; bad requests are
one-line GrammarErrors naming the field."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fd_core.errors import ConfigError
from fd_core.runtime import load_tokenizer
from fd_core.runtime.text.tokenizer import Tokenizer
from kit import tokenizer_dirs  # noqa: F401 - fixture

pytest.importorskip("llguidance", reason="structured output's llguidance comes with the serve and test extras")

from fd_core.runtime.text.grammar import Constraint, GrammarError, Grammars, constraint_spec  # noqa: E402

KINDS = ["bpe", "sp"]
WIDTH = 512  # the model's logits width, past both tokenizers' vocabularies (406 and 420 ids)
STEPS = 200
WALKS = 24

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
REGEXES = [r"[a-z]{2,5}@(foo|bar)\.com", r"[0-9]{1,3}(\.[0-9]+)?", r"(yes|no|maybe)!?"]


@pytest.fixture(scope="module")
def grammars(tokenizer_dirs: dict[str, Path]) -> dict[str, Grammars]:  # noqa: F811
    return {kind: Grammars(load_tokenizer(tokenizer_dirs[kind]), WIDTH) for kind in KINDS}


def json_object(text: str) -> Any:
    """The object `text` parses to, or None when it is not one whole JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def fits_schema(value: Any) -> bool:
    """SCHEMA checked directly: an object with exactly the known keys, the required ones, each of its type."""
    if not isinstance(value, dict) or not set(value) <= set(SCHEMA["properties"]):
        return False
    if not {"name", "age", "kind"} <= set(value):
        return False
    name, age, kind, tags = value["name"], value["age"], value["kind"], value.get("tags", [])
    return (isinstance(name, str) and len(name) <= 6
            and isinstance(age, int) and not isinstance(age, bool) and 0 <= age <= 150
            and kind in ("cat", "dog", "bird")
            and isinstance(tags, list) and len(tags) <= 2 and all(isinstance(t, bool) for t in tags))


def walk(grammars: Grammars, spec: str, rng: np.random.Generator, complete: Any) -> tuple[str, bool]:
    """A random walk: a random allowed token each step until done, EOS or STEPS tokens. Checks at every step that
    EOS is allowed exactly when `complete(text so far)`, and that no id past the tokenizer or special is allowed.
    Returns the text and whether the walk finished (done or EOS)."""
    tokenizer, constraint = grammars.tokenizer, grammars.matcher(spec)
    eos = grammars.eos_ids[0]
    never = [i for i in range(WIDTH) if tokenizer.token_bytes(i) is None or i in tokenizer.special_ids and i != eos]
    ids: list[int] = []
    for _ in range(STEPS):
        allowed = constraint.allowed()
        text = tokenizer.decode(ids)
        assert bool(allowed[eos]) == complete(text), (text, bool(allowed[eos]))
        assert not allowed[never].any()
        token = int(rng.choice(np.flatnonzero(allowed)))
        if token == eos:
            return text, True
        constraint.advance(token)
        ids.append(token)
        if constraint.done:
            text = tokenizer.decode(ids)
            assert complete(text) and np.flatnonzero(constraint.allowed()).tolist() == [eos], text
            return text, True
    return tokenizer.decode(ids), False


def walks(grammars: Grammars, spec: str, complete: Any, seed: int) -> list[str]:
    """The texts of the finished walks of WALKS seeded ones; most must finish."""
    rng = np.random.default_rng(seed)
    finished = [text for text, ok in (walk(grammars, spec, rng, complete) for _ in range(WALKS)) if ok]
    assert len(finished) >= WALKS // 3, f"only {len(finished)} of {WALKS} walks finished"
    return finished


@pytest.mark.parametrize("kind", KINDS)
def test_random_walks_spell_json_objects(grammars: dict[str, Grammars], kind: str) -> None:
    spec = constraint_spec({"type": "json_object"})
    assert spec is not None
    for text in walks(grammars[kind], spec, lambda t: json_object(t) is not None, seed=1):
        assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("kind", KINDS)
def test_random_walks_spell_the_schemas_objects(grammars: dict[str, Grammars], kind: str) -> None:
    spec = constraint_spec(SCHEMA_FORMAT)
    assert spec is not None
    finished = walks(grammars[kind], spec, lambda t: fits_schema(json_object(t)), seed=2)
    for text in finished:
        assert fits_schema(json.loads(text)), text
    assert len({json.loads(text)["kind"] for text in finished}) > 1  # the walks explore, not one forced answer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("regex", REGEXES)
def test_random_walks_fully_match_the_regex(grammars: dict[str, Grammars], kind: str, regex: str) -> None:
    spec = constraint_spec(None, regex)
    assert spec is not None
    finished = walks(grammars[kind], spec, lambda t: re.fullmatch(regex, t) is not None, seed=3)
    assert len(finished) == WALKS  # each of these regexes ends within a few tokens
    for text in finished:
        assert re.fullmatch(regex, text), text
    assert len(set(finished)) > 1


def spell(constraint: Constraint, tokenizer: Tokenizer, text: str) -> None:
    """Advance through `text`, each step the longest allowed token that spells its next bytes."""
    rest = text.encode("utf-8")
    while rest:
        allowed = np.flatnonzero(constraint.allowed())
        fits = [i for i in allowed if rest.startswith(tokenizer.token_bytes(int(i)) or b"\0")]
        assert fits, f"no allowed token spells the start of {rest!r}"
        token = max(fits, key=lambda i: len(tokenizer.token_bytes(int(i)) or b""))
        constraint.advance(int(token))
        rest = rest[len(tokenizer.token_bytes(int(token)) or b""):]


@pytest.mark.parametrize("kind", KINDS)
def test_eos_only_once_the_json_is_complete(grammars: dict[str, Grammars], kind: str) -> None:
    spec = constraint_spec({"type": "json_object"})
    assert spec is not None
    constraint, tokenizer = grammars[kind].matcher(spec), grammars[kind].tokenizer
    eos = grammars[kind].eos_ids[0]
    for part in ['{"a', '":', " [1, ", '{"b": "x"}', "]"]:
        spell(constraint, tokenizer, part)
        assert not constraint.allowed()[eos] and not constraint.done, part
    spell(constraint, tokenizer, "}")
    assert constraint.done and constraint.allowed()[eos]
    constraint.advance(eos)


@pytest.mark.parametrize("kind", KINDS)
def test_a_disallowed_token_is_refused(grammars: dict[str, Grammars], kind: str) -> None:
    spec = constraint_spec(None, r"ab+")
    assert spec is not None
    constraint, tokenizer = grammars[kind].matcher(spec), grammars[kind].tokenizer
    allowed = constraint.allowed()
    assert allowed.dtype == np.bool_ and allowed.shape == (WIDTH,)
    refused = [i for i in range(WIDTH) if not allowed[i]]
    b = next(i for i in refused if tokenizer.token_bytes(i) == b"b")
    for token in (b, grammars[kind].eos_ids[0], WIDTH - 1, WIDTH, -1):
        with pytest.raises(ValueError, match=f"^token {token} is not allowed by the output's grammar at this point$"):
            constraint.advance(token)
    spell(constraint, tokenizer, "ab")  # a refused token leaves the constraint as it was
    assert constraint.allowed()[grammars[kind].eos_ids[0]]


@pytest.mark.parametrize("kind", KINDS)
def test_mask_sets_the_disallowed_logits_to_minus_infinity(grammars: dict[str, Grammars], kind: str) -> None:
    spec = constraint_spec(SCHEMA_FORMAT)
    assert spec is not None
    constraint = grammars[kind].matcher(spec)
    row = np.random.default_rng(0).standard_normal(WIDTH).astype(np.float32)
    before = row.copy()
    masked = constraint.mask(row)
    allowed = constraint.allowed()
    assert masked.dtype == np.float32 and np.array_equal(row, before)
    assert np.array_equal(masked[allowed], row[allowed]) and np.all(np.isneginf(masked[~allowed]))
    assert 0 < allowed.sum() < WIDTH
    with pytest.raises(ValueError, match="expected"):
        constraint.mask(row[:-1])


def test_every_eos_id_ends_a_complete_output(tokenizer_dirs: dict[str, Path]) -> None:  # noqa: F811
    tokenizer = load_tokenizer(tokenizer_dirs["bpe"])
    im_end, endoftext = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    assert im_end is not None and endoftext is not None
    grammars = Grammars(tokenizer, WIDTH, eos_ids=[im_end, endoftext])
    spec = constraint_spec(None, r"(ab)+")
    assert spec is not None and grammars.eos_ids == (im_end, endoftext)
    constraint = grammars.matcher(spec)
    assert not constraint.allowed()[[im_end, endoftext]].any()
    spell(constraint, tokenizer, "ab")
    assert constraint.allowed()[[im_end, endoftext]].all() and not constraint.done
    constraint.advance(endoftext)  # the second EOS id ends the output as the first does
    assert constraint.done and np.flatnonzero(constraint.allowed()).tolist() == sorted([im_end, endoftext])


def test_specs_are_plain_picklable_data(grammars: dict[str, Grammars]) -> None:
    assert constraint_spec(None) is None and constraint_spec({"type": "text"}) is None
    spec = constraint_spec(SCHEMA_FORMAT)
    assert isinstance(spec, str) and pickle.loads(pickle.dumps(spec)) == spec
    assert constraint_spec({"type": "json_schema", "json_schema": {"name": "any"}}) == constraint_spec(
        {"type": "json_object"})  # OpenAI's schema is optional: any JSON object


BAD = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, None,
     "response_format.json_schema.schema: Invalid type: objectx"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}, None,
     "response_format.json_schema.schema: Pointer '/$defs/missing' does not exist"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a(b"}}}, None,
     "response_format.json_schema.schema: invalid regex: unclosed group"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": float("nan")}}}, None,
     "response_format.json_schema.schema holds NaN or Infinity, which JSON has no value for"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": b"x"}}}, None,
     "response_format.json_schema.schema is not JSON: Object of type bytes is not JSON serializable"),
    (None, "a(b", "guided_regex: invalid regex: unclosed group"),
    (None, r"(a)\1", "guided_regex: invalid regex: backreferences are not supported"),
    (None, "", "guided_regex must be a non-empty regular expression string, got str \"\""),
    ({"type": "json_object"}, "a+", "guided_regex and response_format 'json_object' both constrain the output; send one"),
    ("json", None, "response_format must be an object, got str \"json\""),
    ({"type": "xml"}, None, "response_format.type must be one of text, json_object, json_schema, got str \"xml\""),
    ({}, None, "response_format.type must be one of text, json_object, json_schema, got NoneType null"),
    ({"type": "json_schema"}, None,
     "response_format.json_schema must be an object with name and schema, got NoneType null"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, None,
     "response_format.json_schema.name must be 1 to 64 letters, digits, underscores or dashes, got NoneType null"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, None,
     "response_format.json_schema.name must be 1 to 64 letters, digits, underscores or dashes, got str \"a b\""),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}}, None,
     "response_format.json_schema.strict must be true or false, got str \"yes\""),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, None,
     "response_format.json_schema.schema must be a JSON schema object, got list [1]"),
]


@pytest.mark.parametrize(("response_format", "regex", "message"), BAD)
def test_a_bad_request_is_one_line_naming_the_field(response_format: Any, regex: Any, message: str) -> None:
    with pytest.raises(GrammarError) as caught:
        constraint_spec(response_format, regex)
    assert str(caught.value) == message and isinstance(caught.value, ConfigError)


def test_the_grammar_engine_does_not_import_torch(tokenizer_dirs: dict[str, Path]) -> None:  # noqa: F811
    code = (
        "import sys\n"
        "from fd_core.runtime import load_tokenizer\n"
        "from fd_core.runtime.text.grammar import Grammars, constraint_spec\n"
        f"c = Grammars(load_tokenizer({str(tokenizer_dirs['bpe'])!r}), 512).matcher(constraint_spec(None, 'a+'))\n"
        "c.advance(int(c.allowed().nonzero()[0][0]))\n"
        "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "[]\n", done.stderr


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": -2**63, "maximum": -2**63},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": -2**63 + 5, "maximum": -2**63 + 9}}},
    {"type": "integer", "exclusiveMaximum": 1e300},
], ids=["at -2^63", "nested near -2^63", "a float bound of an integer"])
def test_a_numeric_bound_past_what_json_exchanges_is_refused_before_llguidance(schema: dict[str, Any]) -> None:
    """llguidance 1.9.1 ends the process with SIGSEGV on an integer range near -2^63 (a client could crash fd serve
    with one request): such bounds are refused first, naming the field. In a subprocess, as the crash would be."""
    code = ("import json, sys\nfrom fd_core.runtime.text.grammar import GrammarError, constraint_spec\n"
            "try:\n    constraint_spec({'type': 'json_schema', 'json_schema': {'name': 'n', 'schema': json.loads("
            "sys.argv[1])}})\nexcept GrammarError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(schema)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
    assert done.stdout.startswith("response_format.json_schema.schema: ") and "2^53 - 1" in done.stdout, done.stdout
