"""Choosing the next token: greedy, or sampling with temperature, top-k and top-p from a seeded generator; and the
chosen token's log-probability (with the most likely tokens of its step) for the sequences that ask."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from fd_core.errors import ConfigError

# The smallest positive temperature: below it float32 logits divided by it overflow (1e-310 made every
# probability NaN and every token the last id), whatever the platform's sample op.
MIN_TEMPERATURE = 1e-5
# The most alternatives a step's logprobs may list (OpenAI's chat top_logprobs limit, and vLLM's default).
MAX_LOGPROBS = 20
# The most choices one prompt may ask for (SamplingParams.n).
MAX_CHOICES = 64
# OpenAI's ranges: presence and frequency penalties in [-2, 2], a logit bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0

if TYPE_CHECKING:
    import numpy as np


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to generate: how many tokens, greedy or sampled, and where to stop.

    `temperature` 0 is greedy (the default). Sampling applies temperature, then top-k (0: all tokens),
    then top-p (1.0: all), as transformers does. The same `seed` gives the same tokens.
    `stop` strings end a sequence; its text is cut before the stop string (one str is one stop string).
    `logprobs` None returns none; 0 returns each generated token's log-probability, and k (up to 20) also the k most
    likely tokens of its step (TokenLogprob): the log-softmax of the model's raw logits, before the penalties, bias,
    temperature, top-k and top-p, as vLLM returns them by default.

    Before the token is chosen (greedy too), in this order: `repetition_penalty` (1: none) divides a positive logit
    and multiplies a negative one of every token the prompt or the output holds; `frequency_penalty` times how often
    the output holds a token, and `presence_penalty` once if it holds it at all, are subtracted (OpenAI's and vLLM's
    penalties: the prompt does not count for them); `logit_bias` ({token id: bias in [-100, 100]}) is added; while
    fewer than `min_tokens` tokens are out, the end-of-sequence ids are excluded; then, sampling, `min_p` (0: none)
    excludes every token less likely than min_p times the likeliest, after temperature and before top-k and top-p.

    `grammar` (None: free text) constrains the output to a grammar made by fd_core.runtime.text.grammar's
    constraint_spec (a JSON object, a JSON schema, a regular expression): tokens that would break it are excluded
    last, after everything above, and the sequence ends ("stop") once the output is complete.

    `n` choices are generated for each prompt, each its own sequence with its own sampler (one seed gives n different
    samples; greedy, n equal ones), sharing the prompt's cached blocks.

    `prompt_logprobs` None scores no prompt; k (0 to 20) gives the completion's prompt_logprobs: for each prompt token
    after the first, its log-probability given the tokens before it and the k most likely there (the raw logits'
    log-softmax, as `logprobs`); the first token's entry is None. Such a prompt finds no cached prefix; it is scored in
    its prefill chunks (at most 128 tokens a step) through the model's prefill_every, or, for a model without it, a
    token a decode step (docs/python-api.md). Text prompts only.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    n: int = 1
    grammar: str | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # One stop string given as a str is that string (a str is also a sequence: of single characters).
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) for s in stop):
            raise ConfigError(f"stop must be a string or a list of strings, got {stop!r:.60}")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name in ("max_new_tokens", "top_k", "seed", "min_tokens", "n"):
            if not _integer(getattr(self, name)):
                raise ConfigError(f"{name} must be an integer, got {getattr(self, name)!r:.40}")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            if not _number(getattr(self, name)) or not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{name} must be a finite number, got {getattr(self, name)!r:.40}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be finite and >= 0 (0 is greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError(
                f"temperature {self.temperature:g} is below {MIN_TEMPERATURE:g}, where logits / temperature "
                f"overflow and sampling is undefined; pass 0 for greedy decoding (what such a temperature "
                f"approaches) or at least {MIN_TEMPERATURE:g}"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if any(not s for s in self.stop):
            raise ConfigError("a stop string must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ConfigError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0: none), got "
                                  f"{getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0 (1: none), got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1] (0: none), got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_tokens must be in 0..max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ConfigError("grammar must be a grammar from fd_core.runtime.text.grammar.constraint_spec, or None")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ConfigError(f"n must be in 1..{MAX_CHOICES} (the choices per prompt), got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _integer(value):
                raise ConfigError(f"{name} must be an integer or None, got {value!r:.40}")
            if not 0 <= value <= MAX_LOGPROBS:
                what = "the chosen token's" if name == "logprobs" else "each prompt token's"
                raise ConfigError(f"{name} must be in 0..{MAX_LOGPROBS} (0: {what} only; None: none), got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as the sorted (token id, bias) pairs it is kept as."""
        return tuple(self.logit_bias)  # type: ignore[arg-type]  # made pairs in __post_init__

    @property
    def penalized(self) -> bool:
        """Whether the penalties change any logit (the apply_penalties op runs for this sequence)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def processed(self) -> bool:
        """Whether anything changes the logits before the sample op (penalties, bias, min_tokens, min_p, grammar)."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or (self.min_p > 0 and not self.greedy)
                or self.grammar is not None)

    def with_defaults(self, defaults: Mapping[str, Any], given: Sequence[str]) -> "SamplingParams":
        """These settings with generation_config.json's sampling defaults for the fields not in `given`."""
        if not defaults.get("do_sample"):
            return self
        keep = {
            k: v for k, v in defaults.items()
            if k in ("temperature", "top_p", "top_k") and k not in given and v is not None
        }
        return replace(self, **keep)


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs (plain, hashable data), from a mapping or from such pairs."""
    items: Any = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = [(token, value) for token, value in items]
    except (TypeError, ValueError):
        raise ConfigError(f"logit_bias must map token ids to biases, got {bias!r:.60}") from None
    for token, value in pairs:
        if not _integer(token) or token < 0:
            raise ConfigError(f"logit_bias keys must be token ids (integers >= 0), got {token!r:.40}")
        if not _number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ConfigError(f"logit_bias[{token}] must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                              f"got {value!r:.40}")
    if len({token for token, _ in pairs}) != len(pairs):
        raise ConfigError("logit_bias names a token id twice")
    return tuple(sorted((int(token), float(value)) for token, value in pairs))


class Sampler:
    """Each sequence's own generator, seeded by (seed, the prompt's index in its request), and the sample op.

    Every rank holds the same logits (the vocabulary-parallel head ends in an all-reduce) and the same
    seed, so every rank draws the same uniform numbers, and the sample op the same tokens, without
    another collective.
    """

    def __init__(self, params: SamplingParams, indexes: Sequence[int]) -> None:
        import numpy as np

        self.params = params
        self.rngs = [np.random.default_rng([params.seed, i]) for i in indexes]

    def uniforms(self) -> list[float]:
        """The next uniform number of each generator (zeros, drawing nothing, when greedy: a greedy request leaves the
        generators where a sampled one would find them)."""
        return [0.0] * len(self.rngs) if self.params.greedy else [float(rng.random()) for rng in self.rngs]

    def choose(self, logits: Any, sample: Callable[..., list[int]]) -> list[int]:
        """One token per row of logits [B, vocab], through `sample` (the Backend's sample op)."""
        p = self.params
        return [int(t) for t in sample(logits, p.temperature, p.top_k, p.top_p, self.uniforms())]


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and, when asked, the most likely tokens of its step.

    `logprob` is the chosen token's entry of the log-softmax of that step's raw logits (before temperature, top-k and
    top-p), computed on the host in float64 from the float32 logits; `top` holds (token id, logprob) of the k most
    likely tokens, most likely first (ties: the lower id first). Plain data: it crosses process boundaries.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(rows: Any) -> Any:
    """log_softmax over the last axis, in float64 (the logits widened from float32 first)."""
    import numpy as np

    x = np.asarray(rows, dtype=np.float32).astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def most_likely(row: Any, k: int) -> tuple[tuple[int, float], ...]:
    """The k largest entries of one row of logprobs as (id, logprob), largest first, ties by the lower id first."""
    import numpy as np

    k = min(k, int(row.shape[-1]))
    if k <= 0:
        return ()
    # Every id at or above the k-th largest value (ties at the boundary included), then the k first by (-value, id).
    threshold = np.partition(row, row.shape[-1] - k)[row.shape[-1] - k]
    ids = np.flatnonzero(row >= threshold)
    ids = ids[np.lexsort((ids, -row[ids]))[:k]]
    return tuple((int(i), float(row[i])) for i in ids)


def token_logprobs(rows: Any, tokens: Sequence[int], tops: Sequence[int]) -> list[TokenLogprob]:
    """Each chosen token's TokenLogprob from its step's logits (rows [n, vocab], float32 as the model gave them), with
    `tops[i]` alternatives for row i."""
    out = []
    for row, token, k in zip(rows, tokens, tops, strict=True):
        logprobs = log_softmax(row)  # a row at a time: its float64 copy stays in the cache (a whole batch's does not)
        out.append(TokenLogprob(int(token), float(logprobs[int(token)]), most_likely(logprobs, k)))
    return out


def process_logits(
    rows: "np.ndarray", params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]], eos: Sequence[Iterable[int]], penalize: Callable[..., "np.ndarray"],
) -> "np.ndarray":
    """Rows of logits (float32 [n, V], one per sequence) after what each sequence's SamplingParams applies before the
    sample op, in its documented order: the penalties through `penalize` (the Backend's apply_penalties op, given and
    returning host arrays), then logit_bias, min_tokens and min_p here. Rows whose sequence applies nothing come back
    unchanged."""
    import numpy as np

    rows = np.array(rows, dtype=np.float32)
    count, vocab = rows.shape
    penalized = [n for n, p in enumerate(params) if p.penalized]
    if penalized:
        seen = np.zeros((len(penalized), vocab), dtype=bool)
        counts = np.zeros((len(penalized), vocab), dtype=np.int32)
        for i, n in enumerate(penalized):
            prompt = np.asarray(prompts[n], dtype=np.int64)
            seen[i, prompt[prompt < vocab]] = True
            out = np.asarray(outputs[n], dtype=np.int64)
            counts[i] = np.bincount(out[out < vocab], minlength=vocab)[:vocab]
        factors = {name: np.array([getattr(params[n], name) for n in penalized], dtype=np.float32)
                   for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")}
        rows[penalized] = penalize(rows[penalized], seen, counts, factors["presence_penalty"],
                                   factors["frequency_penalty"], factors["repetition_penalty"])
    for n, p in enumerate(params):
        row = rows[n]
        for token, bias in p.bias:
            if token < vocab:
                row[token] += np.float32(bias)
        if len(outputs[n]) < p.min_tokens:
            ends = [t for t in eos[n] if 0 <= t < vocab]
            row[ends] = -np.inf
        if p.min_p > 0 and not p.greedy:
            # p_i < min_p * p_max after temperature  <=>  l_i < l_max + T * ln(min_p); the likeliest always stays.
            threshold = float(row.max()) + p.temperature * math.log(p.min_p)
            row[row.astype(np.float64) < threshold] = -np.inf
    return rows
