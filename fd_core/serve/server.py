"""`fd serve` put together: the model loaded through the Python API's LLM (the plan, ranks and engine of
`fd run`), the tiny preset given a tokenizer when no checkpoint is named, then the HTTP server until a signal."""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from fd_core.serve.app import EXIT_TERMINATED, ServeOptions, Server, bind, log, run


def serve(
    options: ServeOptions, *, checkpoint: str | None, model: str | None, name: str | None, tp: int, **llm_options: Any
) -> int:
    """Load, listen, serve; the exit code (143 after SIGTERM, 130 after SIGINT). Nothing is left running when it
    returns."""
    from fd_core.runtime.llm import LLM
    from fd_core.runtime.ranks.spawn import Terminated, raise_terminated

    sock = bind(options.host, options.port)  # a taken port fails before the model loads
    scratch: Path | None = None
    llm: LLM | None = None
    # Until the HTTP server takes the signals over: SIGTERM while loading stops the ranks started so far and
    # removes the tiny preset's directory, instead of ending this process under them.
    # Paddle sets its own SIGTERM handler when it is imported: imported first, so that this one is the one in force.
    import paddle  # noqa: F401

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        if checkpoint is None:
            from fd_core.serve.tiny import write_tiny_checkpoint

            scratch = Path(tempfile.mkdtemp(prefix="fd-serve-tiny-"))
            arch = model or "ernie4_5"
            checkpoint = str(write_tiny_checkpoint(scratch / arch, arch, seed=int(llm_options.get("seed", 0))))
            served = name or f"{arch}-tiny"
            log(
                f"no --checkpoint: serving the {arch} tiny preset (seeded random weights, a small tokenizer) "
                f"from {checkpoint}"
            )
        else:
            served = name or Path(checkpoint).resolve().name
        log(f"loading {checkpoint} on {tp} rank(s)")
        llm = LLM(checkpoint, model=model, tp=tp, **llm_options)
        server = Server(llm, name=served, max_queue=options.max_queue,
                        api_key=options.api_key, image_roots=options.image_roots)

        def announce(address: str) -> None:
            # The address on stderr: with --port 0 it is how a caller learns the port.
            print(f"fd serve: serving {served!r} ({llm.model if llm else '?'}, tp={tp}, "
                  f"{llm.platform if llm else '?'}) at {address}",
                  file=sys.stderr, flush=True)

        signal.signal(signal.SIGTERM, previous)
        return run(server, sock, options, announce)
    except Terminated:
        log("terminated while loading; every rank was stopped")
        return EXIT_TERMINATED
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        try:
            if llm is not None:
                llm.close()  # stops the ranks
        finally:
            if scratch is not None:  # even when closing failed (ranks already gone)
                shutil.rmtree(scratch, ignore_errors=True)

