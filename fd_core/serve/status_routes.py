"""The routes that say what is served and how it goes: GET /health (for probes and routers, open without the key;
with the instance's KV transfer address when it has one), GET /metrics
(for scrapers, likewise) and the OpenAI API's GET /v1/models."""

from __future__ import annotations

from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fd_core.serve.metrics import CONTENT_TYPE, Metrics
from fd_core.serve.submissions import RETRY_AFTER_LOADING_S, Submitter


class StatusHost(Protocol):
    """What the routes need of the server: the model's name, the engine, its state, its metrics."""

    name: str
    engine: Submitter
    loading: bool
    draining: str | None
    failure: BaseException | None
    metrics: Metrics


def add_status_routes(app: FastAPI, server: StatusHost) -> None:
    """The three routes on `app`, answering from `server`'s state."""

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if server.failure is not None:
            return JSONResponse({"status": "failed", "error": str(server.failure)}, status_code=503)
        if server.draining is not None:
            return JSONResponse({"status": "draining", "reason": server.draining}, status_code=503)
        if server.loading:
            return JSONResponse(
                {"status": "loading", "model": server.name,
                 "reason": "the model is loading; /health answers 200 once requests are served"},
                status_code=503, headers={"Retry-After": str(RETRY_AFTER_LOADING_S)},
            )
        answer = {"status": "ok", "model": server.name, "queued": server.engine.queued()}
        if server.engine.kv_address is not None:  # where a router has prefill instances send this one's requests
            answer["kv_address"] = server.engine.kv_address
        return JSONResponse(answer)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(server.metrics.text(), media_type=CONTENT_TYPE)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> Response:
        server.metrics.request("/v1/models", 200)
        return JSONResponse(
            {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0, "owned_by": "fd"}]}
        )
