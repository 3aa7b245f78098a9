"""`fd serve` put together: the HTTP server started on its socket, the model loaded meanwhile through the Python
API's LLM (the plan, ranks and engine of `fd run`; the tiny preset given a tokenizer when no checkpoint is named),
then served until a signal."""

from __future__ import annotations

import ipaddress
import shutil
import signal
import socket
import tempfile
from pathlib import Path
from typing import Any

from fd_core.serve.app import EXIT_INTERRUPTED, EXIT_TERMINATED, Http, ServeOptions, Server, bind, log


def serve(
    options: ServeOptions, *, checkpoint: str | None, model: str | None, name: str | None, tp: int, **llm_options: Any
) -> int:
    """Listen, load, serve; the exit code (143 after SIGTERM, 130 after SIGINT). Nothing is left running when it
    returns."""
    from fd_core.runtime.llm import LLM
    from fd_core.runtime.ranks.spawn import Terminated, raise_terminated

    sock = bind(options.host, options.port)  # a taken port fails before the model loads
    if options.api_key is None and not loopback(sock):
        log(f"warning: listening on {options.host} without an API key: anyone who can reach port "
            f"{sock.getsockname()[1]} can use the server; set one with --api-key KEY (or $FD_API_KEY)")
    scratch: Path | None = None
    llm: LLM | None = None
    http: Http | None = None
    arch = model or "ernie4_5"
    served = name or (f"{arch}-tiny" if checkpoint is None else Path(checkpoint).resolve().name)
    # Until the model is handed to the HTTP server: SIGTERM stops the ranks started so far and removes the tiny
    # preset's directory, instead of ending this process under them (SIGINT does it through KeyboardInterrupt).
    # The model loads on this, the main thread, for that reason: the signals interrupt it here. The HTTP server runs
    # on a thread of its own meanwhile, answering /health 503 "loading".
    # Paddle sets its own SIGTERM handler when it is imported: imported first, so that this one is the one in force.
    import paddle  # noqa: F401

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        http = Http(Server(None, name=served, max_queue=options.max_queue, api_key=options.api_key,
                           image_roots=options.image_roots, max_request_bytes=options.max_request_bytes,
                           max_images=options.max_images, body_timeout=options.body_timeout,
                           max_pixels=options.max_pixels), sock, options)
        url = http.start()
        log(f"listening on {url}; GET /health answers 503 until the model is loaded")
        if checkpoint is None:
            from fd_core.serve.tiny import write_tiny_checkpoint

            scratch = Path(tempfile.mkdtemp(prefix="fd-serve-tiny-"))
            checkpoint = str(write_tiny_checkpoint(scratch / arch, arch, seed=int(llm_options.get("seed", 0))))
            log(
                f"no --checkpoint: serving the {arch} tiny preset (seeded random weights, a small tokenizer) "
                f"from {checkpoint}"
            )
        log(f"loading {checkpoint} on {tp} rank(s)")
        llm = LLM(checkpoint, model=model, tp=tp, **llm_options)
        http.ready(llm)
        log(f"serving {served!r} ({llm.model}, tp={tp}, {llm.platform}) at {url}")
        # Once, on its own line, when requests are served: what a script waits for (docs/serving.md).
        log(f"ready at {url}")
        return http.wait()
    except Terminated:
        log("terminated while loading; every rank was stopped")
        return EXIT_TERMINATED
    except KeyboardInterrupt:  # SIGINT (Ctrl-C) while loading
        log("interrupted while loading; every rank was stopped")
        return EXIT_INTERRUPTED
    finally:
        try:
            if http is not None:
                http.close()  # first: no request may reach a model being closed
        finally:
            # None: a handler installed from C, which Python cannot reinstate; the default is the nearest.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            sock.close()
            try:
                if llm is not None:
                    llm.close()  # stops the ranks
            finally:
                if scratch is not None:  # even when closing failed (ranks already gone)
                    shutil.rmtree(scratch, ignore_errors=True)


def loopback(sock: socket.socket) -> bool:
    """Whether only this machine can connect to the bound socket (127.0.0.0/8, ::1)."""
    try:
        address = ipaddress.ip_address(str(sock.getsockname()[0]).split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))
