"""Request bodies parsed and checked off the event loop: a large body (a million small objects) takes seconds to parse
and check, which on the event loop every other client would wait for."""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

BodyT = TypeVar("BodyT", bound=BaseModel)
FEW_ERRORS = 16  # a body's validation errors listed whole (first_errors)


async def parsed(request: Request, model: type[BodyT]) -> BodyT:
    """The request's JSON body as `model`, parsed and checked in a worker thread: a large body (a million small
    objects) takes seconds to parse and check, which on the event loop every other client would wait for. Invalid, the
    first error alone is raised (as FastAPI's RequestValidationError), counted off the loop too."""
    raw = await request.body()

    def parse() -> BodyT:
        try:
            data = json.loads(raw)
        except ValueError:  # not JSON, or not UTF-8
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "invalid JSON",
                                           "input": ""}]) from None
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            first = first_errors(model, data, exc)
            raise RequestValidationError([{**e, "loc": ("body", *e.get("loc", ()))} for e in first]) from None

    return await asyncio.to_thread(parse)


def first_errors(model: type[BaseModel], data: Any, exc: ValidationError) -> list[Any]:
    """The first of a validation's errors: listing a million of them (one per item of a long list) takes seconds,
    so past a few the body's lists are cut short and checked again, which finds the first for what it costs to list a
    few; failing that, the count alone."""
    if exc.error_count() <= FEW_ERRORS:
        return exc.errors(include_url=False)[:1]
    if isinstance(data, dict):
        short = {k: v[:FEW_ERRORS] if isinstance(v, list) else v for k, v in data.items()}
        try:
            model.model_validate(short)
        except ValidationError as again:
            if again.error_count() <= FEW_ERRORS:
                return again.errors(include_url=False)[:1]
    return [{"type": "value_error", "loc": (), "msg": f"{exc.error_count()} values are invalid; check each field "
             f"against the API reference", "input": None}]
