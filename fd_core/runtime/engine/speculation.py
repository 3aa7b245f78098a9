"""Speculative decoding's settings and proposers: what guesses a sequence's next tokens cheaply, for the engine to check
all of them in one step of the target model (fd_core.runtime.engine.loop: the verify step and the accept_draft op)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from fd_core.errors import ConfigError, setting

METHODS = ("ngram", "draft")
DEFAULT_TOKENS = 4
MAX_TOKENS = 16
# Prompt lookup: the longest suffix of the sequence, from NGRAM_MAX tokens down to NGRAM_MIN, found earlier in its last
# NGRAM_WINDOW tokens (prompt and output) proposes the tokens that followed it there. One token is
# too short a key: it matches nearly everywhere and proposes what is rarely accepted.
NGRAM_MAX = 4
NGRAM_MIN = 2
NGRAM_WINDOW = 4096
# A sequence none of whose proposals was accepted stops proposing for 1, 3, 7, ... steps (at most BACKOFF_MAX), so
# speculation costs little where it cannot win; an accepted proposal resets it.
BACKOFF_MAX = 16


@dataclass(frozen=True)
class Speculation:
    """How a run speculates (plain data: it travels to the ranks): the proposer and the most tokens it proposes a
    step."""

    method: str = "ngram"
    tokens: int = DEFAULT_TOKENS
    # The draft model's checkpoint directory (method "draft").
    draft: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"{setting('speculative', self.method)} is not a proposer fd has; use one of "
                              f"{', '.join(METHODS)}")
        if (self.method == "draft") != (self.draft is not None):
            raise ConfigError(
                f"{setting('speculative', 'draft')} proposes with a draft model's checkpoint: give both it and "
                f"{setting('draft_checkpoint')}" if self.draft is None else
                f"{setting('draft_checkpoint')} is the draft model of {setting('speculative', 'draft')}: give that "
                f"too, or drop it")
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or not 1 <= self.tokens <= MAX_TOKENS:
            raise ConfigError(f"{setting('num_speculative_tokens')} must be an integer in 1..{MAX_TOKENS}, got "
                              f"{self.tokens!r:.40}")

    def describe(self) -> str:
        if self.method == "draft":
            return f"draft model {self.draft}, up to {self.tokens} tokens a step"
        return f"{self.method}, up to {self.tokens} tokens a step (n-grams of {NGRAM_MAX} down to {NGRAM_MIN} tokens)"


def speculation_of(method: str | None, tokens: int | None, draft: str | None = None) -> Speculation | None:
    """The run's Speculation from its options (None: it does not speculate; tokens None: DEFAULT_TOKENS)."""
    if method is None:
        for name, value in (("num_speculative_tokens", tokens), ("draft_checkpoint", draft)):
            if value is not None:
                raise ConfigError(f"{setting(name)} needs {setting('speculative')} (the proposer): add "
                                  f"{setting('speculative', 'ngram' if name != 'draft_checkpoint' else 'draft')}")
        return None
    return Speculation(method, DEFAULT_TOKENS if tokens is None else tokens, None if draft is None else str(draft))


def speculation_dict(speculation: Speculation | None) -> dict[str, object] | None:
    """What `fd explain --json` shows of it: the proposer, k and the draft's checkpoint (None: off)."""
    if speculation is None:
        return None
    return {"proposer": speculation.method, "k": speculation.tokens, "draft_checkpoint": speculation.draft}


class Proposer(Protocol):
    """Guesses a sequence's next tokens: at most `count` ids to follow `ids` (its prompt and output so far), or none.
    A proposer that guesses better for many sequences at once (a draft model's batch) also has
    `propose_many(asks: Sequence[tuple[ids, count]]) -> list[list[int]]`, which the engine then calls once a step."""

    def propose(self, ids: Sequence[int], count: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup decoding: the sequence's suffix of NGRAM_MAX down to NGRAM_MIN tokens found earlier in its last
    NGRAM_WINDOW tokens proposes what followed it there: at its latest occurrence with `count` tokens after it, else
    at its earliest."""

    def __init__(self, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN, window: int = NGRAM_WINDOW) -> None:
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def propose(self, ids: Sequence[int], count: int) -> list[int]:
        import numpy as np

        tail = np.asarray(ids[-self.window:], dtype=np.int32)
        # Searched as bytes (a C loop): a match must start on a token's boundary.
        data, size = tail.tobytes(), tail.itemsize
        for n in range(min(self.max_n, len(tail) - 1), self.min_n - 1, -1):
            pattern = tail[-n:].tobytes()
            # The latest occurrence with `count` tokens after it; else the earliest (a run repeating itself: the
            # latest occurrence is the suffix shifted by one, followed by one token only).
            found = _find(data, pattern, size, len(data) - count * size, latest=True)
            if found < 0:
                found = _find(data, pattern, size, len(data) - size, latest=False)
            if found >= 0:
                start = found // size + n
                return [int(t) for t in tail[start:start + count]]
        return []


def _find(data: bytes, pattern: bytes, size: int, end: int, latest: bool) -> int:
    """The latest (or earliest) occurrence of `pattern` in data[:end] starting on a multiple of `size`, else -1."""
    start = 0
    while True:
        found = data.rfind(pattern, 0, end) if latest else data.find(pattern, start, end)
        if found < 0 or found % size == 0:
            return found
        if latest:
            end = found + len(pattern) - 1
        else:
            start = found + 1


class ReplayProposer:
    """Proposes each prompt's known continuation (for checks and benchmarks: the tokens a perfect draft would guess),
    spoiling on its successive calls the proposal at the next index of `wrong` (cycled; an index past the proposals
    spoils none), so that rows accept chosen counts."""

    def __init__(self, continuations: Mapping[tuple[int, ...], Sequence[int]], wrong: Sequence[int] = ()) -> None:
        self.continuations, self.wrong, self.calls = dict(continuations), tuple(wrong), 0

    def propose(self, ids: Sequence[int], count: int) -> list[int]:
        for prompt, tokens in self.continuations.items():
            if tuple(ids[: len(prompt)]) == prompt:
                guess = [int(t) for t in tokens[len(ids) - len(prompt):][:count]]
                if self.wrong:
                    spot = self.wrong[self.calls % len(self.wrong)]
                    self.calls += 1
                    if spot < len(guess):
                        guess[spot] = guess[spot] + 1 if guess[spot] > 0 else 1
                return guess
        return []
