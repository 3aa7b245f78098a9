"""Graph capture: the backend protocol, one plugin's vote, and the decision that keeps every vote."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol, Sequence


class GraphBackend(Protocol):
    """Captures a function once per key (a batch size) and replays it; `clear` drops every capture."""

    mode: str

    def capture(self, key: Hashable, fn: Callable[..., Any], inputs: Sequence[Any]) -> None: ...

    def replay(self, key: Hashable, inputs: Sequence[Any]) -> Any: ...

    def has(self, key: Hashable) -> bool: ...

    def clear(self) -> None: ...


@dataclass(frozen=True)
class GraphVote:
    """One plugin's answer to `fd_graph_eligibility`: allow or veto, and why."""

    allow: bool
    reason: str = ""

    @classmethod
    def veto(cls, reason: str) -> "GraphVote":
        return cls(False, reason)

    @classmethod
    def ok(cls, reason: str = "") -> "GraphVote":
        return cls(True, reason)


@dataclass(frozen=True)
class CastVote:
    """A vote with the plugin that cast it."""

    plugin: str
    allow: bool
    reason: str

    def line(self) -> str:
        verdict = "allows" if self.allow else "vetoes"
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
        return tuple(v for v in self.votes if not v.allow)

    def summary(self) -> str:
        mode = self.mode or "graph capture"
        if self.allowed:
            return f"{mode} on: no plugin vetoed ({len(self.votes)} vote{'s' if len(self.votes) != 1 else ''})"
        if self.requested == "off":
            return f"{mode} off: disabled by request (--graph off)"
        if not self.mode:
            return "graph capture off: the platform has no graph backend"
        return f"{mode} off: " + "; ".join(f"{v.plugin} vetoed: {v.reason}" for v in self.vetoes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "allowed": self.allowed,
            "mode": self.mode,
            "requested": self.requested,
            "summary": self.summary(),
            "votes": [{"plugin": v.plugin, "allow": v.allow, "reason": v.reason} for v in self.votes],
        }
