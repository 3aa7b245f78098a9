"""The HTTP side of `fd serve`: the application over an LLM's submit() (its middleware, error handlers and route
modules put together), and the state the routes share: admission (--max-queue), the engine's submissions, the
request's answer, streamed or whole, draining, and a failed rank ending the server. The lifecycle under uvicorn
(answering while the model loads, signals) is lifecycle.py's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fd_core.errors import CheckpointError, ConfigError, FdError, RankError, RequestRefused, SequenceError
from fd_core.runtime.engine.scheduler import SchedulerClosed
from fd_core.runtime.text.grammar import GrammarError
from fd_core.serve.answers import whole
from fd_core.serve.connections import DEFAULT_BODY_TIMEOUT_S
from fd_core.serve.errors import GRAMMAR_PREFIX, add_error_handlers, named_field
from fd_core.serve.handoffs import HANDED, handed_answer, handoff_of
from fd_core.serve.lifecycle import EXIT_INTERRUPTED, EXIT_TERMINATED, Http, bind
from fd_core.serve.log import log
from fd_core.serve.metrics import UNMATCHED, Metrics
from fd_core.serve.middleware import ApiGate, BodyLimit
from fd_core.serve.openai_routes import add_openai_routes
from fd_core.serve.options import DEFAULT_MAX_IMAGES, DEFAULT_MAX_PIXELS, DEFAULT_MAX_REQUEST_BYTES, ServeOptions
from fd_core.serve.protocol import ApiError, TokenText, new_id, now, read_image
from fd_core.serve.status_routes import add_status_routes
from fd_core.serve.streaming import collect, sse
from fd_core.serve.submissions import Generation, Loading, Submitter
from fd_core.serve.tokenizer_routes import add_tokenizer_routes

if TYPE_CHECKING:
    from fd_core.runtime.engine.loop import KVHandoff
    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.text.tools import Tools

# Still importable from here, where server.py and the tests take them from; each lives in the module its import names.
__all__ = ["DEFAULT_MAX_IMAGES", "DEFAULT_MAX_PIXELS", "DEFAULT_MAX_REQUEST_BYTES", "EXIT_INTERRUPTED",
           "EXIT_TERMINATED", "Http", "ServeOptions", "Server", "bind", "log"]

RETRY_AFTER_S = 1  # what a client told "queue full" waits before it tries again


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
        """The application: the middleware, the error handlers and the routes, answering from this server."""
        app = FastAPI(title="fd serve", docs_url=None, redoc_url=None, openapi_url=None)

        # The last added runs first: the key and the loading state are checked before the body is read, then its size.
        app.add_middleware(BodyLimit, server=self)
        app.add_middleware(ApiGate, server=self)
        add_error_handlers(app, self)
        add_status_routes(app, self)
        add_tokenizer_routes(app, self)
        add_openai_routes(app, self)
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

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(404,
                           f"model {model!r} is not served here; this server serves {self.name!r} (GET /v1/models)",
                           kind="not_found_error", param="model", code="model_not_found")

    # -- pictures ---------------------------------------------------------------------------
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
        tools: "Tools | None" = None, grammar_field: str = "response_format", handoff: "KVHandoff | None" = None,
    ) -> list[Generation]:
        """Every prompt submitted (checked at once by the engine); one refused withdraws the others. A grammar the
        model's tokens cannot follow is refused naming `grammar_field`, the request field it came from."""
        generations: list[Generation] = []
        try:
            share = self.engine.new_share()  # the request's prompts and choices: one fair share of the batch
            for index, (prompt, chat, images) in enumerate(items):
                # In a worker thread: the template, the tokenizer and the plugins' gates must not stall the other
                # streams.
                handing = {} if handoff is None else {"handoff": handoff}  # a router's request (handoffs.py)
                choices = await asyncio.to_thread(self.engine.submit_choices, prompt, sampling, chat=chat,
                                                  images=images, tools=None if tools is None else tools.for_template(),
                                                  share=share, **handing)
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
        handoff = handoff_of(request.headers, self.engine.kv_address)
        if handoff is not None and count != 1:
            raise ApiError(400, f"a hand-over is of one prompt with n=1, and this request makes {count} sequences; "
                                f"send each prompt and choice alone", param="n" if sampling.n > 1 else "prompt")
        self.admit(count)
        try:
            generations = await self.submit(items, sampling, tools, grammar_field, handoff)
        except BaseException:
            self.admitted -= count
            raise
        if handoff is not None and handoff.send_to is not None:
            handed = await self.hand_over(generations, endpoint, count, handoff.key, grammar_field)
            if handed is not None:
                return handed
        ident, created = new_id("chatcmpl" if chat else "cmpl"), now()
        if stream:
            # Without a tokenizer every token's text is empty: its id is what the client reads, a chunk per token.
            ids = token_ids or self.tokens.tokenizer is None
            body = sse(self, request, endpoint, generations, ident, created, chat, include_usage, count,
                       sampling.logprobs is not None, tools, echoes, grammar_field, ids and not scoring, scoring)
            return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collecting = asyncio.ensure_future(collect(generations, self.metrics))
        watch = asyncio.ensure_future(gone(request))
        try:
            await asyncio.wait({collecting, watch}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this task was cancelled (the server is stopping at once)
            watch.cancel()
            collecting.cancel()
            self.release(generations, endpoint, count)
            raise
        watch.cancel()
        if not collecting.done() or collecting.cancelled():
            collecting.cancel()
            self.release(generations, endpoint, count)
            log(f"POST {endpoint}: the client went away before its answer; its generation(s) were cancelled")
            # Nobody reads it: the code nginx logs for a client that closed the request.
            return Response(status_code=499)
        error = collecting.exception()
        self.release(generations, endpoint, count)
        if error is not None:
            raise self.engine_error(error, grammar_field) from None
        self.metrics.request(endpoint, 200)
        answer = whole(self.name, self.tokens, generations, ident, created, chat, sampling.logprobs is not None, tools,
                       echoes, scoring)
        if token_ids:
            for shown, g in zip(answer["choices"], generations, strict=True):
                shown["token_ids"] = list(g.completion.token_ids) if g.completion is not None and not scoring else []
        return JSONResponse(answer)

    async def hand_over(self, generations: Sequence[Generation], endpoint: str, count: int, key: str,
                        grammar_field: str) -> Response | None:
        """A request a router hands over once its first token is chosen: the hand-over's answer, once its keys and
        values are at the decode instance; None when it ended at its first token (its ordinary answer follows)."""
        [generation] = generations
        try:
            completion = await asyncio.to_thread(generation.submission.result)
        except BaseException as exc:
            self.release(generations, endpoint, count)
            raise self.engine_error(exc, grammar_field) from None
        if completion.finish_reason != "handoff":
            return None
        generation.completion = completion
        self.release(generations, endpoint, count)
        self.metrics.request(endpoint, 200)
        return JSONResponse(handed_answer(key, completion), headers={HANDED: key})

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



async def gone(request: Request) -> None:
    """Returns once the client has closed the connection (a request without a stream has no other way to see it)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
