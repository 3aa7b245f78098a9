"""The HTTP server's lifecycle under uvicorn: the socket bound before the model loads, uvicorn on a thread of its
own answering while it loads, the signals that drain it, a failed rank ending it, and the exit codes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

from fd_core.errors import ConfigError, FdError, RankError
from fd_core.serve.connections import KEEP_ALIVE_S, ConnectionLimits, protocol_class
from fd_core.serve.log import log
from fd_core.serve.options import ServeOptions
from fd_core.serve.submissions import Generation, Submitter

if TYPE_CHECKING:
    from fastapi import FastAPI


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


class HttpHost(Protocol):
    """What Http needs of the server: its application and engine, its requests, and its ways to fail, drain, stop."""

    app: "FastAPI"
    engine: Submitter
    failure: BaseException | None
    admitted: int
    active: set[Generation]
    stop: Callable[[], None]

    def attach(self, engine: Submitter) -> None: ...

    def fail(self, exc: BaseException) -> None: ...

    def withdraw(self, generations: Sequence[Generation], reason: str | None = None) -> None: ...

    async def drain(self, reason: str, timeout: float) -> None: ...


class Http:
    """uvicorn serving a Server on its bound socket, on a thread of its own, from before the model loads (the API
    answering 503 "loading" meanwhile) until a signal drains it or a rank fails.

    The main thread keeps the signals: while the model loads, SIGTERM or SIGINT must interrupt the code that starts
    the ranks, which runs there (its Terminated or KeyboardInterrupt stops them); once ready() has handed the model
    over, they are forwarded to the event loop, which drains."""

    def __init__(self, server: HttpHost, sock: socket.socket, options: ServeOptions) -> None:
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
