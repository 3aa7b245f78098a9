"""The OpenAI API's generating routes: POST /v1/completions and POST /v1/chat/completions, their bodies read into the
engine's prompts and sampling and answered through the server."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response

from fd_core.serve.bodies import parsed
from fd_core.serve.protocol import ApiError, ChatRequest, CompletionRequest, TokenText, message_parts
from fd_core.serve.submissions import Submitter

if TYPE_CHECKING:
    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.text.tools import Tools


class OpenAIHost(Protocol):
    """What the routes need of the server: the engine, the model's tokenizer, its checks of a request, its answer."""

    engine: Submitter
    tokens: TokenText

    def check_model(self, model: str | None) -> None: ...

    def check_pictures(self, count: int) -> None: ...

    def pictures(self, urls: Sequence[str]) -> tuple[Any, ...]: ...

    async def respond(self, request: Request, endpoint: str, items: Sequence[tuple[Any, bool, tuple[Any, ...]]],
                      sampling: "SamplingParams", stream: bool, include_usage: bool, chat: bool,
                      tools: "Tools | None" = None, echoes: Sequence[str] | None = None,
                      grammar_field: str = "response_format", token_ids: bool = False,
                      scoring: bool = False) -> Response: ...


def add_openai_routes(app: FastAPI, server: OpenAIHost) -> None:
    """The two routes on `app`, generating through `server`'s engine."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parsed(request, CompletionRequest)
        server.check_model(body.model)
        body.refuse_unsupported()
        prompts = body.prompts()
        # Off the event loop: a response_format or guided_regex compiles, which may take a while (and has a budget).
        sampling = await asyncio.to_thread(body.sampling, body.limit())
        echoes = [prompt_text(server.tokens, p) for p in prompts] if body.echo else None
        return await server.respond(request, "/v1/completions", [(p, False, ()) for p in prompts], sampling,
                                    body.stream, body.include_usage, chat=False, echoes=echoes,
                                    grammar_field=body.grammar_field(), token_ids=body.return_token_ids,
                                    scoring=body.scoring_only)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await parsed(request, ChatRequest)
        server.check_model(body.model)
        body.refuse_unsupported()

        def settings() -> "tuple[Tools | None, SamplingParams]":
            # Off the event loop: the tools' schemas and a response_format compile (each within its budget).
            tools = body.tool_set(server.engine.chat_template)
            return tools, body.sampling(body.limit(), tools)

        tools, sampling = await asyncio.to_thread(settings)
        turns, urls = conversation(body)
        server.check_pictures(len(urls))
        # In a worker thread, as the submission is: a picture takes a tenth of a second or more to decode, which
        # on the event loop every other request would wait for.
        images = await asyncio.to_thread(server.pictures, urls) if urls else ()
        return await server.respond(request, "/v1/chat/completions", [(turns, False, images)], sampling,
                                    body.stream, body.include_usage, chat=True, tools=tools,
                                    grammar_field=body.grammar_field(tools), token_ids=body.return_token_ids)


def prompt_text(tokens: TokenText, prompt: str | list[int]) -> str:
    """A completion prompt as `echo` returns it: the text sent, or the text of the ids sent."""
    if isinstance(prompt, str):
        return prompt
    tokenizer = tokens.tokenizer
    try:
        return "" if tokenizer is None else tokenizer.decode(prompt)
    except Exception:  # noqa: BLE001 - ids outside the vocabulary: the engine refuses the request, naming them
        return ""


def conversation(body: ChatRequest) -> tuple[list[dict[str, Any]], list[str]]:
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
