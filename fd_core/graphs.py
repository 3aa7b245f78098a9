"""Graph capture: the backend protocol, one plugin's vote, and the decision that keeps every vote."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Protocol, Sequence

from fd_core.errors import setting

_state = threading.local()


def capturing() -> bool:
    """Whether the calling thread is inside a model's graph capture (a hook or kernel may ask, to take its capturable
    path)."""
    return bool(getattr(_state, "depth", 0))


@contextlib.contextmanager
def capture_scope() -> Iterator[None]:
    """Mark the calling thread as capturing for the duration (the runtime wraps every model capture in it)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


class GraphBackend(Protocol):
    """Captures a function once per key (a batch size) and replays it; `clear` drops every capture."""

    mode: str

    def capture(self, key: Hashable, fn: Callable[..., Any], inputs: Sequence[Any]) -> None: ...

    def replay(self, key: Hashable, inputs: Sequence[Any]) -> Any: ...

    def has(self, key: Hashable) -> bool: ...

    def clear(self) -> None: ...


@dataclass(frozen=True)
class GraphVote:
    """One plugin's answer to `fd_graph_eligibility`: allow, veto, or skip for no gain (advisory), and why.

    A veto means graphs would be wrong or impossible; an advisory vote means they would work but
    not pay, so `--graph auto` skips capture and `--graph on` captures anyway.
    """

    allow: bool
    reason: str = ""
    advisory: bool = False

    @classmethod
    def veto(cls, reason: str) -> "GraphVote":
        return cls(False, reason)

    @classmethod
    def ok(cls, reason: str = "") -> "GraphVote":
        return cls(True, reason)

    @classmethod
    def no_gain(cls, reason: str) -> "GraphVote":
        """Capture would work but not pay here: skipped under --graph auto, captured under --graph on."""
        return cls(False, reason, advisory=True)


@dataclass(frozen=True)
class CastVote:
    """A vote with the plugin that cast it."""

    plugin: str
    allow: bool
    reason: str
    advisory: bool = False

    def line(self) -> str:
        verdict = "allows" if self.allow else ("skips (no gain)" if self.advisory else "vetoes")
        return f"{self.plugin} {verdict}" + (f": {self.reason}" if self.reason else "")


@dataclass(frozen=True)
class GraphDecision:
    """Whether graphs are captured, in which mode, and every voter's answer (any veto wins)."""

    allowed: bool
    mode: str | None
    votes: tuple[CastVote, ...] = field(default_factory=tuple)
    requested: str = "auto"

    @property
    def vetoes(self) -> tuple[CastVote, ...]:
        """The votes against capture that count under the request (an advisory one only under auto)."""
        return tuple(v for v in self.votes if not v.allow and not (v.advisory and self.requested == "on"))

    def summary(self) -> str:
        mode = self.mode or "graph capture"
        if self.allowed:
            overridden = [v.plugin for v in self.votes if v.advisory]
            if overridden:
                return f"{mode} on: requested ({setting('graph', 'on')}) over {', '.join(overridden)}'s no-gain vote"
            return f"{mode} on: no plugin vetoed ({len(self.votes)} vote{'s' if len(self.votes) != 1 else ''})"
        if self.requested == "off":
            return f"{mode} off: disabled by request ({setting('graph', 'off')})"
        if not self.mode:
            return "graph capture off: the platform has no graph backend"
        on = setting("graph", "on")
        return f"{mode} off: " + "; ".join(
            f"{v.plugin} {f'skipped (no gain; {on} captures anyway)' if v.advisory else 'vetoed'}: {v.reason}"
            for v in self.vetoes
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "allowed": self.allowed,
            "mode": self.mode,
            "requested": self.requested,
            "summary": self.summary(),
            "votes": [
                {"plugin": v.plugin, "allow": v.allow, "reason": v.reason, "advisory": v.advisory} for v in self.votes
            ],
        }
