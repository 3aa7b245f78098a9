"""The OpenAI API's request and response shapes that `fd serve` speaks, and their translation to fd's
SamplingParams, prompts, finish reasons and logprobs; errors in the OpenAI error format."""

from __future__ import annotations

import base64
import binascii
import codecs
import io
import json
import secrets
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fd_core.errors import ConfigError
from fd_core.runtime.engine.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from fd_core.runtime.text.tokenizer import Tokenizer
    from fd_core.runtime.text.tools import Tools

# fd's Completion.finish_reason -> the OpenAI API's.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on /v1/completions' logprobs
MAX_STOPS = 4  # OpenAI's limit on a request's stop strings
# The longest stop string a request may send. Each generated token's text is checked for the start of every stop string
# at its end, which costs the square of the string's length (a 100,000-character one took 0.1 s a token), and streamed
# text is held back by up to its length; 256 characters is far longer than any delimiter.
MAX_STOP_CHARS = 256
# The most digits a logit_bias key may have: ids below 10^10 are far beyond any vocabulary, and a longer key is no id
# (int() of 10,000 digits raises, and of fewer costs time for nothing).
MAX_TOKEN_ID_DIGITS = 10
# The content parts a chat message may hold: its text and its pictures.
CONTENT_PARTS = ("text", "image_url")


# The request fields whose range SamplingParams checks: its message starts with the field's name.
CHECKED = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens", "n",
           "temperature", "top_p", "top_k", "seed")


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


# The request models are strict: a value of the wrong JSON type is refused naming its field, never converted
# ("10" for 10, true for 1, "yes" for true); an integer is still taken where a number is.
STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    """stream_options: whether a streamed answer ends with a usage chunk."""

    model_config = STRICT

    include_usage: bool = False


