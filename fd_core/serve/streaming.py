"""A request's generations followed as the engine produces them (their pieces carried onto the event loop), and its
answer streamed as server-sent events in OpenAI's chunk format."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, Sequence

from fastapi import Request

from fd_core.runtime.text.tools import ToolStream
from fd_core.serve.answers import choice_logprobs, echo
from fd_core.serve.log import log
from fd_core.serve.metrics import Metrics
from fd_core.serve.protocol import FINISH_REASONS, ApiError, TextOffsets, TokenText, usage
from fd_core.serve.submissions import Generation

if TYPE_CHECKING:
    from fd_core.runtime.engine.scheduler import Piece
    from fd_core.runtime.text.tools import Tools


class StreamHost(Protocol):
    """What a stream needs of the server: the model's name and tokenizer, its metrics, release and engine_error."""

    name: str
    tokens: TokenText
    metrics: Metrics

    def release(self, generations: Sequence[Generation], endpoint: str, count: int) -> None: ...

    def engine_error(self, exc: BaseException, grammar_field: str = "response_format") -> ApiError: ...


async def events(
    generations: Sequence[Generation], metrics: Metrics, every_token: bool = False,
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
            metrics.finished(
                s.prompt_tokens, len(value.token_ids), generation.submitted, s.first_token_at, time.time()
            )
            yield generation, None
        elif generation.cancelled is not None:
            raise ApiError(503, generation.cancelled, kind="server_error", code="unavailable")
        else:
            raise value


async def collect(generations: Sequence[Generation], metrics: Metrics) -> None:
    """Every generation run to its end (their completions kept on them)."""
    async for _ in events(generations, metrics):
        pass


async def sse(server: StreamHost, request: Request, endpoint: str, generations: Sequence[Generation], ident: str,
              created: int, chat: bool, include_usage: bool, count: int, logprobs: bool = False,
              tools: "Tools | None" = None, echoes: Sequence[str] | None = None,
              grammar_field: str = "response_format", token_ids: bool = False,
              scoring: bool = False) -> AsyncIterator[str]:
    """Server-sent events in the OpenAI chunk format, ending with `data: [DONE]`; a client that goes away cancels
    its generations. Asked for, each chunk carries the logprobs of the tokens it brings. With tools, the text from
    a <tool_call> on is held back and sent at the end as the choice's tool_calls. Echoed, a completion choice's
    first chunk is its prompt (with its tokens' logprobs), once they are scored. With `token_ids` (or logprobs) a
    chunk comes for every token, even one that completes no character, carrying its id in `token_ids`."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    offsets = {g.index: TextOffsets(server.tokens) for g in generations}  # each choice's text offsets go on
    held = {g.index: ToolStream(tools) for g in generations} if tools is not None else {}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        data = {"id": ident, "object": kind, "created": created, "model": server.name, "choices": choices, **extra}
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def choice(index: int, text: str | None, reason: str | None, first: bool = False,
               piece: "Piece | None" = None) -> dict[str, Any]:
        shown = (
            choice_logprobs(server.tokens, chat, piece.logprobs, offsets[index])
            if logprobs and piece is not None else None
        )
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
            async for generation, piece in events(generations, server.metrics, token_ids or logprobs):
                if echoes is not None and generation.index not in echoed:
                    echoed.add(generation.index)
                    text, shown = echo(server.tokens, generation, echoes, logprobs, offsets[generation.index])
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
            error = server.engine_error(exc, grammar_field)
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
        server.release(generations, endpoint, count)
        if all(g.completion is not None for g in generations) or status != 200:
            server.metrics.request(endpoint, status)
