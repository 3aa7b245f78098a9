"""A stand-in for the LLM behind `fd serve`, for the tests of its HTTP side in this process: every prompt answered at
once, what each submit brought kept; and the check of an OpenAI error response."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator, Sequence


class Answered:
    """A submission already done: no text, one generated id."""

    prompt_tokens = 2
    first_token_at = None
    prompt_ids = (1, 2)
    prompt_logprobs = None

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def pieces(self, every_token: bool = False) -> Iterator[Any]:
        return iter(())

    def result(self, timeout: float | None = None) -> Any:
        return SimpleNamespace(prompt_ids=[1, 2], token_ids=[5], text="", finish_reason="length", logprobs=None)

    def cancel(self) -> None:
        pass


class Engine:
    """What the server needs of an LLM, answering every prompt at once; each submit's sampling, prompt and pictures
    kept."""

    tokenizer = None
    error = None
    kv_cache: dict[str, int] = {}
    chat_template = None
    kv_address = None

    def __init__(self, multimodal: bool = True) -> None:
        self.multimodal = multimodal
        self.submitted: list[Any] = []
        self.prompts: list[Any] = []
        self.images: list[Sequence[Any]] = []

    def submit_choices(self, prompt: Any, sampling: Any = None, *, chat: bool = False,
                       images: Sequence[Any] = (), tools: Any = None, share: int | None = None) -> Any:
        self.submitted.append(sampling)
        self.prompts.append(prompt)
        self.images.append(images)
        return [Answered() for _ in range(sampling.n)]

    def new_share(self) -> int:
        return 0

    def queued(self) -> int:
        return 0


def error_of(response: Any, status: int) -> dict[str, Any]:
    """The response is `status` with an OpenAI error body."""
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"}, response.text
    return dict(response.json()["error"])
