"""Structured output: generation constrained to a JSON object, a JSON schema (OpenAI's `response_format`) or a regular
expression (an extension field, as vLLM's `guided_regex`), as a mask of the tokens allowed next, applied to the logits
before sampling.

The grammar engine is llguidance (`pip install llguidance`, in the `serve` extra): a Rust library with Python bindings
that needs neither torch nor transformers at run time, computes each mask lazily (no per-schema precomputation over
the vocabulary) and takes JSON schemas, regular expressions and Lark grammars. xgrammar requires torch, transformers
and triton; outlines-core compiles each schema to one regular expression and then to an index over the whole
vocabulary up front.

    spec = constraint_spec({"type": "json_object"})      # plain str: picklable, checked without a tokenizer
    grammars = Grammars(tokenizer, vocab_size)           # once per tokenizer (building it walks the vocabulary)
    constraint = grammars.matcher(spec)                  # once per sequence
    logits = constraint.mask(logits)                     # before sampling; then constraint.advance(token)
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from fd_core.errors import ConfigError, install_hint
from fd_core.runtime.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

RESPONSE_TYPES = ("text", "json_object", "json_schema")
REGEX_FIELD = "guided_regex"  # the request field a regex constraint comes from, named in messages
# OpenAI's rule for response_format.json_schema.name.
SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
ANY_OBJECT: dict[str, Any] = {"type": "object"}  # json_object: any JSON object (with any keys and values)
# JSON as json.dumps writes it, one space after each separator and no other whitespace between values: a model may
# otherwise spend its tokens on whitespace, which JSON allows anywhere (a schema's own "x-guidance" options win).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SPECIAL_MARK = 0xFF  # llguidance's first byte of a special token's text; never the first byte of UTF-8
COMPILED_KEPT = 16  # grammars a Grammars keeps compiled (Grammars.matcher)


# llguidance's limits for every grammar fd compiles, at request time and in the engine alike: its defaults for the
# grammar's size and the lexer's states, a smaller lexer fuel a step (a sequence's mask in the shared step costs at
# most about this), and errors without the grammar's internals (they go to clients).
LIMITS = {"step_lexer_fuel": 100_000, "verbose_errors": False}
NOTHING_ALLOWED = ("no token can continue the output (a $ref that only refers to itself, or a pattern that matches "
                   "nothing, admits no output at all); fix the schema or the pattern")


class GrammarError(ConfigError):
    """A response_format or regex that cannot constrain generation: a malformed shape, schema or pattern."""


def _llguidance() -> Any:
    """The llguidance module, or a one-line error saying how to install it (it is an optional dependency)."""
    try:
        import llguidance
    except ImportError:
        # A ConfigError, not a GrammarError: the server lacks a package, the request is not at fault.
        raise ConfigError(
            "structured output (response_format json_object/json_schema, guided_regex) needs the llguidance package; "
            f"install it with {install_hint('serve')}, or pip install llguidance"
        ) from None
    return llguidance


def _one_line(message: str) -> str:
    """llguidance's message in one line and in a client's terms: a regex error's `error: ...` line, else the first
    line, with the Rust library's internal names (its error variants, `Some(..)`) put in words."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    detail = next((line for line in lines if line.startswith("error: ")), None)
    if detail is not None:
        return f"invalid regex: {detail[len('error: '):]}"
    line = lines[0] if lines else "invalid grammar"
    if "NoExtensionBias" in line:
        return NOTHING_ALLOWED
    if "integer range" in line:
        return ("an integer bound past what a 64-bit integer holds (-2^63 .. 2^63 - 1) cannot be generated; bound "
                "integers within that range")
    return re.sub(r"\bSome\(([^()]*)\)", r"\1", line)


def _describe(value: Any) -> str:
    """A value's JSON type and a short rendering, for messages."""
    text = json.dumps(value, default=str)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _limits() -> Any:
    return _llguidance().LLParserLimits(**LIMITS)


def _checked(grammar: str, field: str) -> str:
    """`grammar` once llguidance has compiled it without a tokenizer; a GrammarError naming `field` otherwise."""
    error = _llguidance().LLMatcher.validate_grammar(grammar, limits=_limits())
    if error:
        raise GrammarError(f"{field}: {_one_line(error)}")
    return grammar


def lark_grammar(lark: str, field: str = "grammar") -> str:
    """A Lark grammar in llguidance's dialect (JSON schemas inside it as `%json {...}`) as a checked grammar."""
    return _checked(_llguidance().LLMatcher.grammar_from_lark(lark), field)


# The numeric bounds of a JSON schema, and the largest magnitude fd passes on: the integers JSON exchanges exactly
# (RFC 8259, section 6). llguidance 1.9.1 crashes the process (SIGSEGV) on an integer range near -2^63.
BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_BOUND = 2**53 - 1


