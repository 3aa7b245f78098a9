"""Errors in the OpenAI format: the application's exception handlers, FastAPI's validation errors as a 400 naming the
field, and the engine's grammar errors named by the request field the grammar came from."""

from __future__ import annotations

import json
import re
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from fd_core.serve.protocol import ApiError

GRAMMAR_PREFIX = "grammar: "  # how the engine's grammar errors begin: the field SamplingParams.grammar
FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# pydantic's type errors: what the field takes, in JSON's words.
EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
            "string_type": "a string", "list_type": "a list", "dict_type": "an object"}


class ErrorHost(Protocol):
    """What the handlers need of the server: its answer to an error (logged and counted)."""

    def answer(self, request: Request, error: ApiError) -> Response: ...


def add_error_handlers(app: FastAPI, server: ErrorHost) -> None:
    """Every error `app` meets answered by `server` in the OpenAI format."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return server.answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return server.answer(request, validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # Starlette's own headers kept: a 405 says which methods the route takes (Allow).
        return server.answer(
            request, ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind,
                              headers=dict(exc.headers or {}))
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        # No traceback reaches a client; the log keeps the one line a maintainer needs to start from.
        return server.answer(
            request,
            ApiError(500, f"internal error ({type(exc).__name__}: {exc})".replace("\n", " "), kind="server_error"),
        )


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
