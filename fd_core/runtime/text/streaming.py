"""Text as tokens arrive: incremental decoding that never emits half a character, and holds back a
possible start of a stop string until it is decided."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from fd_core.runtime.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence


@dataclass
class StreamDecoder:
    """Decodes a growing list of ids into text deltas.

    Each delta is the text of a window of recent ids minus the text of the window without the new
    ones: a byte-level piece that ends inside a multi-byte character decodes to U+FFFD, so nothing is
    emitted until the character is complete; SentencePiece's leading space is kept (the window starts
    at an earlier token, not at the new one).
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    _prefix: int = 0
    _read: int = 0

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ('' while a character is incomplete)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read], self.skip_special_tokens)
        after = self.tokenizer.decode(self.ids[self._prefix :], self.skip_special_tokens)
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD), at the end of a sequence."""
        before = self.tokenizer.decode(self.ids[self._prefix : self._read], self.skip_special_tokens)
        after = self.tokenizer.decode(self.ids[self._prefix :], self.skip_special_tokens)
        self._prefix = self._read = len(self.ids)
        return after[len(before) :] if after.startswith(before) else ""


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could begin a stop string (and must not be shown yet)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


@dataclass
class TextState:
    """One sequence's text: what is decided, what has been shown, and whether a stop string ended it."""

    decoder: StreamDecoder
    stops: tuple[str, ...] = ()
    text: str = ""
    shown: int = 0
    stopped: bool = False

    def push(self, token_id: int) -> str:
        """Add a token; return the newly shown text. Sets `stopped` when a stop string appears (cut before it)."""
        return self._add(self.decoder.push(token_id), final=False)

    def finish(self) -> str:
        """The sequence has ended: return the rest of its text."""
        return self._add(self.decoder.flush(), final=True)

    def _add(self, delta: str, final: bool) -> str:
        if self.stopped:
            return ""
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += delta
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped, final = self.text[:cut], True, True
        visible = len(self.text) if final else len(self.text) - held_back(self.text, self.stops)
        out = self.text[self.shown : visible]
        self.shown = max(self.shown, visible)
        return out
