"""What the server needs of an LLM (Submitter, and the Submission each choice of a prompt becomes), the stand-in that
refuses the API while the model loads (Loading), and a submission as the HTTP side follows it (Generation)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol, Sequence

from fd_core.serve.protocol import ApiError

if TYPE_CHECKING:
    from fd_core.runtime.engine.loop import Completion
    from fd_core.runtime.engine.sampling import SamplingParams, TokenLogprob
    from fd_core.runtime.engine.scheduler import Piece
    from fd_core.runtime.text.tokenizer import Tokenizer

RETRY_AFTER_LOADING_S = 5  # what a client told "the model is loading" waits: loading takes seconds to minutes


class Submission(Protocol):
    """One request in the engine (fd_core.runtime.session's Submission)."""

    prompt_tokens: int
    first_token_at: float | None

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def prompt_logprobs(self) -> "Sequence[TokenLogprob | None] | None":
        """Its prompt's logprobs when its sampling asked (SamplingParams.prompt_logprobs), set before its first
        piece."""

    def __iter__(self) -> Iterator[str]: ...

    def pieces(self, every_token: bool = False) -> Iterator["Piece"]: ...

    def result(self, timeout: float | None = None) -> "Completion": ...

    def cancel(self) -> None: ...


class Submitter(Protocol):
    """What the server needs of an LLM: thread-safe submit() that checks a request at once, the queue's length, the
    checkpoint's tokenizer (which shows logprobs' tokens), and whether the model takes pictures."""

    tokenizer: "Tokenizer | None"

    @property
    def multimodal(self) -> bool: ...

    @property
    def chat_template(self) -> str | None: ...

    def submit_choices(
        self, prompt: Any, sampling: "SamplingParams | None" = None, *, chat: bool = False, images: Sequence[Any] = (),
        tools: Sequence[Mapping[str, Any]] | None = None, share: int | None = None, handoff: Any = None,
    ) -> Sequence[Submission]: ...

    def new_share(self) -> int: ...

    def queued(self) -> int: ...

    @property
    def error(self) -> BaseException | None: ...

    @property
    def kv_cache(self) -> Mapping[str, int]: ...

    @property
    def kv_address(self) -> str | None:
        """Where prefill instances send this one's handed-over requests (None: it has no KV transport)."""


def still_loading() -> ApiError:
    """The answer to an API request while the model loads."""
    return ApiError(503, "the model is still loading; retry once GET /health answers 200", kind="server_error",
                    code="loading", headers={"Retry-After": str(RETRY_AFTER_LOADING_S)})


class Loading:
    """The engine's stand-in while the model loads: nothing queued, no tokenizer; ApiGate refuses the API before a
    route could submit to it."""

    tokenizer: "Tokenizer | None" = None
    error: BaseException | None = None
    kv_cache: Mapping[str, int] = {}
    multimodal = False
    chat_template: str | None = None
    kv_address: str | None = None

    def submit_choices(
        self, prompt: Any, sampling: "SamplingParams | None" = None, *, chat: bool = False, images: Sequence[Any] = (),
        tools: Sequence[Mapping[str, Any]] | None = None, share: int | None = None, handoff: Any = None,
    ) -> Sequence[Submission]:
        raise still_loading()

    def new_share(self) -> int:
        raise still_loading()

    def queued(self) -> int:
        return 0


@dataclass(eq=False)  # one per submission: hashed by identity
class Generation:
    """A submission as the HTTP side follows it: its choice index, its completion once done."""

    index: int
    submission: Submission
    prompt: int = 0  # the index of its prompt in the request (a prompt's n choices share it)
    submitted: float = field(default_factory=time.time)
    completion: "Completion | None" = None
    cancelled: str | None = None  # why the server cancelled it (shutting down, a rank failed), if it did
