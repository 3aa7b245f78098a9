"""`fd save-random`: a seeded random checkpoint in the published layout, with a tokenizer if asked."""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from fd_core.cli.common import require_paddle, stdout
from fd_core.cli.options import seed_option


def add_parser(sub: Any, models: Mapping[str, Any]) -> None:
    """The command and its options."""
    p = sub.add_parser("save-random",
                       help="write a seeded random checkpoint in the published layout (safetensors + config.json)",
                       **models)
    p.add_argument("--model", default="ernie4_5", metavar="ARCH",
                   help="architecture whose tiny preset to use (default: ernie4_5)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a config.json to use instead of the preset, e.g. a published model's (default: none)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype the tensors are stored in (default: float32)")
    seed_option(p, "seed of the random weights (default: 0)")
    p.add_argument("--tokenizer", action="store_true",
                   help="also write a small byte-level BPE tokenizer with a chat template (with picture tokens for a "
                        "model that takes pictures), so that text prompts, --chat, pictures, LLM and fd serve work "
                        "offline (the text is noise)")
    p.add_argument("directory", metavar="DIR", help="where to write it: a new or empty directory")
    p.set_defaults(func=cmd_save_random)


def cmd_save_random(args: argparse.Namespace) -> int:
    from fd_core.host.paddle_logs import quiet_paddle_logs
    from fd_core.runtime.save_random import save_random_checkpoint

    require_paddle()

    quiet_paddle_logs()
    if args.tokenizer:
        from fd_core.serve.tiny import write_tiny_checkpoint

        path = write_tiny_checkpoint(args.directory, args.model, seed=args.seed, config_path=args.config,
                                     dtype=args.dtype)
    else:
        path = save_random_checkpoint(args.model, args.directory, seed=args.seed, config_path=args.config,
                                      dtype=args.dtype)
    print(f"wrote {path}{' (with a tokenizer and a chat template)' if args.tokenizer else ''}", file=stdout())
    return 0
