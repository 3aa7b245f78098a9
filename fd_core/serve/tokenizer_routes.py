"""The tokenizer's endpoints, as vLLM serves them and lm-evaluation-harness's remote tokenizer reads them (its
`tokenizer_backend="remote"`): POST /tokenize, POST /detokenize and GET /tokenizer_info, beside the OpenAI API and
behind the same key. A checkpoint without a tokenizer answers each with a 404 saying so."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from fd_core.serve.bodies import parsed
from fd_core.serve.metrics import Metrics
from fd_core.serve.protocol import STRICT, ApiError, TokenText

if TYPE_CHECKING:
    from fd_core.runtime.text.tokenizer import Tokenizer

# Paths these routes answer (the key and the loading state are checked for them as for /v1).
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
# The longest text /tokenize takes: the tokenizers library holds the GIL while it encodes (about 2 s a megabyte on a
# busy 2-core machine), which every other request would wait for.
MAX_TOKENIZE_CHARS = 1 << 20
# The most ids /detokenize takes.
MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeRequest(BaseModel):
    """POST /tokenize: a text's token ids (vLLM's request; chat `messages` are not taken)."""

    model_config = STRICT

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids' text."""

    model_config = STRICT

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_IDS)


class TokenizerHost(Protocol):
    """What the routes need of the server: its model's name and tokenizer, its chat template, its metrics."""

    name: str
    tokens: TokenText
    metrics: Metrics

    @property
    def chat_template(self) -> str | None: ...

    def check_model(self, model: str | None) -> None: ...


def add_tokenizer_routes(app: FastAPI, server: TokenizerHost) -> None:
    """The three routes on `app`, answering from `server`'s checkpoint tokenizer."""

    def tokenizer() -> "Tokenizer":
        found = server.tokens.tokenizer
        if found is None:
            raise ApiError(404, f"the model {server.name!r} has no tokenizer (its checkpoint holds none): send and "
                                f"read token ids (\"prompt\": [1, 2, 3] to /v1/completions) instead",
                           kind="not_found_error", code="no_tokenizer")
        return found

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await parsed(request, TokenizeRequest)
        server.check_model(body.model)
        found = tokenizer()
        if len(body.prompt) > MAX_TOKENIZE_CHARS:
            raise ApiError(400, f"prompt has {len(body.prompt)} characters, more than the {MAX_TOKENIZE_CHARS} "
                                f"/tokenize takes; send it in parts", param="prompt")
        # Off the event loop, as a completion's prompt is tokenized.
        ids = await asyncio.to_thread(found.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        server.metrics.request("/tokenize", 200)
        return JSONResponse({"count": len(ids), "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await parsed(request, DetokenizeRequest)
        server.check_model(body.model)
        found = tokenizer()
        # Ids the tokenizer has no text for (outside its vocabulary) are refused, not decoded as nothing.
        unknown = next((i for i, t in enumerate(body.tokens) if t < 0 or found.token_bytes(t) is None), None)
        if unknown is not None:
            raise ApiError(400, f"tokens[{unknown}] = {body.tokens[unknown]} is not a token of the model's tokenizer",
                           param="tokens")
        text = await asyncio.to_thread(found.decode, body.tokens, skip_special_tokens=False)
        server.metrics.request("/detokenize", 200)
        return JSONResponse({"prompt": text})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        found = tokenizer()
        roles = found.special_tokens()
        info: dict[str, Any] = {
            "tokenizer_class": type(found).__name__,
            **{role: roles.get(role) for role in ("bos_token", "eos_token", "pad_token", "unk_token")},
            "chat_template": server.chat_template,
        }
        server.metrics.request("/tokenizer_info", 200)
        return JSONResponse(info)