class Sampling(BaseModel):
    """The sampling fields both endpoints take; unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only with completions' echo (the prompt scored)
    temperature: float | None = Field(default=None, ge=0, le=2)  # OpenAI's range
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # not in OpenAI's API; vLLM and others take it
    ignore_eos: bool = False  # nor this (vLLM's): generate max_tokens whatever the model says, for benchmarks and tests
    # vLLM's: each choice, and each streamed chunk, carries its tokens' ids (`token_ids`); a chunk comes per token.
    return_token_ids: bool = False
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = Field(default=None, strict=True)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Not in OpenAI's API; vLLM takes them: the repetition penalty, min_p, min_tokens and a regex the output follows.
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    guided_regex: str | None = None
    response_format: dict[str, Any] | None = None
    # Tool calling: served on chat completions (ChatRequest.tool_set), refused on completions.
    tools: list[Any] | None = None
    tool_choice: Any = None
    # Fields of OpenAI's APIs fd does not serve: refused by refuse_unsupported when they ask for something, never
    # silently ignored (docs/serving.md has the table of every field).
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    # Accepted and ignored, as `user`: fd's prefix cache finds shared prefixes by their content (no key needed), and
    # fd keeps no record of who asked.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)

    TAKES_TOOLS: ClassVar[bool] = False

    def refuse_unsupported(self) -> None:
        """What fd does not do is refused, never silently ignored."""
        legacy = "the legacy function-calling fields are not served; send tools and tool_choice to chat completions"
        tools = "tools are served on /v1/chat/completions only (a completion has no chat template to offer them)"
        text = "fd serve answers in text only; drop the field"
        for name, asked, why in (
            ("tools", bool(self.tools) and not self.TAKES_TOOLS, tools),
            ("tool_choice", self.tool_choice not in (None, "none") and not self.TAKES_TOOLS, tools),
            ("functions", bool(self.functions), legacy),
            ("function_call", self.function_call not in (None, "none"), legacy),
            ("audio", self.audio is not None, text),
            ("modalities", self.modalities not in (None, ["text"]), text),
        ):
            if asked:
                raise ApiError(400, f"{name}: {why}", param=name)
        if self.prediction is not None:
            raise ApiError(400, "prediction (predicted outputs) is not supported by fd serve; drop the field",
                           param="prediction")
        if self.web_search_options is not None:
            raise ApiError(400, "web_search_options: fd serve does not search the web; drop the field",
                           param="web_search_options")
        if self.verbosity is not None:
            raise ApiError(400, "verbosity: fd serve has no verbosity control (the answer's length is max_tokens' "
                                "and the model's); drop the field", param="verbosity")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true (as OpenAI's API answers); drop it "
                                "or stream", param="stream_options")

    @property
    def scoring_only(self) -> bool:
        """Whether the request asks for its prompt's logprobs alone (completions' echo with max_tokens 0)."""
        return False

    def limit(self) -> int | None:
        """The most tokens to generate: max_completion_tokens (the chat API's newer name) or max_tokens; max_tokens 0
        (scoring only) generates one token, which the answer does not show."""
        if self.max_completion_tokens is None and self.max_tokens == 0:
            if not self.scoring_only:
                raise ApiError(400, "max_tokens must be at least 1 (0 is taken only with echo on /v1/completions: the "
                                    "prompt scored, nothing generated)", param="max_tokens")
            return 1
        return self.max_completion_tokens or self.max_tokens

    def stops(self) -> tuple[str, ...]:
        """The stop strings: at most MAX_STOPS (OpenAI's limit), each 1 to MAX_STOP_CHARS characters."""
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop holds {len(stops)} strings, more than the {MAX_STOPS} a request may send "
                                f"(OpenAI's limit); send at most {MAX_STOPS}", param="stop")
        for index, stop in enumerate(stops):
            which = "stop" if isinstance(self.stop, str) else f"stop[{index}]"
            if not stop:
                raise ApiError(400, f"{which} is empty; a stop string needs at least one character", param="stop")
            if len(stop) > MAX_STOP_CHARS:
                raise ApiError(400, f"{which} is {len(stop)} characters long, more than the {MAX_STOP_CHARS} a stop "
                                    f"string may have; send a shorter one", param="stop")
        return stops

    def logprob_count(self) -> int | None:
        """How many alternatives each generated token's logprobs list (None: no logprobs asked)."""
        raise NotImplementedError

    def prompt_logprob_count(self) -> int | None:
        """How many alternatives each prompt token's logprobs list (None: the prompt is not scored)."""
        return None

    def sampling(self, max_tokens: int | None, tools: "Tools | None" = None) -> SamplingParams:
        """fd's SamplingParams; unset fields take fd's defaults (greedy unless a temperature is given). `tools`: the
        request's checked tools, whose tool choice may constrain the output."""
        logprobs = self.logprob_count()
        try:
            return SamplingParams(
                max_new_tokens=max_tokens or DEFAULT_MAX_TOKENS, temperature=self.temperature or 0.0,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, stop=self.stops(),
                # As OpenAI's API: without a seed, a sampled request draws a different sample each time.
                seed=secrets.randbelow(2**31) if self.seed is None else self.seed,
                ignore_eos=self.ignore_eos, logprobs=logprobs, n=self.n or 1,
                prompt_logprobs=self.prompt_logprob_count(),
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self.bias(), min_p=self.min_p or 0.0, min_tokens=self.min_tokens or 0,
                grammar=self.grammar(tools),
            )
        except ConfigError as exc:
            # SamplingParams names its own field; the client sent max_tokens.
            message = str(exc).replace("max_new_tokens", "max_tokens")
            raise ApiError(400, message, param=next((f for f in CHECKED if message.startswith(f)), None)) from None

    def bias(self) -> dict[int, float]:
        """logit_bias with its keys as token ids (OpenAI's JSON keys are strings)."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            # ASCII only: str.isdigit() and int() also take other scripts' digits ("١٢" is 12) and superscripts
            # (which int() then refuses), none of which a client means as a token id.
            if not (key.isascii() and key.isdigit()):
                raise ApiError(400, f"logit_bias keys must be token ids in ASCII digits (as \"42\"), got "
                                    f"{shown_text(key)}", param="logit_bias")
            if len(key) > MAX_TOKEN_ID_DIGITS:
                raise ApiError(400, f"logit_bias key {shown_text(key)} ({len(key)} digits) is no token id: ids have at "
                                    f"most {MAX_TOKEN_ID_DIGITS} digits; send ids of the model's vocabulary",
                               param="logit_bias")
            out[int(key)] = value
        return out

    def grammar(self, tools: "Tools | None" = None) -> str | None:
        """The grammar response_format, guided_regex or a required or named tool choice asks for (None: free text)."""
        forced = None
        if tools is not None:
            from fd_core.runtime.text.grammar import GrammarError

            try:
                forced = tools.grammar()
            except GrammarError as exc:
                raise ApiError(400, str(exc), param="tools") from None
        free = self.guided_regex is None and (self.response_format or {}).get("type", "text") == "text"
        if forced is not None:
            if not free:
                raise ApiError(400, "tool_choice \"required\" or a named function constrains the output to tool calls, "
                                    "which response_format or guided_regex would constrain again; send one of them",
                               param="tool_choice")
            return forced
        if free:
            return None
        from fd_core.runtime.text.grammar import REGEX_FIELD, GrammarError, constraint_spec

        try:
            return constraint_spec(self.response_format, self.guided_regex)
        except GrammarError as exc:
            message = str(exc)
            raise ApiError(400, message,
                           param=REGEX_FIELD if message.startswith(REGEX_FIELD) else "response_format") from None

    def grammar_field(self, tools: "Tools | None" = None) -> str:
        """The field whose grammar constrains the output (named when the model's tokens cannot follow it)."""
        if tools is not None and tools.choice not in ("auto", "none"):
            return "tool_choice"
        return "guided_regex" if self.guided_regex is not None else "response_format"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    """POST /v1/completions: a prompt (text, token ids, or a list of either) and how to continue it."""

    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind_of_prompt(cls, value: Any) -> Any:
        """A list mixing text and token ids is named as such (pydantic would say only "a valid string")."""
        if isinstance(value, list) and value:
            kinds = ["text" if isinstance(v, str) else "ids" if isinstance(v, (list, int)) else "other" for v in value]
            if "text" in kinds and "ids" in kinds:
                raise ValueError(
                    f"a list of prompts holds all strings or all token-id lists, not both (item "
                    f"{kinds.index('text')} is text, item {kinds.index('ids')} token ids); send one kind per request"
                )
        return value
    # How many alternatives each generated token's logprobs list, 0..5 (None: no logprobs).
    logprobs: int | None = Field(default=None, strict=True)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None:
            raise ApiError(400, "top_logprobs is a chat completions field; /v1/completions takes logprobs: k (0..5)",
                           param="top_logprobs")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs must be in 0..{MAX_COMPLETION_LOGPROBS} on /v1/completions (OpenAI's "
                                f"limit), got {self.logprobs}", param="logprobs")
        return self.logprobs

    @property
    def scoring_only(self) -> bool:
        return self.echo and self.max_tokens == 0 and self.max_completion_tokens is None

    def prompt_logprob_count(self) -> int | None:
        # Echoed with logprobs, the prompt's tokens are listed with theirs (what loglikelihood evaluation reads).
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, one choice each."""
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

    model_config = STRICT

    # Any string: a type fd does not read ("input_audio", "file") is refused naming it (message_parts), where a
    # Literal made pydantic's union report the content as "not a valid string".
    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None


class ToolCallFunction(BaseModel):
    """The function of an assistant's earlier tool call: its name and its arguments as a JSON string."""

    model_config = STRICT

    name: str
    arguments: str


class ToolCall(BaseModel):
    """An assistant turn's earlier tool call, sent back as OpenAI returned it."""

    model_config = STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(BaseModel):
    """One turn of a conversation: an assistant turn may carry the tool calls it made, a tool turn the id of the
    call it answers."""

    model_config = STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def template_calls(self) -> list[dict[str, Any]] | None:
        """The turn's tool calls as chat templates read them: arguments as a mapping where they are a JSON object
        (templates write them with `tojson`), else the string as sent."""
        if not self.tool_calls:
            return None
        calls = []
        for call in self.tool_calls:
            try:
                arguments: Any = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments
            if not isinstance(arguments, Mapping):
                arguments = call.function.arguments
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        return calls


class ChatRequest(Sampling):
    """POST /v1/chat/completions: a conversation, answered through the checkpoint's chat template."""

    messages: list[Message] = Field(min_length=1)
    # Whether each generated token's logprob comes back; top_logprobs (0..20) how many alternatives with it.
    logprobs: bool | None = Field(default=None, strict=True)
    # False: at most one tool call in the answer.
    parallel_tool_calls: bool | None = None

    TAKES_TOOLS: ClassVar[bool] = True

    def tool_set(self, template: str | None) -> "Tools | None":
        """The request's tools and tool choice, checked against the checkpoint's chat template (None: no tools in
        play, as with none sent or tool_choice "none")."""
        from fd_core.runtime.text.tools import ToolError, check_tools

        if not self.tools and self.tool_choice in (None, "none"):
            return None
        try:
            tools = check_tools(self.tools, self.tool_choice, template, parallel=self.parallel_tool_calls is not False)
        except ToolError as exc:
            message = str(exc)
            param = "tool_choice" if message.startswith("tool_choice") else "tools"
            raise ApiError(400, message, param=param) from None
        return None if tools.choice == "none" else tools

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true; send both, or neither", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ApiError(400, f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {self.top_logprobs}",
                               param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def message_parts(message: Message, index: int) -> tuple[str, list[str]]:
    """A message's text (its text parts joined) and its pictures' URLs, in order."""
    content = message.content
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    texts, images = [], []
    for number, part in enumerate(content):
        if part.type not in CONTENT_PARTS:
            field = f"messages[{index}].content[{number}].type"
            raise ApiError(400, f"{field} {shown_text(part.type)} is not supported; send \"text\" or \"image_url\" "
                                f"parts (fd serve reads text and pictures)", param=field)
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


# Longer paths no file system takes (Linux's PATH_MAX); refused before the file system is asked.
MAX_IMAGE_PATH = 4096
# How much of a client's path or URL an error message repeats.
SHOWN_URL = 120


def picture_format(head: bytes) -> str | None:
    """The format a file's first 12 bytes announce: PNG or JPEG (the ones read), another picture format named so
    that the client is told what it sent, None when they announce no picture."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return "TIFF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    if head.startswith(b"BM"):
        return "BMP"
    return None


def described(kind: str | None) -> str:
    """A refused picture as an error message names it: "a GIF picture", or "not a PNG or JPEG picture"."""
    return f"a {kind} picture" if kind else "not a PNG or JPEG picture"


def shown_text(text: str, limit: int = 40) -> str:
    """A client's string as an error message repeats it: quoted, cut to `limit` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def shown_url(url: str) -> str:
    """A client's path or URL as an error message repeats it: quoted, cut to SHOWN_URL characters."""
    return repr(url if len(url) <= SHOWN_URL else url[:SHOWN_URL] + "...")


def read_image(url: str, roots: Sequence[Path], charge: "Callable[[int], None] | None" = None,
               decode: bool = True) -> Any:
    """A picture from a data URL (base64 PNG or JPEG) or a file path under one of `roots`, as an array [C, H, W] in
    [0, 1]. Only PNG and JPEG are decoded: the format is decided from the first bytes, before any decoder sees them.
    `charge(pixels)` is told its size from its header before it is decoded (and may refuse it); `decode` False: None
    once it is checked and charged, nothing decoded."""
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
        except (binascii.Error, ValueError) as exc:
            raise ApiError(
                400, f"the image data URL is not a PNG or JPEG picture ({exc.__class__.__name__})", param="messages"
            ) from None
        kind = picture_format(raw[:12])
        if kind not in ("PNG", "JPEG"):
            raise ApiError(400, f"the image data URL is {described(kind)}; only PNG or JPEG are accepted: convert it "
                                f"to PNG", param="messages")

        def too_large(size: str) -> ApiError:
            return ApiError(400, f"the image data URL is {size}above the {MAX_IMAGE_PIXELS} pixels fd reads; "
                                 f"downscale it", param="messages")

        try:
            with warnings.catch_warnings():
                # Between the bound and twice it PIL only warns; the size is checked just below.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                # Only the PNG and JPEG decoders, whatever the bytes claim. open() reads the header alone.
                image = Image.open(io.BytesIO(raw), formats=["PNG", "JPEG"])
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:  # refused from its header, before a pixel is decoded
                raise too_large(f"{height}x{width}, ")
            if charge is not None:
                charge(width * height)
            if not decode:
                return None
            picture = image.convert("RGB")
        except Image.DecompressionBombError:  # more than twice the bound: PIL refuses it from the header itself
            raise too_large("") from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise ApiError(
                400, f"the image data URL is not a PNG or JPEG picture ({exc.__class__.__name__})", param="messages"
            ) from None
        return np.asarray(picture, dtype="float32").transpose(2, 0, 1) / 255.0
    shown = shown_url(url)
    # Checked before the file system is asked: it would raise (ValueError, ENAMETOOLONG) rather than say no.
    if "\x00" in url:
        raise ApiError(400, f"image path {shown} contains a NUL byte, which no file name can; send a path under "
                            f"--image-root or a data URL", param="messages")
    if len(url) > MAX_IMAGE_PATH:
        raise ApiError(400, f"image path {shown} is {len(url)} characters long, more than the {MAX_IMAGE_PATH} a path "
                            f"may have; send a shorter path under --image-root or a data URL", param="messages")
    try:
        path = Path(url.removeprefix("file://")).resolve()
        if not any(path.is_relative_to(root) for root in roots):
            allowed = ", ".join(str(r) for r in roots) or "none (start fd serve with --image-root DIR)"
            raise ApiError(
                400, f"image path {shown} is outside the directories the server may read: {allowed}", param="messages"
            )
        if not path.is_file():
            raise ApiError(400, f"image path {shown} is not a file the server can read", param="messages")
        with open(path, "rb") as f:
            head = f.read(12)
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ApiError(400, f"image path {shown} cannot be read ({reason}); send a path under --image-root or a data "
                            f"URL", param="messages") from None
    from fd_core.runtime.images import NPY_MAGIC, header_pixels, load_image

    kind = picture_format(head)
    if kind not in ("PNG", "JPEG") and not head.startswith(NPY_MAGIC):
        raise ApiError(400, f"image path {shown} is {described(kind)}; only PNG or JPEG are accepted (or a .npy "
                            f"array [3, H, W]): convert it to PNG", param="messages")
    pixels = header_pixels(str(path))
    if charge is not None and pixels is not None:
        charge(pixels)
    if not decode:
        return None
    try:
        return load_image(str(path))
    except (ConfigError, OSError) as exc:
        raise ApiError(400, f"image {shown}: {exc}", param="messages") from None


class TokenText:
    """Token ids as the API shows them: each token's bytes (Tokenizer.token_bytes: part of a character's bytes for a
    byte-level token, a special token's own text) and those bytes as text (an incomplete character as U+FFFD). Without
    a tokenizer, or for an id outside its vocabulary, "token_id:N" and no bytes (vLLM's form)."""

    def __init__(self, tokenizer: "Tokenizer | None") -> None:
        self.tokenizer = tokenizer

    def token_bytes(self, token_id: int) -> bytes | None:
        return None if self.tokenizer is None else self.tokenizer.token_bytes(token_id)

    def text(self, token_id: int) -> str:
        data = self.token_bytes(token_id)
        return f"token_id:{token_id}" if data is None else data.decode("utf-8", errors="replace")

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        """{"token", "logprob", "bytes"}, as chat's logprobs list each token."""
        data = self.token_bytes(token_id)
        return {"token": self.text(token_id), "logprob": logprob, "bytes": None if data is None else list(data)}

    def chat(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """Chat's choice.logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
        return {"content": [{**self.entry(p.token, p.logprob), "top_logprobs": [self.entry(t, v) for t, v in p.top]}
                            for p in logprobs]}

    def completion(self, logprobs: Sequence[TokenLogprob], offsets: "TextOffsets") -> dict[str, Any]:
        """Completions' choice.logprobs: tokens, token_logprobs, top_logprobs (the k most likely and, as OpenAI's, the
        chosen token too: up to k + 1 entries, keyed by token text; ids of the same text share the likelier's entry)
        and text_offset (where each token's text starts in the choice's text)."""
        return {"tokens": [self.text(p.token) for p in logprobs], "token_logprobs": [p.logprob for p in logprobs],
                "top_logprobs": [self.top(p) for p in logprobs],
                "text_offset": [offsets.next(p.token) for p in logprobs]}

    def prompt(self, ids: Sequence[int], scored: "Sequence[TokenLogprob | None]",
               offsets: "TextOffsets") -> dict[str, Any]:
        """An echoed prompt's tokens in completion()'s shape: its first token's logprob and alternatives null (nothing
        comes before it), as OpenAI's."""
        return {"tokens": [self.text(t) for t in ids],
                "token_logprobs": [None if p is None else p.logprob for p in scored],
                "top_logprobs": [None if p is None else self.top(p) for p in scored],
                "text_offset": [offsets.next(t) for t in ids]}

    def top(self, p: "TokenLogprob") -> dict[str, float]:
        """One token's top_logprobs: the k most likely and the chosen one, by text (the likelier of ids sharing one)."""
        top: dict[str, float] = {}
        for token, value in (*p.top, (p.token, p.logprob)):
            top.setdefault(self.text(token), value)
        return top


class TextOffsets:
    """Where each token of one choice starts in its text, in characters: the tokens' bytes decoded as they come (a
    token that completes a character starts where that character does). Special tokens, which the text skips, and
    the leading space a SentencePiece tokenizer drops from the text's first token, count nothing."""

    def __init__(self, text: TokenText) -> None:
        self.tokens = text
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0
        self.first = True

    def next(self, token_id: int) -> int:
        """The offset of the next token of the choice."""
        at = self.chars
        tokenizer = self.tokens.tokenizer
        data = self.tokens.token_bytes(token_id)
        if tokenizer is None or data is None or token_id in tokenizer.special_ids:
            return at
        if self.first and data.startswith(b" ") and not tokenizer.decode([token_id]).startswith(" "):
            data = data[1:]
        self.first = False
        self.chars += len(self.decoder.decode(data))
        return at


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
