"""The OpenAI API's request and response shapes that `fd serve` speaks, and their translation to fd's
SamplingParams, prompts and finish reasons; errors in the OpenAI error format."""

from __future__ import annotations

import base64
import binascii
import io
import secrets
import time
import uuid
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from fd_core.errors import ConfigError
from fd_core.runtime.engine.sampling import SamplingParams

# fd's Completion.finish_reason -> the OpenAI API's.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default


class ApiError(Exception):
    """A request the server answers with an OpenAI error body: status, message, type, param and code."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """{"error": {"message", "type", "param", "code"}}, as the OpenAI API returns errors."""
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Sampling(BaseModel):
    """The sampling fields both endpoints take; unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # not in OpenAI's API; vLLM and others take it
    ignore_eos: bool = False  # nor this (vLLM's): generate max_tokens whatever the model says, for benchmarks and tests
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Fields of OpenAI's APIs fd does not serve: refused by refuse_unsupported when they ask for something, never
    # silently ignored (docs/serving.md has the table of every field).
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def refuse_unsupported(self) -> None:
        """What fd does not do is refused, never silently ignored."""
        if self.n != 1:
            raise ApiError(
                400, f"n={self.n}: fd serve returns one choice per prompt; send n=1 (or several requests)", param="n"
            )
        if self.logprobs not in (None, False):
            raise ApiError(400, "logprobs are not supported by fd serve; drop the field", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported by fd serve; drop it or send 0", param=name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported by fd serve; drop the field", param="logit_bias")
        if self.top_logprobs is not None:
            raise ApiError(400, "top_logprobs is not supported by fd serve (nor logprobs); drop the field",
                           param="top_logprobs")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ApiError(400, f"response_format {kind!r} is not supported by fd serve (no structured output): the "
                                f"text would not be checked against it; drop the field or send {{\"type\": \"text\"}}",
                           param="response_format")
        tools = "fd serve does not call tools; drop the tool fields"
        text = "fd serve answers in text only; drop the field"
        for name, asked, why in (
            ("tools", bool(self.tools), tools),
            ("functions", bool(self.functions), tools),
            ("tool_choice", self.tool_choice not in (None, "none"), tools),
            ("function_call", self.function_call not in (None, "none"), tools),
            ("audio", self.audio is not None, text),
            ("modalities", self.modalities not in (None, ["text"]), text),
        ):
            if asked:
                raise ApiError(400, f"{name}: {why}", param=name)
        if self.prediction is not None:
            raise ApiError(400, "prediction (predicted outputs) is not supported by fd serve; drop the field",
                           param="prediction")

    def limit(self) -> int | None:
        """The most tokens to generate: max_completion_tokens (the chat API's newer name) or max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """fd's SamplingParams; unset fields take fd's defaults (greedy unless a temperature is given)."""
        try:
            return SamplingParams(
                max_new_tokens=max_tokens or DEFAULT_MAX_TOKENS, temperature=self.temperature or 0.0,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, stop=self.stops(),
                # As OpenAI's API: without a seed, a sampled request draws a different sample each time.
                seed=secrets.randbelow(2**31) if self.seed is None else self.seed,
                ignore_eos=self.ignore_eos,
            )
        except ConfigError as exc:
            raise ApiError(400, str(exc)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(Sampling):
    """POST /v1/completions: a prompt (text, token ids, or a list of either) and how to continue it."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, one choice each."""
        if self.echo:
            raise ApiError(400, "echo is not supported by fd serve; drop the field", param="echo")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported by fd serve; drop the field", param="best_of")
        if self.suffix:
            raise ApiError(400, "suffix is not supported by fd serve; drop the field", param="suffix")
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ApiError(
                400, "prompt is empty; send a string, a list of token ids, or a list of either", param="prompt"
            )
        items: list[Any] = list(prompt)
        if all(isinstance(p, int) for p in items):
            return [[int(t) for t in items]]
        return [p if isinstance(p, str) else [int(t) for t in p] for p in items]


class ContentPart(BaseModel):
    """One part of a message's content: {"type": "text", "text"} or {"type": "image_url", "image_url": {"url"}}."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: dict[str, Any] | None = None


class Message(BaseModel):
    """One turn of a conversation."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None


class ChatRequest(Sampling):
    """POST /v1/chat/completions: a conversation, answered through the checkpoint's chat template."""

    messages: list[Message] = Field(min_length=1)


def message_parts(message: Message, index: int) -> tuple[str, list[str]]:
    """A message's text (its text parts joined) and its pictures' URLs, in order."""
    content = message.content
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    texts, images = [], []
    for part in content:
        if part.type == "text":
            texts.append(part.text or "")
        else:
            url = (part.image_url or {}).get("url")
            if not isinstance(url, str) or not url:
                raise ApiError(
                    400, f"messages[{index}]: an image_url part needs {{\"image_url\": {{\"url\": ...}}}}",
                    param=f"messages[{index}]",
                )
            images.append(url)
    return "".join(texts), images


def read_image(url: str, roots: Sequence[Path]) -> Any:
    """A picture from a data URL (base64 PNG or JPEG) or a file path under one of `roots`, as an array [C, H, W] in
    [0, 1]."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    if url.startswith("data:"):
        header, _, data = url.partition(",")
        if ";base64" not in header:
            raise ApiError(400, "an image data URL must be base64 (data:image/png;base64,...)", param="messages")
        from fd_core.runtime.images import MAX_IMAGE_PIXELS

        Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS  # a decompression bomb is refused before it is decoded
        try:
            raw = base64.b64decode(data, validate=True)
            picture = Image.open(io.BytesIO(raw)).convert("RGB")
        except (binascii.Error, UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise ApiError(
                400, f"the image data URL is not a PNG or JPEG picture ({exc.__class__.__name__})", param="messages"
            ) from None
        return np.asarray(picture, dtype="float32").transpose(2, 0, 1) / 255.0
    path = Path(url.removeprefix("file://")).resolve()
    if not any(path.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots) or "none (start fd serve with --image-root DIR)"
        raise ApiError(
            400, f"image path {url!r} is outside the directories the server may read: {allowed}", param="messages"
        )
    if not path.is_file():
        raise ApiError(400, f"image path {url!r} is not a file the server can read", param="messages")
    from fd_core.runtime.images import load_image

    try:
        return load_image(str(path))
    except (ConfigError, OSError) as exc:
        raise ApiError(400, f"image {url!r}: {exc}", param="messages") from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
