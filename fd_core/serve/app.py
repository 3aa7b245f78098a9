"""The HTTP side of `fd serve`: FastAPI routes over an LLM's submit(), server-sent events, errors in the
OpenAI format, the API key, admission (--max-queue), and the lifecycle under uvicorn (answering while the model
loads, signals, draining, a failed rank ending the server)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Mapping, Protocol, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from fd_core.errors import CheckpointError, ConfigError, FdError, RankError, RequestRefused, SequenceError, speaking
from fd_core.runtime.engine.scheduler import SchedulerClosed
from fd_core.runtime.text.grammar import GrammarError
from fd_core.runtime.text.tools import Tools, ToolStream
from fd_core.serve.bodies import parsed
from fd_core.serve.connections import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    KEEP_ALIVE_S,
    ConnectionLimits,
    protocol_class,
)
from fd_core.serve.metrics import CONTENT_TYPE, UNMATCHED, Metrics
from fd_core.serve.protocol import (
    FINISH_REASONS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    TextOffsets,
    TokenText,
    message_parts,
    new_id,
    now,
    read_image,
    usage,
)
from fd_core.serve.tokenizer_routes import TOKENIZER_PATHS, add_tokenizer_routes

if TYPE_CHECKING:
    from fd_core.runtime.engine.loop import Completion
    from fd_core.runtime.engine.sampling import SamplingParams, TokenLogprob
    from fd_core.runtime.engine.scheduler import Piece
    from fd_core.runtime.text.tokenizer import Tokenizer

RETRY_AFTER_S = 1  # what a client told "queue full" waits before it tries again
RETRY_AFTER_LOADING_S = 5  # what a client told "the model is loading" waits: loading takes seconds to minutes
# --max-request-bytes' default: the longest contexts' text (a million tokens is a few MB) and a few pictures as data
# URLs (base64, 4/3 of the file) fit with room to spare; a larger picture goes as a file under --image-root. The body
# is held whole and parsed into Python strings on the event loop, so the bound is also on that time and memory.
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
# --max-images' default: pictures one chat request may hold. Each is decoded whole before the model's processor
# resizes it (a 2000x2000 one is 48 MB as float32, a tenth to a quarter of a second to decode).
DEFAULT_MAX_IMAGES = 16
# --max-pixels' default: the pixels one request's pictures may hold together, as fd's bound on one picture (64 Mi
# pixels; 768 MB decoded as float32 RGB): sixteen pictures of 2048x2048, or one of 8192x8192.
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024


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
        tools: Sequence[Mapping[str, Any]] | None = None, share: int | None = None,
    ) -> Sequence[Submission]: ...

    def new_share(self) -> int: ...

    def queued(self) -> int: ...

    @property
    def error(self) -> BaseException | None: ...

    @property
    def kv_cache(self) -> Mapping[str, int]: ...


def log(message: str) -> None:
    """One line on stderr: the server's own log (uvicorn's access log is off)."""
    # One write with its newline: a script reading the lines (the ready line) never sees half of one.
    sys.stderr.write(f"fd serve: {message}\n")
    sys.stderr.flush()


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

    def submit_choices(
        self, prompt: Any, sampling: "SamplingParams | None" = None, *, chat: bool = False, images: Sequence[Any] = (),
        tools: Sequence[Mapping[str, Any]] | None = None, share: int | None = None,
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


class Server:
    """The routes and the state they share: admitted requests, the engine's submissions, draining, failure."""

    def __init__(self, engine: Submitter | None, *, name: str, max_queue: int = 64,
                 api_key: str | None = None, image_roots: Sequence[Path] = (),
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_images: int = DEFAULT_MAX_IMAGES,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT_S, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        """`engine` None: the model is still loading (the API answers 503 until attach() hands it over)."""
        self.engine: Submitter = Loading() if engine is None else engine
        self.loading = engine is None
        self.name = name
        self.max_queue, self.api_key, self.image_roots = max_queue, api_key, tuple(r.resolve() for r in image_roots)
        self.max_request_bytes, self.max_images, self.body_timeout = max_request_bytes, max_images, body_timeout
        self.max_pixels = max_pixels
        self.admitted = 0  # requests' prompts admitted and not yet answered (touched on the event loop only)
        self.active: set[Generation] = set()
        self.draining: str | None = None  # why new requests are refused (shutting down, a rank failed)
        self.failure: BaseException | None = None
        self.stop: Callable[[], None] = lambda: None  # ends the HTTP server (set by Http)
        self.metrics = Metrics(lambda: self.admitted, lambda: self.engine.queued(), lambda: self.engine.kv_cache)
        self.tokens = TokenText(self.engine.tokenizer)
        self.app = self.build()

    def attach(self, engine: Submitter) -> None:
        """The loaded model: the API serves from now on (called on the event loop, between requests)."""
        self.engine = engine
        self.tokens = TokenText(engine.tokenizer)
        self.loading = False

    # -- the application ------------------------------------------------------------------
    def build(self) -> FastAPI:
        app = FastAPI(title="fd serve", docs_url=None, redoc_url=None, openapi_url=None)

        # The last added runs first: the key and the loading state are checked before the body is read, then its size.
        app.add_middleware(BodyLimit, server=self)
        app.add_middleware(ApiGate, server=self)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, exc: ApiError) -> Response:
            return self.answer(request, exc)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> Response:
            return self.answer(request, validation_error(exc))

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException) -> Response:
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            # Starlette's own headers kept: a 405 says which methods the route takes (Allow).
            return self.answer(
                request, ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind,
                                  headers=dict(exc.headers or {}))
            )

        @app.exception_handler(Exception)
        async def unexpected(request: Request, exc: Exception) -> Response:
            # No traceback reaches a client; the log keeps the one line a maintainer needs to start from.
            return self.answer(
                request,
                ApiError(500, f"internal error ({type(exc).__name__}: {exc})".replace("\n", " "), kind="server_error"),
            )

        @app.api_route("/health", methods=["GET", "HEAD"])
        async def health() -> Response:
            if self.failure is not None:
                return JSONResponse({"status": "failed", "error": str(self.failure)}, status_code=503)
            if self.draining is not None:
                return JSONResponse({"status": "draining", "reason": self.draining}, status_code=503)
            if self.loading:
                return JSONResponse(
                    {"status": "loading", "model": self.name,
                     "reason": "the model is loading; /health answers 200 once requests are served"},
                    status_code=503, headers={"Retry-After": str(RETRY_AFTER_LOADING_S)},
                )
            return JSONResponse({"status": "ok", "model": self.name, "queued": self.engine.queued()})

        @app.api_route("/metrics", methods=["GET", "HEAD"])
        async def metrics() -> Response:
            return Response(self.metrics.text(), media_type=CONTENT_TYPE)

        @app.api_route("/v1/models", methods=["GET", "HEAD"])
        async def models(request: Request) -> Response:
            self.metrics.request("/v1/models", 200)
            return JSONResponse(
                {"object": "list", "data": [{"id": self.name, "object": "model", "created": 0, "owned_by": "fd"}]}
            )

        add_tokenizer_routes(app, self)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await parsed(request, CompletionRequest)
            self.check_model(body.model)
            body.refuse_unsupported()
            prompts = body.prompts()
            # Off the event loop: a response_format or guided_regex compiles, which may take a while (and has a budget).
            sampling = await asyncio.to_thread(body.sampling, body.limit())
            echoes = [self.prompt_text(p) for p in prompts] if body.echo else None
            return await self.respond(request, "/v1/completions", [(p, False, ()) for p in prompts], sampling,
                                      body.stream, body.include_usage, chat=False, echoes=echoes,
                                      grammar_field=body.grammar_field(), token_ids=body.return_token_ids,
                                      scoring=body.scoring_only)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = await parsed(request, ChatRequest)
            self.check_model(body.model)
            body.refuse_unsupported()

            def settings() -> "tuple[Tools | None, SamplingParams]":
                # Off the event loop: the tools' schemas and a response_format compile (each within its budget).
                tools = body.tool_set(self.engine.chat_template)
                return tools, body.sampling(body.limit(), tools)

            tools, sampling = await asyncio.to_thread(settings)
            turns, urls = self.conversation(body)
            self.check_pictures(len(urls))
            # In a worker thread, as the submission is: a picture takes a tenth of a second or more to decode, which
            # on the event loop every other request would wait for.
            images = await asyncio.to_thread(self.pictures, urls) if urls else ()
            return await self.respond(request, "/v1/chat/completions", [(turns, False, images)], sampling,
                                      body.stream, body.include_usage, chat=True, tools=tools,
                                      grammar_field=body.grammar_field(tools), token_ids=body.return_token_ids)

        return app

    @property
    def chat_template(self) -> str | None:
        """The served checkpoint's chat template (None: none)."""
        return self.engine.chat_template

    def answer(self, request: Request, error: ApiError) -> Response:
        """An error response in the OpenAI format, logged in one line and counted."""
        log(f"{error.status} {request.method} {request.url.path!r}: {error.message}")
        # The route's template, never the client's path: a fixed set of labels (UNMATCHED for any unknown path).
        self.metrics.request(getattr(request.scope.get("route"), "path", None) or UNMATCHED, error.status)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A completion prompt as `echo` returns it: the text sent, or the text of the ids sent."""
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.tokens.tokenizer
        try:
            return "" if tokenizer is None else tokenizer.decode(prompt)
        except Exception:  # noqa: BLE001 - ids outside the vocabulary: the engine refuses the request, naming them
            return ""

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(404,
                           f"model {model!r} is not served here; this server serves {self.name!r} (GET /v1/models)",
                           kind="not_found_error", param="model", code="model_not_found")

    # -- prompts ----------------------------------------------------------------------------
    def conversation(self, body: ChatRequest) -> tuple[list[dict[str, Any]], list[str]]:
        """(the messages as the engine renders them through the checkpoint's chat template, the pictures' URLs in
        order); no picture is read here.

        A message with pictures has a list content (an image part per picture where it stood, then its text), as VL
        templates expect; one without keeps a string, which every template takes."""
        turns: list[dict[str, Any]] = []
        urls: list[str] = []
        for index, message in enumerate(body.messages):
            text, found = message_parts(message, index)
            urls += found
            content: Any = text if not found else [*({"type": "image"} for _ in found), {"type": "text", "text": text}]
            if message.role == "tool" and message.tool_call_id is None:
                raise ApiError(400, f"messages[{index}]: a tool message needs the tool_call_id of the call it answers",
                               param=f"messages[{index}]")
            if message.tool_calls and message.role != "assistant":
                raise ApiError(400, f"messages[{index}]: only an assistant message carries tool_calls",
                               param=f"messages[{index}]")
            turn = {"role": message.role, "content": content}
            calls = message.template_calls()
            if calls:
                turn["tool_calls"] = calls
            if message.tool_call_id is not None:
                turn["tool_call_id"] = message.tool_call_id
            turns.append(turn)
        return turns, urls

    def check_pictures(self, count: int) -> None:
        """A request's pictures refused before any is read: by a model that takes none, or more than --max-images."""
        if count and not self.engine.multimodal:
            raise ApiError(400, f"the model {self.name!r} takes no image (its architecture reads text only); drop the "
                                f"image_url parts, or serve a vision-language model", param="messages")
        if count > self.max_images:
            raise ApiError(400, f"the request has {count} pictures and --max-images {self.max_images} admits at most "
                                f"{self.max_images} per request; send fewer, or start fd serve with a larger "
                                f"--max-images", param="messages")

    def pictures(self, urls: Sequence[str]) -> tuple[Any, ...]:
        """The pictures decoded, in order, once every one is checked from its header (format, size, and the request's
        pixels together against --max-pixels): a request refused for its pictures decodes none."""
        total = 0

        def charge(pixels: int) -> None:
            nonlocal total
            total += pixels
            if total > self.max_pixels:
                raise ApiError(400, f"the request's pictures hold more than --max-pixels {self.max_pixels} pixels "
                                    f"together (each is decoded to 12 bytes a pixel); send fewer or smaller pictures, "
                                    f"or start fd serve with a larger --max-pixels", param="messages")

        # Every picture's header first: three 8000x8000 pictures are refused before any is decoded (+1.9 GB each).
        for url in urls:
            read_image(url, self.image_roots, charge=charge, decode=False)
        return tuple(read_image(u, self.image_roots) for u in urls)

    # -- generating -------------------------------------------------------------------------
    def admit(self, count: int) -> None:
        if count > self.max_queue:
            # Never admissible, however long the client waits: a 503 with Retry-After would have it retry forever.
            raise ApiError(400,
                           f"the request asks for {count} sequences (its prompts times n) and --max-queue "
                           f"{self.max_queue} admits at most {self.max_queue} at once, so no retry can succeed; send "
                           f"fewer prompts or a smaller n per request, or start fd serve with a larger --max-queue",
                           param="prompt")
        if self.failure is not None:
            raise ApiError(503, f"the server has stopped: {self.failure}", kind="server_error", code="unavailable")
        if self.draining is not None:
            raise ApiError(503, f"the server is {self.draining}; it admits no new request", kind="server_error",
                           code="unavailable")
        if self.admitted + count > self.max_queue:
            raise ApiError(503,
                           f"the queue is full ({self.admitted} of --max-queue {self.max_queue} requests admitted); "
                           f"retry later",
                           kind="server_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.admitted += count

    async def submit(
        self, items: Sequence[tuple[Any, bool, tuple[Any, ...]]], sampling: "SamplingParams",
        tools: "Tools | None" = None, grammar_field: str = "response_format",
    ) -> list[Generation]:
        """Every prompt submitted (checked at once by the engine); one refused withdraws the others. A grammar the
        model's tokens cannot follow is refused naming `grammar_field`, the request field it came from."""
        generations: list[Generation] = []
        try:
            share = self.engine.new_share()  # the request's prompts and choices: one fair share of the batch
            for index, (prompt, chat, images) in enumerate(items):
                # In a worker thread: the template, the tokenizer and the plugins' gates must not stall the other
                # streams.
                choices = await asyncio.to_thread(self.engine.submit_choices, prompt, sampling, chat=chat,
                                                  images=images, tools=None if tools is None else tools.for_template(),
                                                  share=share)
                # OpenAI's choice index: prompt by prompt, n choices each.
                generations += [Generation(index * sampling.n + j, s, index) for j, s in enumerate(choices)]
        except RequestRefused as exc:
            self.withdraw(generations)
            raise ApiError(400, str(exc), code="request_refused") from None
        except GrammarError as exc:
            self.withdraw(generations)
            raise ApiError(400, named_field(str(exc), grammar_field), param=grammar_field) from None
        except (ConfigError, CheckpointError) as exc:
            self.withdraw(generations)
            raise ApiError(400, str(exc)) from None
        except (RankError, SchedulerClosed) as exc:
            self.withdraw(generations)
            self.fail(exc)
            raise ApiError(503, str(exc), kind="server_error", code="rank_failed") from None
        self.active.update(generations)
        return generations

    def withdraw(self, generations: Sequence[Generation], reason: str | None = None) -> None:
        """Cancel these generations (freed at the engine's next step); `reason` is what their clients are told."""
        for g in generations:
            if reason is not None and g.cancelled is None:
                g.cancelled = reason
            g.submission.cancel()

    async def events(
        self, generations: Sequence[Generation], every_token: bool = False,
    ) -> AsyncIterator[tuple[Generation, "Piece | None"]]:
        """(generation, new text with its tokens' logprobs) as the engine produces it, then (generation, None) when it
        is done; errors re-raised."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[Generation, str, Any]] = asyncio.Queue()

        def pump(generation: Generation) -> None:
            # The engine's iterators block: one thread per generation carries its pieces onto the event loop.
            def put(kind: str, value: Any) -> None:
                with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening any more
                    loop.call_soon_threadsafe(queue.put_nowait, (generation, kind, value))

            try:
                for piece in generation.submission.pieces(every_token):
                    put("text", piece)
                put("done", generation.submission.result())
            except BaseException as exc:  # noqa: BLE001 - carried to the event loop, which answers the client
                put("error", exc)

        for g in generations:
            threading.Thread(target=pump, args=(g,), name=f"fd-serve-{g.index}", daemon=True).start()
        remaining = len(generations)
        while remaining:
            generation, kind, value = await queue.get()
            if kind == "text":
                yield generation, value
            elif kind == "done":
                if generation.cancelled is not None:
                    raise ApiError(503, generation.cancelled, kind="server_error", code="unavailable")
                generation.completion = value
                remaining -= 1
                s = generation.submission
                self.metrics.finished(
                    s.prompt_tokens, len(value.token_ids), generation.submitted, s.first_token_at, time.time()
                )
                yield generation, None
            elif generation.cancelled is not None:
                raise ApiError(503, generation.cancelled, kind="server_error", code="unavailable")
            else:
                raise value

    def release(self, generations: Sequence[Generation], endpoint: str, count: int) -> None:
        """The request has been answered or abandoned: unfinished generations are cancelled, its places freed."""
        unfinished = [g for g in generations if g.completion is None]
        self.withdraw(unfinished)
        self.active.difference_update(generations)
        self.admitted -= count
        if unfinished and self.draining is None:
            self.metrics.request(endpoint, "cancelled")

    def engine_error(self, exc: BaseException, grammar_field: str = "response_format") -> ApiError:
        """What a failure while generating becomes for the client; a failed rank ends the server."""
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, (RankError, SchedulerClosed)):
            self.fail(exc)
            return ApiError(503, str(exc), kind="server_error", code="rank_failed")
        if isinstance(exc, SequenceError):  # this request's own failure: the others in its batch went on
            message = str(exc)
            if message.startswith(GRAMMAR_PREFIX):  # its grammar, named as the client sent it (`grammar_field`)
                return ApiError(400, named_field(message, grammar_field), param=grammar_field, code="generation_failed")
            if exc.request_fault:
                return ApiError(400, message, code="generation_failed")
            # The engine's own failure (a kernel, a processor): its detail goes to the server's log, not the client.
            log(f"a sequence failed on the engine's side: {message}")
            return ApiError(500, "the engine failed while generating this request's answer (the others in its batch "
                                 "went on); the server's log says why; retry, or report it to the server's operator",
                            kind="server_error", code="generation_failed")
        if isinstance(exc, FdError):
            return ApiError(500, str(exc), kind="server_error")
        return ApiError(500, f"internal error ({type(exc).__name__}: {exc})".replace("\n", " "), kind="server_error")

    async def respond(self, request: Request, endpoint: str, items: Sequence[tuple[Any, bool, tuple[Any, ...]]],
                      sampling: "SamplingParams", stream: bool, include_usage: bool, chat: bool,
                      tools: "Tools | None" = None, echoes: Sequence[str] | None = None,
                      grammar_field: str = "response_format", token_ids: bool = False,
                      scoring: bool = False) -> Response:
        """The request's answer, streamed or whole; `token_ids` (return_token_ids): each choice (and each streamed
        chunk) carries its tokens' ids, as a checkpoint without a tokenizer's streamed chunks always do; `scoring`
        (echo with max_tokens 0): the prompts scored, the one token generated after each not shown."""
        count = len(items) * sampling.n  # every choice is a sequence of its own in the queue
        self.admit(count)
        try:
            generations = await self.submit(items, sampling, tools, grammar_field)
        except BaseException:
            self.admitted -= count
            raise
        ident, created = new_id("chatcmpl" if chat else "cmpl"), now()
        if stream:
            # Without a tokenizer every token's text is empty: its id is what the client reads, a chunk per token.
            ids = token_ids or self.tokens.tokenizer is None
            body = self.sse(request, endpoint, generations, ident, created, chat, include_usage, count,
                            sampling.logprobs is not None, tools, echoes, grammar_field, ids and not scoring, scoring)
            return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(self.collect(generations))
        watch = asyncio.ensure_future(gone(request))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this task was cancelled (the server is stopping at once)
            watch.cancel()
            collect.cancel()
            self.release(generations, endpoint, count)
            raise
        watch.cancel()
        if not collect.done() or collect.cancelled():
            collect.cancel()
            self.release(generations, endpoint, count)
            log(f"POST {endpoint}: the client went away before its answer; its generation(s) were cancelled")
            # Nobody reads it: the code nginx logs for a client that closed the request.
            return Response(status_code=499)
        error = collect.exception()
        self.release(generations, endpoint, count)
        if error is not None:
            raise self.engine_error(error, grammar_field) from None
        self.metrics.request(endpoint, 200)
        answer = self.whole(generations, ident, created, chat, sampling.logprobs is not None, tools, echoes, scoring)
        if token_ids:
            for shown, g in zip(answer["choices"], generations, strict=True):
                shown["token_ids"] = list(g.completion.token_ids) if g.completion is not None and not scoring else []
        return JSONResponse(answer)

    async def collect(self, generations: Sequence[Generation]) -> None:
        """Every generation run to its end (their completions kept on them)."""
        async for _ in self.events(generations):
            pass

    def logprobs(
        self, chat: bool, logprobs: "Sequence[TokenLogprob] | None", offsets: TextOffsets | None = None
    ) -> dict[str, Any] | None:
        """A choice's (or a chunk's) logprobs in its endpoint's shape; None when the request asked for none."""
        if logprobs is None:
            return None
        if chat:
            return self.tokens.chat(logprobs)
        return self.tokens.completion(logprobs, offsets or TextOffsets(self.tokens))

    def echo(self, generation: Generation, echoes: Sequence[str], logprobs: bool, offsets: TextOffsets,
             ) -> tuple[str, dict[str, Any] | None]:
        """A completion choice's echoed prompt: its text, and, asked for, its tokens' logprobs (which move `offsets`
        past it)."""
        text = echoes[generation.prompt]
        if not logprobs:
            return text, None
        s = generation.submission
        scored = s.prompt_logprobs if s.prompt_logprobs is not None else [None] * len(s.prompt_ids)
        return text, self.tokens.prompt(s.prompt_ids, scored, offsets)

    def whole(
        self, generations: Sequence[Generation], ident: str, created: int, chat: bool, logprobs: bool = False,
        tools: "Tools | None" = None, echoes: Sequence[str] | None = None, scoring: bool = False,
    ) -> dict[str, Any]:
        """The whole answer; `scoring` (echo with max_tokens 0): each choice is its prompt alone, with its logprobs, and
        the token the engine chose after it is not shown (nor counted)."""
        choices: list[dict[str, Any]] = []
        prompt_tokens = completion_tokens = 0
        counted: set[int] = set()
        for g in generations:
            c = g.completion
            assert c is not None
            if g.prompt not in counted:  # a prompt's n choices count its tokens once, as OpenAI's usage does
                counted.add(g.prompt)
                prompt_tokens += len(c.prompt_ids)
            completion_tokens += 0 if scoring else len(c.token_ids)
            reason = "length" if scoring else FINISH_REASONS.get(c.finish_reason, c.finish_reason)
            # Echoed, the answer's logprobs are shown after the prompt's, their offsets going on (below).
            shown = self.logprobs(chat, c.logprobs if logprobs and echoes is None else None)
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": c.text or ""}
                if tools is not None:
                    content, calls = tools.parse(c.text or "")
                    message["content"] = content
                    if calls:  # OpenAI's answer when the model called tools (and was not cut by max_tokens)
                        message["tool_calls"] = calls
                        reason = "tool_calls" if reason == "stop" else reason
                choices.append({"index": g.index, "message": message, "logprobs": shown, "finish_reason": reason})
            elif echoes is not None:
                offsets = TextOffsets(self.tokens)
                text, echoed = self.echo(g, echoes, logprobs, offsets)
                if scoring:
                    shown = echoed
                else:
                    shown = None if echoed is None else joined(echoed, self.logprobs(chat, c.logprobs, offsets))
                    text += c.text or ""
                choices.append({"index": g.index, "text": text, "logprobs": shown, "finish_reason": reason})
            else:
                choices.append({"index": g.index, "text": c.text or "", "logprobs": shown, "finish_reason": reason})
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.name, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    async def sse(self, request: Request, endpoint: str, generations: Sequence[Generation], ident: str, created: int,
                  chat: bool, include_usage: bool, count: int, logprobs: bool = False,
                  tools: "Tools | None" = None, echoes: Sequence[str] | None = None,
                  grammar_field: str = "response_format", token_ids: bool = False,
                  scoring: bool = False) -> AsyncIterator[str]:
        """Server-sent events in the OpenAI chunk format, ending with `data: [DONE]`; a client that goes away cancels
        its generations. Asked for, each chunk carries the logprobs of the tokens it brings. With tools, the text from
        a <tool_call> on is held back and sent at the end as the choice's tool_calls. Echoed, a completion choice's
        first chunk is its prompt (with its tokens' logprobs), once they are scored. With `token_ids` (or logprobs) a
        chunk comes for every token, even one that completes no character, carrying its id in `token_ids`."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        offsets = {g.index: TextOffsets(self.tokens) for g in generations}  # each choice's text offsets go on
        held = {g.index: ToolStream(tools) for g in generations} if tools is not None else {}

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            data = {"id": ident, "object": kind, "created": created, "model": self.name, "choices": choices, **extra}
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        def choice(index: int, text: str | None, reason: str | None, first: bool = False,
                   piece: "Piece | None" = None) -> dict[str, Any]:
            shown = self.logprobs(chat, piece.logprobs, offsets[index]) if logprobs and piece is not None else None
            ids = {"token_ids": list(piece.token_ids)} if token_ids and piece is not None else {}
            if not chat:
                return {"index": index, "text": text or "", "logprobs": shown, "finish_reason": reason, **ids}
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            )
            return {"index": index, "delta": delta, "logprobs": shown, "finish_reason": reason, **ids}

        status: int | str = 200
        try:
            if chat:
                yield chunk([choice(g.index, None, None, first=True) for g in generations])
            try:
                echoed: set[int] = set()
                async for generation, piece in self.events(generations, token_ids or logprobs):
                    if echoes is not None and generation.index not in echoed:
                        echoed.add(generation.index)
                        text, shown = self.echo(generation, echoes, logprobs, offsets[generation.index])
                        yield chunk([{"index": generation.index, "text": text, "logprobs": shown,
                                      "finish_reason": None}])
                    stream = held.get(generation.index)
                    if piece is not None and scoring:
                        continue  # the token chosen after a scored prompt is not the answer: there is none
                    if piece is not None:
                        text = piece.text if stream is None else stream.feed(piece.text)
                        if text or stream is None or logprobs or token_ids:
                            yield chunk([choice(generation.index, text, None, piece=piece)])
                        continue
                    c = generation.completion
                    assert c is not None
                    reason = "length" if scoring else FINISH_REASONS.get(c.finish_reason, c.finish_reason)
                    if stream is not None:
                        content, calls = stream.finish()
                        if content:
                            yield chunk([choice(generation.index, content, None)])
                        if calls:
                            reason = "tool_calls" if reason == "stop" else reason
                            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
                            yield chunk([{"index": generation.index, "delta": delta, "logprobs": None,
                                          "finish_reason": None}])
                    yield chunk([choice(generation.index, None, reason)])
            except (asyncio.CancelledError, GeneratorExit):
                raise
            # The headers are sent: the error travels as an event, as OpenAI's does.
            except Exception as exc:  # noqa: BLE001
                error = self.engine_error(exc, grammar_field)
                log(f"{error.status} POST {endpoint} (streaming): {error.message}")
                status = error.status
                yield f"data: {json.dumps(error.body())}\n\n"
                return
            if include_usage:
                done = {g.prompt: g.completion for g in generations if g.completion is not None}
                generated = 0 if scoring else sum(len(g.completion.token_ids) for g in generations
                                                  if g.completion is not None)
                yield chunk([], usage=usage(sum(len(c.prompt_ids) for c in done.values()), generated))
            yield "data: [DONE]\n\n"
        finally:
            self.release(generations, endpoint, count)
            if all(g.completion is not None for g in generations) or status != 200:
                self.metrics.request(endpoint, status)

    # -- lifecycle --------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """A rank failed: refuse everything from now on, cancel what runs, end the server (Http.wait() raises it)."""
        if self.failure is not None:
            return
        self.failure = exc
        self.draining = "stopping: a rank failed"
        log(f"stopping: {exc}")
        self.withdraw(list(self.active), f"cancelled: the server is stopping ({exc})")
        self.stop()

    async def drain(self, reason: str, timeout: float) -> None:
        """Stop admitting; let admitted requests finish for `timeout` seconds; cancel the rest; end the server."""
        self.draining = reason
        log(f"{reason}: admitting no new request; {self.admitted} in flight get up to {timeout:g} s to finish")
        deadline = time.monotonic() + timeout
        while self.admitted and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.admitted:
            log(f"cancelling {len(self.active)} generation(s) still running after {timeout:g} s")
            self.withdraw(
                list(self.active),
                f"cancelled: the server is {reason} and the request ran past --shutdown-timeout {timeout:g} s",
            )
            # Their streams end at the engine's next step; a little while for them to say so.
            end = time.monotonic() + 2.0
            while self.admitted and time.monotonic() < end:
                await asyncio.sleep(0.05)
        self.stop()


class ApiGate:
    """The API (/v1/... and the tokenizer's routes) needs the key, then a loaded model (503 while it loads, before the
    body is read or checked); /health and /metrics stay open for probes and scrapers. Plain ASGI (not
    BaseHTTPMiddleware), so that a route still sees its client disconnect."""

    def __init__(self, app: Any, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] == "http" and (path.startswith("/v1") or path in TOKENIZER_PATHS):
            request = Request(scope, receive)
            refused = self.refusal(request)
            if refused is not None:
                if _has_body(scope):  # left unread: the connection ends with the answer
                    refused.headers.setdefault("Connection", "close")
                response = self.server.answer(request, refused)
                await response(scope, receive, send)
                return
            # What the engine says about the request (in worker threads, which copy this context) is said in the
            # client's terms: its fields, never the server's paths or flags meant for fd run.
            with speaking("http"):
                await self.app(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, request: Request) -> ApiError | None:
        """Why an API request is refused before its route (no key, the model loading), or None."""
        key = self.server.api_key
        if key is not None:
            # The scheme is case-insensitive (RFC 9110 section 11.1: "bearer" is "Bearer"), the key is not.
            scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
            given = credentials.strip(" ") if scheme.lower() == "bearer" else ""
            if not hmac.compare_digest(given.encode(), key.encode()) or not given:
                return ApiError(401, "a valid API key is needed: send the header Authorization: Bearer KEY",
                                kind="authentication_error", code="invalid_api_key",
                                headers={"WWW-Authenticate": 'Bearer realm="fd serve"'})
        if self.server.loading:
            return still_loading()
        return None


class BodyLimit:
    """Request bodies of at most --max-request-bytes, refused with 413 before the JSON is parsed: one whose
    Content-Length is above the limit before a byte of it is read; any other counted as it arrives and refused once it
    passes the limit. A body not whole within --body-timeout seconds of its headers gets 408 (a client trickling it
    would hold its connection and its buffer for as long as it liked). The body is read here, then handed on to the
    route as it came. Plain ASGI, as ApiGate."""

    def __init__(self, app: Any, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.server.max_request_bytes
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await self.refuse(scope, receive, send, int(declared))
            return
        messages: list[Any] = []
        size = 0

        async def read() -> str:
            # The body's messages into `messages`: "whole", "gone" (the client left before it was whole) or "large".
            nonlocal size
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return "gone"
                messages.append(message)
                size += len(message.get("body", b""))
                if size > limit:
                    return "large"
                if not message.get("more_body", False):
                    return "whole"

        try:
            outcome = await asyncio.wait_for(read(), self.server.body_timeout)
        except asyncio.TimeoutError:
            timeout = self.server.body_timeout
            error = ApiError(408, f"the request body was not whole {timeout:g} s after its headers ({size} bytes "
                                  f"came); send it at once, or start fd serve with a larger --body-timeout",
                             code="request_timeout", headers={"Connection": "close"})
            await self.server.answer(Request(scope), error)(scope, receive, send)
            return
        except asyncio.CancelledError:
            # The server is ending (a second signal, or past its graceful shutdown) before the body came: the client
            # is told so, where uvicorn would log the cancellation as a crash (a traceback) and answer a bare 500.
            error = ApiError(503, f"the server is {self.server.draining or 'stopping'} and the request body was not "
                                  f"whole ({size} bytes came); retry once the server is back", kind="server_error",
                             code="unavailable", headers={"Connection": "close"})
            await self.server.answer(Request(scope), error)(scope, receive, send)
            return
        if outcome == "large":
            await self.refuse(scope, receive, send, None)
        if outcome != "whole":  # refused, or nobody to answer
            return
        pending = iter(messages)

        async def replay() -> Any:
            # The body's messages as they came, then the connection's own (a disconnect, for a route watching).
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)

    async def refuse(self, scope: Any, receive: Any, send: Any, declared: int | None) -> None:
        limit = self.server.max_request_bytes
        size = "" if declared is None else f"{declared} bytes, "
        error = ApiError(413, f"the request body is {size}more than --max-request-bytes {limit} ({sized(limit)}) "
                              f"admits; send a smaller request (pictures as files under --image-root rather than data "
                              f"URLs), or start fd serve with a larger --max-request-bytes", code="request_too_large",
                         # The body is left unread: the connection ends with the answer.
                         headers={"Connection": "close"})
        response = self.server.answer(Request(scope), error)
        await response(scope, receive, send)


def _has_body(scope: Any) -> bool:
    """Whether the request sends a body (a Content-Length above 0, or chunked)."""
    headers = dict(scope.get("headers") or ())
    length = headers.get(b"content-length", b"0")
    return b"transfer-encoding" in headers or (length.isdigit() and int(length) > 0)


def joined(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two runs of completions' logprobs (each list field) one after the other."""
    return {key: list(values) + list((then or {}).get(key, [])) for key, values in first.items()}