def check_schema_numbers(schema: Any, field: str) -> None:
    """A GrammarError naming `field` when a numeric bound of an integer schema (or one of no type) anywhere in
    `schema` is past +-(2^53 - 1): llguidance makes those integer ranges."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            kind = node.get("type")
            integer = kind is None or kind == "integer" or (isinstance(kind, list) and "integer" in kind)
            for key, value in node.items():
                if (integer and key in BOUND_KEYWORDS and isinstance(value, (int, float))
                        and not isinstance(value, bool) and abs(value) > MAX_BOUND):
                    shown = str(value) if isinstance(value, int) else f"{value:g}"
                    raise GrammarError(
                        f"{field}: {key} {shown} is past -(2^53 - 1) .. 2^53 - 1, the integers JSON exchanges "
                        f"exactly; bound numbers within that range"
                    )
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def _schema_grammar(schema: Mapping[str, Any], field: str) -> str:
    """The llguidance grammar of a JSON schema."""
    try:
        # allow_nan=False: NaN and Infinity are not JSON, and a schema holding them is malformed.
        text = json.dumps(schema, allow_nan=False)
    except ValueError:
        raise GrammarError(f"{field} holds NaN or Infinity, which JSON has no value for") from None
    except TypeError as exc:  # a non-JSON value from a Python caller (the HTTP server's JSON has none)
        raise GrammarError(f"{field} is not JSON: {exc}") from None
    check_schema_numbers(schema, field)
    try:
        grammar = _llguidance().LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
    except ValueError as exc:
        raise GrammarError(f"{field}: {_one_line(str(exc))}") from None
    return _checked(grammar, field)


def constraint_spec(response_format: Mapping[str, Any] | None, regex: str | None = None) -> str | None:
    """The llguidance grammar (a plain string, picklable) that `response_format` or `regex` asks for; None for free
    text. A malformed request is a one-line GrammarError naming the field."""
    kind: Any = "text"  # what the client sent, checked below
    if response_format is not None:
        if not isinstance(response_format, Mapping):
            raise GrammarError(f"response_format must be an object, got {_describe(response_format)}")
        kind = response_format.get("type")
        if kind not in RESPONSE_TYPES:
            raise GrammarError(
                f"response_format.type must be one of {', '.join(RESPONSE_TYPES)}, got {_describe(kind)}"
            )
    if regex is not None:
        if kind != "text":
            # Two constraints on one output would have to be intersected; ask for one.
            raise GrammarError(f"{REGEX_FIELD} and response_format {kind!r} both constrain the output; send one")
        if not isinstance(regex, str) or not regex:
            raise GrammarError(f"{REGEX_FIELD} must be a non-empty regular expression string, got {_describe(regex)}")
        return _checked(_llguidance().LLMatcher.grammar_from_regex(regex), REGEX_FIELD)
    if kind == "text":
        return None
    assert response_format is not None
    if kind == "json_object":
        return _schema_grammar(ANY_OBJECT, "response_format")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise GrammarError(
            f"response_format.json_schema must be an object with name and schema, got {_describe(spec)}"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise GrammarError(
            f"response_format.json_schema.name must be 1 to 64 letters, digits, underscores or dashes, "
            f"got {_describe(name)}"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise GrammarError(f"response_format.json_schema.strict must be true or false, got {_describe(strict)}")
    # strict false still constrains the output: the schema is what the client asked for, and fd has no looser mode.
    schema = spec.get("schema", ANY_OBJECT)  # OpenAI's schema is optional: without one, any JSON object
    if not isinstance(schema, Mapping):
        raise GrammarError(f"response_format.json_schema.schema must be a JSON schema object, got {_describe(schema)}")
    return _schema_grammar(schema, "response_format.json_schema.schema")


class _Vocabulary:
    """What llguidance's LLTokenizer reads from a Python tokenizer (its TokenizerWrapper protocol): each id's bytes, the
    special ids and EOS, and a tokenize function whose tokens spell exactly the bytes given."""

    is_tokenizer_wrapper = True  # the attribute LLTokenizer checks for

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], eos: int | None, special: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = None  # llguidance keeps it but never uses it
        self.special_token_ids = list(special)
        skip = set(special)
        self.by_bytes: dict[bytes, int] = {}  # text token bytes -> the lowest id spelling them, for greedy fallback
        for token_id, data in enumerate(tokens):
            if data and token_id not in skip and data[0] != SPECIAL_MARK:
                self.by_bytes.setdefault(data, token_id)
        self.longest = max(map(len, self.by_bytes), default=1)

    def __call__(self, text: str) -> list[int]:
        """Token ids spelling `text`: the tokenizer's own when they spell it exactly, else greedy longest matches.

        llguidance tokenizes the bytes a grammar forces (a property name, say) and allows only the first of those
        tokens, so they must spell those bytes: a SentencePiece encode adds a leading "▁", and an encode can turn
        text into a special token. Called from Rust, which cannot take an exception here: it never raises."""
        data = text.encode("utf-8")
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if all(0 <= i < len(self.tokens) for i in ids) and b"".join(self.tokens[i] for i in ids) == data:
                return ids
        except Exception:  # noqa: BLE001 - any failure of the tokenizer falls back to the greedy spelling
            pass
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        """The longest token at each position; a byte no token spells is skipped."""
        ids: list[int] = []
        start = 0
        while start < len(data):
            for end in range(min(len(data), start + self.longest), start, -1):
                token_id = self.by_bytes.get(data[start:end])
                if token_id is not None:
                    ids.append(token_id)
                    start = end
                    break
            else:
                start += 1
        return ids


class Grammars:
    """Builds per-sequence constraints for one tokenizer and one logits width; build it once (it reads every token)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Iterable[int] | None = None) -> None:
        llguidance = _llguidance()
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        if eos_ids is None:
            eos = tokenizer.role_id("eos_token")
            eos_ids = [] if eos is None else [eos]
        # Ids past the logits width can never be sampled; ids past the tokenizer's vocabulary (padding of the
        # embedding) have no text: b"" is a token llguidance never allows.
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids if 0 <= int(i) < self.vocab_size))
        tokens = [tokenizer.token_bytes(i) or b"" for i in range(self.vocab_size)]
        special = sorted({i for i in tokenizer.special_ids if 0 <= i < self.vocab_size} | set(self.eos_ids))
        # llguidance knows one EOS id; a grammar allows it where the output is complete, and the others follow it.
        # With none, it appends an id of its own past the logits width, which the mask drops.
        vocabulary = _Vocabulary(tokenizer, tokens, self.eos_ids[0] if self.eos_ids else None, special)
        self.lltokenizer: LLTokenizer = llguidance.LLTokenizer(vocabulary)
        self.width = self.lltokenizer.vocab_size  # llguidance's vocabulary (vocab_size, or one more for its EOS)
        self._lock = threading.Lock()
        # spec -> (its matcher at the start, the seconds compiling it and its first mask took, that mask)
        self._compiled: OrderedDict[str, tuple[LLMatcher, float, np.ndarray]] = OrderedDict()

    def matcher(self, spec: str) -> Constraint:
        """A new constraint for one sequence, following the grammar `spec` (from constraint_spec).

        The latest grammars are kept compiled with their first mask computed (their lexer built): the n choices of one
        request, and a request checked before the engine runs it (check_followable), compile it once."""
        with self._lock:
            kept = self._compiled.get(spec)
            if kept is not None:
                self._compiled.move_to_end(spec)
        if kept is None:
            start = time.perf_counter()
            llguidance = _llguidance()
            # log_level 0: a grammar's problems become GrammarError here rather than lines on the server's stderr.
            compiled = llguidance.LLMatcher(self.lltokenizer, spec, log_level=0, limits=_limits())
            if compiled.is_error():
                raise GrammarError(f"grammar: {_one_line(compiled.get_error())}")
            # Its first mask, on the kept matcher itself (its state stays the start): a grammar that admits nothing
            # fails here, and every sequence of it starts from this mask instead of computing it again.
            first = Constraint(self, compiled).allowed()
            kept = (compiled, time.perf_counter() - start, first)
            with self._lock:
                self._compiled[spec] = kept
                while len(self._compiled) > COMPILED_KEPT:
                    self._compiled.popitem(last=False)
        return Constraint(self, kept[0].deep_copy(), kept[2])

    def cost(self, spec: str) -> float | None:
        """How many seconds compiling `spec` and its first mask took, while it is kept compiled (else None)."""
        with self._lock:
            kept = self._compiled.get(spec)
        return None if kept is None else kept[1]


