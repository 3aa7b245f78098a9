"""A request handed from a prefill instance to a decode instance (disaggregation), as the Python API passes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fd_core.runtime.engine.loop import Completion
from fd_core.runtime.engine.sampling import TokenLogprob


@dataclass(frozen=True)
class Handoff:
    """What `LLM.prefill` returns and `LLM.resume` takes: the transfer's key, the prompt's ids, the token(s) the prefill
    instance chose (and their logprobs, when the sampling asks), and its completion. `finished` is True when the
    request ended there (an end-of-sequence id, a stop string, max_new_tokens 1): nothing was sent and the completion
    is the request's whole answer."""

    key: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    completion: Completion

    @property
    def finished(self) -> bool:
        return self.completion.finish_reason != "handoff"

    def to_dict(self) -> dict[str, Any]:
        """The hand-over as JSON-ready data (what a router passes between instances)."""
        return {"key": self.key, "prompt_ids": list(self.prompt_ids), "token_ids": list(self.token_ids),
                "completion": self.completion.to_dict()}