def sized(count: int) -> str:
    """A byte count as people read it: 16 MiB, 512 KiB, 1000 bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift} {unit}"
    return f"{count} bytes"


async def gone(request: Request) -> None:
    """Returns once the client has closed the connection (a request without a stream has no other way to see it)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


GRAMMAR_PREFIX = "grammar: "  # how the engine's grammar errors begin: the field SamplingParams.grammar


def named_field(message: str, field: str) -> str:
    """A grammar error as the client sent the grammar: "grammar: ..." as "response_format: ...", say."""
    return f"{field}: {message.removeprefix(GRAMMAR_PREFIX)}" if message.startswith(GRAMMAR_PREFIX) else message


def validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's validation error as a 400 naming the first field that is wrong (or saying the body is not JSON)."""
    errors = list(exc.errors())
    first = errors[0] if errors else {}
    given = first.get("input")
    if first.get("type") == "json_invalid" or (
        tuple(first.get("loc", ())) == ("body",) and isinstance(given, (bytes, str))
    ):
        return ApiError(
            400, "the request body is not valid JSON: send a JSON object with Content-Type: application/json"
        )
    # Union members (str, list[int], ...) appear in pydantic's location; the client named only the fields.
    every = [p for p in first.get("loc", ()) if p != "body"]
    loc = [str(p) for p in every if isinstance(p, int) or FIELD.match(str(p)) and str(p) not in TYPE_TAGS]
    param = ".".join(loc) or None
    if first.get("type") == "missing":
        return ApiError(400, f"{param or 'the body'}: a required field is missing", param=param)
    shown = json.dumps(given)[:80] if isinstance(given, (int, float, str, bool, list)) else ""
    said = str(first.get("msg", "invalid")).removeprefix("Value error, ")  # a validator's own sentence, as it wrote it
    if first.get("type") == "value_error":
        shown = ""  # the sentence names what is wrong; the value may be a whole body
    message = f"{param or 'the body'}: {said}" + (f" (got {shown})" if shown else "")
    # The request models are strict: "10" is not taken for 10, nor true for 1. Said for a field of one type only
    # (a union's first member is not all it takes).
    expected = EXPECTED.get(str(first.get("type")))
    if expected is not None and len(loc) == len(every):
        message += f"; send {expected} (values of another JSON type are not converted)"
    return ApiError(400, message, param=param)


FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# pydantic's type errors: what the field takes, in JSON's words.
EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
            "string_type": "a string", "list_type": "a list", "dict_type": "an object"}


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), before the model loads, so that a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it a response
    # written in two pieces waits ~40 ms for the client's delayed ACK (Nagle's algorithm).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host"
        ) from None
    return sock


@dataclass
class ServeOptions:
    """How `fd serve` listens and admits."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 64
    shutdown_timeout: float = 30.0
    image_roots: tuple[Path, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_images: int = DEFAULT_MAX_IMAGES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_pixels: int = DEFAULT_MAX_PIXELS


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as fd's other commands exit
EXIT_TERMINATED = 143  # 128 + SIGTERM
# After a second signal, how long the cancelled requests have to tell their clients (the engine's next step) before the
# server ends: cut at once, a stream ended without its error event, and its task's cancellation was logged as a crash.
STOP_NOW_S = 2.0


def address(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket (an IPv6 host in brackets; with --port 0, the port it was given)."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


class Http:
    """uvicorn serving a Server on its bound socket, on a thread of its own, from before the model loads (the API
    answering 503 "loading" meanwhile) until a signal drains it or a rank fails.

    The main thread keeps the signals: while the model loads, SIGTERM or SIGINT must interrupt the code that starts
    the ranks, which runs there (its Terminated or KeyboardInterrupt stops them); once ready() has handed the model
    over, they are forwarded to the event loop, which drains."""

    def __init__(self, server: Server, sock: socket.socket, options: ServeOptions) -> None:
        import uvicorn

        class Uvicorn(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                # fd's handlers drain first and decide the exit code; uvicorn's would re-raise the signal at exit
                # (and cannot be installed off the main thread anyway).
                yield

        # The h11 protocol always (not httptools where it is installed): fd's connection limits are enforced in it.
        limits = ConnectionLimits(options.header_timeout, options.max_connections)
        config = uvicorn.Config(server.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=3, timeout_keep_alive=KEEP_ALIVE_S,
                                http=protocol_class(limits, log))
        self.server, self.sock, self.options = server, sock, options
        self.http = Uvicorn(config)
        self.received: list[int] = []  # the stop signals forwarded to the event loop, in order
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None  # what ended the HTTP thread other than a stop
        self.previous: dict[int, Any] = {}  # the handlers ready() replaced, given back by close()
        self.tasks: set[asyncio.Task[None]] = set()  # the drain: referenced, as the loop keeps only weak references
        self.thread = threading.Thread(target=self.main, name="fd-serve-http", daemon=True)
        server.stop = self.stop

    def stop(self) -> None:
        """End the HTTP server (from any thread): uvicorn looks at the flag every 0.1 s."""
        self.http.should_exit = True

    def start(self) -> str:
        """Accept connections (the API refused until ready()); the address, once they are accepted."""
        # The engine's thread, the pump threads and the event loop hand every token on: with Python's default
        # 5 ms switch interval each hand-off can wait that long for the GIL, which at a tiny model's step time
        # would cost more than the step itself.
        sys.setswitchinterval(0.0005)
        self.thread.start()
        while not self.http.started:
            if not self.thread.is_alive():
                raise self.ended()
            time.sleep(0.01)
        return address(self.sock)

    def ready(self, engine: Submitter) -> None:
        """Hand the loaded model to the routes, then the stop signals to the event loop: from the return on, requests
        are served and SIGTERM or SIGINT drains them."""
        import concurrent.futures

        assert self.loop is not None, "start() first"

        async def attach() -> None:
            self.server.attach(engine)  # on the event loop: no request sees half of it

        try:
            attached = asyncio.run_coroutine_threadsafe(attach(), self.loop)
        except RuntimeError:  # the loop has closed: the HTTP thread ended while the model loaded
            raise self.ended() from None
        while True:
            try:
                attached.result(0.1)
                break
            except concurrent.futures.TimeoutError:
                if not self.thread.is_alive():
                    raise self.ended() from None
        for signum in (signal.SIGTERM, signal.SIGINT):
            self.previous[signum] = signal.signal(signum, self.forward)

    def wait(self) -> int:
        """Until the server ends: the exit code (143 after SIGTERM, 130 after SIGINT), or the failed rank's error."""
        self.thread.join()  # interrupted by the signals, whose handler (forward) runs here
        if self.server.failure is not None:
            raise self.server.failure
        if self.error is not None:
            raise self.error
        if self.received:
            return EXIT_TERMINATED if self.received[0] == signal.SIGTERM else EXIT_INTERRUPTED
        return 0

    def close(self) -> None:
        """Stop the HTTP server if it still runs (the load failed or was interrupted) and give the signals back."""
        self.stop()
        if self.thread.is_alive():
            self.thread.join(10)  # uvicorn's graceful shutdown is bounded (timeout_graceful_shutdown)
        for signum, handler in self.previous.items():
            # None: a handler installed from C, which Python cannot reinstate; the default is the nearest.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self.previous.clear()

    def ended(self) -> ConfigError:
        """Why the HTTP thread ended before the server was ready."""
        why = f"{type(self.error).__name__}: {self.error}" if self.error is not None else "it stopped"
        return ConfigError(f"the HTTP server ended before the model was loaded ({why}); see the lines above")

    # -- on the HTTP thread -------------------------------------------------------------------
    def main(self) -> None:
        try:
            asyncio.run(self.serve())
        except BaseException as exc:  # noqa: BLE001 - carried to the main thread, which raises it
            self.error = exc

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        watcher = self.loop.create_task(self.watch_ranks())
        try:
            await self.http.serve(sockets=[self.sock])
        finally:
            watcher.cancel()

    async def watch_ranks(self) -> None:
        # Ranks that fail while no request runs: the LLM says so, and the server ends as when a request meets it.
        server = self.server
        while server.failure is None:
            await asyncio.sleep(0.5)
            error = server.engine.error
            if error is not None:
                server.fail(error if isinstance(error, FdError) else RankError(str(error)))

    def forward(self, signum: int, frame: Any) -> None:
        """SIGTERM or SIGINT, in the main thread once the server is ready: handed to the event loop."""
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the server is ending already
                loop.call_soon_threadsafe(self.on_signal, signum)

    async def stop_now(self) -> None:
        """After a second signal: the cancelled requests' clients are told so (each stream's error event goes out at
        the engine's next step), for up to STOP_NOW_S, then the server ends without waiting for anything else."""
        end = time.monotonic() + STOP_NOW_S
        while self.server.admitted and time.monotonic() < end:
            await asyncio.sleep(0.02)
        self.http.force_exit = True
        self.stop()

    def on_signal(self, signum: int) -> None:
        """On the event loop: the first signal drains, a second cancels what runs and ends the server at once."""
        server = self.server
        if self.received:
            server.withdraw(list(server.active), "cancelled: the server was told to stop at once (a second signal)")
            if len(self.received) > 1:  # a third: no more waiting for anyone
                self.http.force_exit = True
                self.stop()
                return
            self.received.append(signum)
            task = asyncio.get_running_loop().create_task(self.stop_now())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return
        self.received.append(signum)
        name = "SIGTERM" if signum == signal.SIGTERM else "SIGINT"
        task = asyncio.get_running_loop().create_task(
            server.drain(f"shutting down ({name})", self.options.shutdown_timeout)
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