class Constraint:
    """One sequence's constraint: which tokens may come next, and the tokens chosen so far."""

    def __init__(self, grammars: Grammars, matcher: LLMatcher, first: np.ndarray | None = None) -> None:
        import llguidance.numpy

        self.grammars = grammars
        self._matcher = matcher
        self._fill = llguidance.numpy.fill_next_token_bitmask
        self._bits = llguidance.numpy.allocate_token_bitmask(1, grammars.width)
        # This step's mask, until a token is consumed (`first`: the start's, computed once for the grammar).
        self._allowed: np.ndarray | None = first

    def allowed(self) -> np.ndarray:
        """A read-only bool array [vocab_size]: the tokens that keep the output valid (EOS only once it is complete)."""
        if self._allowed is None:
            self._fail_if_broken()
            self._fill(self._matcher, self._bits)
            self._fail_if_broken()
            # One bit per id, least significant first in each 32-bit word; as little-endian bytes, bit order "little"
            # lists the ids in order.
            little = self._bits[0].astype("<u4", copy=False).view(np.uint8)
            allowed = np.unpackbits(little, bitorder="little")[: self.grammars.vocab_size].astype(bool)
            eos = self.grammars.eos_ids
            if len(eos) > 1:
                allowed[list(eos[1:])] = allowed[eos[0]]
            allowed.flags.writeable = False  # the cached mask is shared by mask() and advance()
            if not allowed.any():  # nothing may follow, not even EOS: sampling from it would pick any token
                raise GrammarError(f"grammar: {NOTHING_ALLOWED}")
            self._allowed = allowed
        return self._allowed

    def advance(self, token_id: int) -> None:
        """Consume the sampled token; a ValueError if the constraint did not allow it."""
        token_id = int(token_id)
        if not 0 <= token_id < self.grammars.vocab_size or not self.allowed()[token_id]:
            raise ValueError(f"token {token_id} is not allowed by the output's grammar at this point")
        eos = self.grammars.eos_ids
        if not self._matcher.consume_token(eos[0] if token_id in eos else token_id):
            self._fail_if_broken()
        self._allowed = None

    def ahead(self, tokens: Sequence[int]) -> tuple[int, list[np.ndarray]]:
        """How many of `tokens` (speculative decoding's proposals) the constraint allows in a row (an end-of-sequence id
        ends the run, itself counted), and the mask at each of those positions and the one after them (len + 1
        masks); the constraint is left where it was."""
        masks: list[np.ndarray] = []
        taken = consumed = 0
        eos = set(self.grammars.eos_ids)
        try:
            for token in (int(t) for t in tokens):
                masks.append(self.allowed())
                if not 0 <= token < self.grammars.vocab_size or not masks[-1][token]:
                    break
                taken += 1
                if token in eos:  # the output ends there: nothing after it is chosen, whatever its mask
                    masks.append(masks[-1])
                    break
                self.advance(token)
                consumed += 1
            else:
                masks.append(self.allowed())
        finally:
            if consumed:
                self._matcher.rollback(consumed)
                self._allowed = None
        self._fail_if_broken()
        return taken, masks

    @property
    def done(self) -> bool:
        """Whether the output is complete and nothing more may follow it (but EOS)."""
        return self._matcher.is_accepting() and self._matcher.is_stopped() and not self._matcher.is_error()

    def mask(self, row: np.ndarray) -> np.ndarray:
        """A copy of the logits `row` [vocab_size] with every disallowed token at -inf."""
        if row.shape != (self.grammars.vocab_size,):
            raise ValueError(f"logits row of shape {row.shape}, expected ({self.grammars.vocab_size},)")
        return np.where(self.allowed(), row, np.array(-np.inf, dtype=row.dtype))

    def _fail_if_broken(self) -> None:
        """A GrammarError once llguidance's matcher has failed (a grammar past its limits); it cannot recover."""
        if self._matcher.is_error():
            raise GrammarError(f"grammar: {_one_line(self._matcher.get_error())}")


