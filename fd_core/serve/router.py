"""`fd serve --role router`: one OpenAI-compatible front over prefill instances and decode instances
(docs/disaggregation.md). It holds no model: each request goes as the client sent it to a prefill instance, which
prefills it, chooses its first token and sends its keys and values to a decode instance; then to that decode
instance, whose answer (streamed or whole) goes back to the client unchanged. The protocol between them is
handoffs.py's.

An instance is chosen by load: the fewest requests this router has in flight there. One that does not answer is left
out for DOWN_S seconds (its requests get a 503 naming it and the stage), and the router goes on with the others."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fd_core.serve.handoffs import HANDED, RESUME, SEND_TO
from fd_core.serve.log import log
from fd_core.serve.protocol import ApiError, error_body

# Seconds an instance that did not answer is left out of the choice.
DOWN_S = 5.0
# Seconds to open a connection to an instance.
CONNECT_S = 5.0
# The headers a client's request keeps on its way to an instance.
FORWARDED = ("authorization", "content-type", "accept")


@dataclass
class Instance:
    """One instance behind the router: its URL, its role, what the router has in flight there, and until when it is
    left out."""

    url: str
    role: str
    in_flight: int = 0
    down_until: float = 0.0
    kv_address: str | None = None

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def down(self, why: str) -> None:
        self.down_until = time.monotonic() + DOWN_S
        self.kv_address = None
        log(f"router: {self.role} instance {self.url} left out for {DOWN_S:g} s: {why}")


@dataclass
class Router:
    """The routes and the instances they choose among."""

    prefill: list[Instance]
    decode: list[Instance]
    # Seconds an instance may take to answer (a prefill), or between two pieces of a streamed answer.
    timeout: float = 600.0
    counts: dict[str, int] = field(default_factory=dict)  # outcomes by stage, for /metrics
    app: FastAPI = field(init=False)

    @classmethod
    def of(cls, prefill: Sequence[str], decode: Sequence[str], timeout: float = 600.0) -> "Router":
        return cls([Instance(u.rstrip("/"), "prefill") for u in prefill],
                   [Instance(u.rstrip("/"), "decode") for u in decode], timeout)

    def __post_init__(self) -> None:
        import httpx

        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=CONNECT_S))
        self.app = self.build()

    # -- choosing ----------------------------------------------------------------------------
    def choose(self, instances: Sequence[Instance], tried: Sequence[Instance] = ()) -> Instance:
        """The up instance with the fewest requests in flight (one not tried yet)."""
        ready = [i for i in instances if i.up and i not in tried]
        if not ready:
            role = instances[0].role if instances else "?"
            raise ApiError(503, f"no {role} instance answers ({', '.join(i.url for i in instances)}); retry shortly",
                           kind="server_error", code="unavailable", headers={"Retry-After": str(int(DOWN_S))})
        return min(ready, key=lambda i: i.in_flight)

    async def kv_address(self, instance: Instance) -> str:
        """The decode instance's transfer address, from its /health (read once while it stays up)."""
        import httpx

        if instance.kv_address is None:
            try:
                health = await self.client.get(f"{instance.url}/health")
                address = health.json().get("kv_address") if health.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as exc:
                instance.down(f"GET /health failed ({type(exc).__name__}: {exc})")
                raise _unreachable(instance, exc) from None
            if address is None:
                instance.down(f"GET /health answered {health.status_code} without a kv_address")
                raise ApiError(503, f"the decode instance {instance.url} is not ready or has no KV transport "
                                    f"(start it with --role decode); retry shortly", kind="server_error",
                               code="unavailable", headers={"Retry-After": str(int(DOWN_S))})
            instance.kv_address = str(address)
        return instance.kv_address

    # -- the application -----------------------------------------------------------------------
    def build(self) -> FastAPI:
        app = FastAPI(title="fd serve (router)", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, error: ApiError) -> Response:
            log(f"router: {error.status} {request.method} {request.url.path}: {error.message}")
            return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.route(request, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self.route(request, "/v1/chat/completions")

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            return await self.forward(request, self.choose(self.decode), "/v1/models")

        @app.get("/health")
        async def health() -> Response:
            up = {role: [i.url for i in instances if i.up]
                  for role, instances in (("prefill", self.prefill), ("decode", self.decode))}
            ok = bool(up["prefill"] and up["decode"])
            return JSONResponse({"status": "ok" if ok else "degraded", "role": "router", **up},
                                status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            lines = ["# HELP fd_router_requests_total Requests the router ended, by stage and outcome.",
                     "# TYPE fd_router_requests_total counter"]
            lines += [f'fd_router_requests_total{{stage="{k.split(":")[0]}",outcome="{k.split(":")[1]}"}} {v}'
                      for k, v in sorted(self.counts.items())]
            lines += ["# HELP fd_router_in_flight Requests in flight at each instance.",
                      "# TYPE fd_router_in_flight gauge"]
            lines += [f'fd_router_in_flight{{role="{i.role}",url="{i.url}"}} {i.in_flight}'
                      for i in [*self.prefill, *self.decode]]
            return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

        return app

    def count(self, stage: str, outcome: str) -> None:
        key = f"{stage}:{outcome}"
        self.counts[key] = self.counts.get(key, 0) + 1

    async def forward(self, request: Request, instance: Instance, path: str) -> Response:
        """A GET passed to an instance, its answer back as it came."""
        import httpx

        try:
            answer = await self.client.get(instance.url + path, headers=_forwarded(request))
        except httpx.HTTPError as exc:
            instance.down(f"GET {path} failed ({type(exc).__name__})")
            raise _unreachable(instance, exc) from None
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type"))

    async def route(self, request: Request, path: str) -> Response:
        """Prefill on one instance, decode on another; the decode instance's answer back to the client."""
        import httpx

        body = await request.body()
        headers = _forwarded(request)
        decode = self.choose(self.decode)
        address = await self.kv_address(decode)
        prefill, tried = self.choose(self.prefill), []
        started = time.monotonic()
        while True:
            trying = prefill
            trying.in_flight += 1
            try:
                handed = await self.client.post(trying.url + path, content=body,
                                                headers={**headers, SEND_TO: address})
                break
            except httpx.HTTPError as exc:
                trying.down(f"POST {path} failed ({type(exc).__name__}: {exc})")
                tried.append(trying)
                if not any(i.up and i not in tried for i in self.prefill):
                    self.count("prefill", "unreachable")
                    raise _unreachable(trying, exc) from None
                prefill = self.choose(self.prefill, tried)
            finally:
                trying.in_flight -= 1
        if handed.status_code >= 500:
            decode.kv_address = None  # read again next time: the decode instance may have restarted elsewhere
        if HANDED not in handed.headers:
            # An error, or a request that ended at its first token: the prefill instance's answer is the answer.
            self.count("prefill", "answered" if handed.status_code == 200 else f"status_{handed.status_code}")
            return Response(handed.content, status_code=handed.status_code,
                            media_type=handed.headers.get("content-type"))
        resume = json.dumps(handed.json()["fd_handoff"])
        log(f"router: {path} prefilled on {prefill.url} in {time.monotonic() - started:.3f} s, decoding on "
            f"{decode.url}")
        return await self.decode_on(decode, path, body, {**headers, RESUME: resume})

    async def decode_on(self, decode: Instance, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """The decode instance's answer, relayed as it comes; a failure midway ends a stream with an error event."""
        import httpx

        decode.in_flight += 1
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", decode.url + path, content=body, headers=headers), stream=True)
        except httpx.HTTPError as exc:
            decode.in_flight -= 1
            decode.down(f"POST {path} failed ({type(exc).__name__}: {exc})")
            self.count("decode", "unreachable")
            raise _unreachable(decode, exc) from None
        media = upstream.headers.get("content-type", "")
        if upstream.status_code != 200 or not media.startswith("text/event-stream"):
            try:
                content = await upstream.aread()
            except httpx.HTTPError as exc:
                decode.down(f"its answer broke off ({type(exc).__name__})")
                self.count("decode", "failed")
                raise ApiError(503, f"the decode instance {decode.url} failed before answering ({type(exc).__name__}:"
                                    f" {exc}); retry", kind="server_error", code="decode_failed") from None
            finally:
                decode.in_flight -= 1
                await upstream.aclose()
            self.count("decode", "answered" if upstream.status_code == 200 else f"status_{upstream.status_code}")
            return Response(content, status_code=upstream.status_code, media_type=media or None)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for piece in upstream.aiter_raw():
                    yield piece
                self.count("decode", "answered")
            except httpx.HTTPError as exc:
                decode.down(f"its stream broke off ({type(exc).__name__})")
                self.count("decode", "failed")
                error = error_body(f"the decode instance {decode.url} failed mid-stream ({type(exc).__name__}); the "
                                   f"answer ends here: retry the request", "server_error", None, "decode_failed")
                yield f"data: {json.dumps(error)}\n\n".encode()
            finally:
                decode.in_flight -= 1
                await upstream.aclose()

        return StreamingResponse(relay(), media_type=media, headers={"Cache-Control": "no-cache"})

    async def close(self) -> None:
        await self.client.aclose()


def _forwarded(request: Request) -> dict[str, str]:
    return {name: value for name in FORWARDED if (value := request.headers.get(name)) is not None}


def _unreachable(instance: Instance, exc: Exception) -> ApiError:
    return ApiError(503, f"the {instance.role} instance {instance.url} does not answer ({type(exc).__name__}: {exc}); "
                         f"the router leaves it out for {DOWN_S:g} s: retry", kind="server_error",
                    code="unavailable", headers={"Retry-After": str(int(DOWN_S))})


def serve_router(prefill: Sequence[str], decode: Sequence[str], host: str, port: int, timeout: float) -> int:
    """Run the router until SIGINT or SIGTERM; the exit code (130 after SIGINT, 143 after SIGTERM, as fd serve's)."""
    import uvicorn

    from fd_core.errors import ConfigError
    from fd_core.serve.lifecycle import EXIT_INTERRUPTED, EXIT_TERMINATED, bind

    if not prefill or not decode:
        raise ConfigError("--role router needs at least one --prefill URL and one --decode URL")

    received: list[int] = []

    class Uvicorn(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # Ours, not uvicorn's (which re-raises the signal at exit): the exit code says which came, as fd serve's.
            def stop(signum: int, frame: Any) -> None:
                received.append(signum)
                self.should_exit = True

            previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    sock = bind(host, port)  # a taken port fails here, in one line
    router = Router.of(prefill, decode, timeout)
    server = Uvicorn(uvicorn.Config(router.app, log_level="warning", access_log=False, lifespan="off"))
    bound_host, bound_port = sock.getsockname()[:2]
    log(f"router: prefill on {', '.join(prefill)}; decode on {', '.join(decode)}")
    log(f"ready at http://{bound_host}:{bound_port}")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if received:
        log("stopped by signal")
        return EXIT_INTERRUPTED if received[0] == signal.SIGINT else EXIT_TERMINATED
    return 0
