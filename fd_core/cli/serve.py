"""`fd serve`: a model behind an OpenAI-compatible HTTP API (the serve extra)."""

from __future__ import annotations

import argparse
import os
from typing import Any, Mapping

from fd_core.cli.common import int_at_least, non_negative, positive, require_paddle, seconds
from fd_core.cli.options import (
    cache_options,
    canary_option,
    dtype_option,
    graph_option,
    quantization_options,
    resource_options,
    seed_option,
    shared_settings,
)
from fd_core.cli.run import DTYPE_HELP
from fd_core.errors import ConfigError, install_hint


def add_parser(sub: Any, models: Mapping[str, Any]) -> None:
    """The command and its options."""
    from fd_core.config import DEFAULT_GRAMMAR_TIMEOUT_S

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (needs the serve extra)",
                       **models)
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a checkpoint directory with its tokenizer (default: --model's tiny preset, seeded random "
                        "weights, with a small tokenizer built here)")
    p.add_argument("--model", default=None, metavar="ARCH",
                   help="architecture name or alias (default: the checkpoint's, else ernie4_5)")
    p.add_argument("--name", default=None, metavar="NAME",
                   help="the model id clients send and GET /v1/models lists "
                        "(default: the checkpoint directory's name, or ARCH-tiny)")
    p.add_argument("--tp", type=positive, default=1, metavar="N", help="tensor-parallel ranks (default: 1)")
    p.add_argument("--host", default="127.0.0.1", metavar="HOST",
                   help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int_at_least(0), default=8000, metavar="PORT",
                   help="port to listen on; 0 picks a free one (default: 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="refuse /v1 requests without the header 'Authorization: Bearer KEY' "
                        "(default: $FD_API_KEY, else no key)")
    p.add_argument("--max-queue", type=positive, default=64, metavar="N",
                   help="most requests admitted at once (waiting or running); more get 503 with Retry-After "
                        "(default: 64)")
    p.add_argument("--shutdown-timeout", type=seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, how long admitted requests may run on before they are cancelled "
                        "(default: 30)")
    p.add_argument("--image-root", action="append", default=None, metavar="DIR",
                   help="a directory whose files chat requests may name as pictures "
                        "(repeatable; default: none, data URLs only)")
    p.add_argument("--max-request-bytes", type=positive, default=16 << 20, metavar="N",
                   help="largest request body taken; a larger one gets 413 before it is parsed "
                        "(default: 16777216, 16 MiB)")
    p.add_argument("--max-images", type=non_negative, default=16, metavar="N",
                   help="most pictures one chat request may hold; more get 400 before any is read (default: 16)")
    p.add_argument("--max-pixels", type=positive, default=64 * 1024 * 1024, metavar="N",
                   help="most pixels one chat request's pictures may hold together, counted from their headers "
                        "before each is decoded; more get 400 (default: 67108864)")
    p.add_argument("--header-timeout", type=seconds, default=10.0, metavar="SECONDS",
                   help="how long a connection may take to send a request's headers before it gets 408 and is "
                        "closed (default: 10)")
    p.add_argument("--body-timeout", type=seconds, default=60.0, metavar="SECONDS",
                   help="how long a request's body may take to arrive after its headers before it gets 408 "
                        "(default: 60)")
    p.add_argument("--max-connections", type=positive, default=256, metavar="N",
                   help="most connections held open at once; one more gets 503 and is closed (default: 256)")
    p.add_argument("--grammar-timeout", type=seconds, default=DEFAULT_GRAMMAR_TIMEOUT_S, metavar="SECONDS",
                   help="how long a request's response_format, guided_regex or tool choice may take to compile for "
                        "the model's tokens (off the event loop); longer gets 400 "
                        f"(default: {DEFAULT_GRAMMAR_TIMEOUT_S:g})")
    dtype_option(p, DTYPE_HELP)
    quantization_options(p)
    graph_option(p)
    seed_option(p, "seeds the tiny preset's random weights (default: 0)")
    p.add_argument("--rank-timeout", type=seconds, default=30.0, metavar="SECONDS",
                   help="how long to wait for the other ranks once one has failed (default: 30)")
    p.add_argument("--stall-timeout", type=seconds, default=60.0, metavar="SECONDS",
                   help="how long a rank may go without progress before the server stops (default: 60)")
    canary_option(p)
    resource_options(p)
    cache_options(p)
    d = p.add_argument_group("prefill and decode on separate instances (docs/disaggregation.md)")
    d.add_argument("--role", choices=("both", "prefill", "decode", "router"), default="both",
                   help="both: prefill and decode here; prefill or decode: one of them for a router (a KV transport "
                        "needed); router: no model, a front over --prefill and --decode instances (default: both)")
    d.add_argument("--kv-transport", default=None, metavar="NAME",
                   help="the KV transport prompts' keys and values move through (`fd plugins` lists them; default: "
                        "shm for --role prefill and decode, else none)")
    d.add_argument("--kv-listen", default=None, metavar="ADDRESS",
                   help="this instance's transfer address, in its transport's form (default: a fresh name)")
    d.add_argument("--kv-timeout", type=seconds, default=30.0, metavar="SECONDS",
                   help="how long a handed-over request's keys and values may take to arrive (default: 30)")
    d.add_argument("--prefill", action="append", default=None, metavar="URL",
                   help="a prefill instance's base URL, for --role router (repeatable; default: none)")
    d.add_argument("--decode", action="append", default=None, metavar="URL",
                   help="a decode instance's base URL, for --role router (repeatable; default: none)")
    d.add_argument("--router-timeout", type=seconds, default=600.0, metavar="SECONDS",
                   help="how long the router waits for an instance's answer, or between two pieces of a stream "
                        "(default: 600)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib.util

    needed = ("fastapi", "uvicorn", "prometheus_client", "httpx")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"fd serve needs the serve extra ({' and '.join(missing)} not installed): "
                          f"{install_hint('serve')}")
    if args.role == "router":
        from fd_core.serve.router import serve_router

        return serve_router(args.prefill or [], args.decode or [], args.host, args.port, args.router_timeout)
    if args.prefill or args.decode:
        raise ConfigError("--prefill and --decode name a router's instances: pass them with --role router")
    transport = args.kv_transport or ("shm" if args.role in ("prefill", "decode") else None)
    require_paddle()
    from pathlib import Path

    from fd_core.host.paddle_logs import quiet_paddle_logs
    from fd_core.serve.server import ServeOptions, serve

    quiet_paddle_logs()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the ranks start after this process has tokenized
    options = ServeOptions(host=args.host, port=args.port, api_key=args.api_key or os.environ.get("FD_API_KEY") or None,
                           max_queue=args.max_queue, shutdown_timeout=args.shutdown_timeout,
                           image_roots=tuple(Path(p) for p in args.image_root or ()),
                           max_request_bytes=args.max_request_bytes, max_images=args.max_images,
                           header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                           max_connections=args.max_connections, max_pixels=args.max_pixels)
    return serve(options, checkpoint=args.checkpoint, model=args.model, name=args.name, tp=args.tp, dtype=args.dtype,
                 graph=args.graph, seed=args.seed, rank_timeout=args.rank_timeout, stall_timeout=args.stall_timeout,
                 grammar_timeout=args.grammar_timeout, kernel_canary=args.kernel_canary, kv_transport=transport,
                 kv_listen=args.kv_listen, kv_timeout=args.kv_timeout, **shared_settings(args))