_SHARED: "weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, tuple[int, ...] | None], Grammars]]" = (
    weakref.WeakKeyDictionary()
)
_SHARED_LOCK = threading.Lock()


def grammars_for(tokenizer: Tokenizer, vocab_size: int, eos_ids: Iterable[int] | None = None) -> Grammars:
    """The one Grammars of this tokenizer, logits width and EOS ids in this process (building one reads every token;
    the request checks and the engine share it, and so its compiled grammars)."""
    key = (int(vocab_size), None if eos_ids is None else tuple(eos_ids))
    with _SHARED_LOCK:
        found = _SHARED.setdefault(tokenizer, {}).get(key)
    if found is None:
        found = Grammars(tokenizer, vocab_size, eos_ids)
        with _SHARED_LOCK:
            found = _SHARED[tokenizer].setdefault(key, found)
    return found


def check_followable(spec: str, grammars: Grammars, timeout_s: float) -> None:
    """A GrammarError unless `spec` compiles for the model's tokens, allows a first token, and did both within
    `timeout_s` seconds: what the engine would otherwise meet in the shared step, refused before any rank sees it."""
    start = time.perf_counter()
    grammars.matcher(spec)
    # The first compile's time, also when it is kept compiled: a grammar refused once is refused every time.
    elapsed = grammars.cost(spec) or time.perf_counter() - start
    if elapsed > timeout_s:
        raise GrammarError(
            f"grammar: it took {elapsed:.1f} s to compile for the model's tokens, past the budget of "
            f"{timeout_s:g} s; simplify the schema or pattern (fewer alternatives, smaller repetition counts), or "
            f"raise the grammar timeout"
        )
