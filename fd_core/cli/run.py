"""`fd run`: load a model on its ranks, decide and capture graphs, generate, and report."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping

from fd_core.cli.common import ENTERED_AT, fit, non_negative, positive, require_paddle, seconds, stdout
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
from fd_core.errors import ConfigError

# Also fd serve's.
DTYPE_HELP = "compute dtype (default: the platform's preferred one, the first it lists; see fd plugins)"


def add_parser(sub: Any, models: Mapping[str, Any]) -> None:
    """The command and its options."""
    p = sub.add_parser("run", help="run a model: load, clean, decide, capture, generate", **models)
    p.add_argument("--model", default=None, metavar="ARCH",
                   help="architecture name or alias (default: the checkpoint's, else ernie4_5)")
    p.add_argument("--tp", type=positive, default=None, metavar="N",
                   help="tensor-parallel ranks (default: 2; under a launcher, its world size)")
    p.add_argument("--max-new-tokens", "--steps", dest="steps", type=positive, default=16, metavar="N",
                   help="most tokens to generate per prompt (default: 16)")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a text prompt (repeat for a batch); needs the checkpoint's tokenizer (default: none; the "
                        "--prompt-ids default is used)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="a file of text prompts, one per line (default: none)")
    p.add_argument("--chat", action="store_true",
                   help="apply the checkpoint's chat template to each prompt (a user message)")
    p.add_argument("--prompt-ids", action="append", default=None, metavar="IDS",
                   help="comma-separated prompt token ids (repeat for a batch); needs no tokenizer (default: 1,2,3,4)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end a prompt's output at this text (repeatable; default: none)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sample at this temperature; 0 is greedy (default: generation_config.json's, else 0)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample from the smallest set of tokens with this much probability "
                        "(default: generation_config.json's, else 1.0)")
    p.add_argument("--top-k", type=non_negative, default=None, metavar="K",
                   help="sample from the k most likely tokens; 0 is all (default: generation_config.json's, else 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide a positive logit (multiply a negative one) of every token the prompt or the output "
                        "holds by R (default: 1, none)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="subtract P from the logit of every token the output holds, in [-2, 2] (default: 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F times how often the output holds a token from its logit, in [-2, 2] (default: 0)")
    p.add_argument("--logit-bias", action="append", type=_logit_bias, default=None, metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit at every step (repeatable; default: none)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="when sampling, drop tokens less likely than P times the likeliest (default: 0, none)")
    p.add_argument("--min-tokens", type=non_negative, default=0, metavar="N",
                   help="generate at least N tokens before an end-of-sequence id may end a prompt (default: 0)")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="a picture for a VL model: PNG, JPEG, or .npy [3,H,W] in [0,1]; repeat for several, in the "
                        "order of their placeholders (default: none)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a checkpoint directory as transformers saves it: config.json, *.safetensors "
                        "(default: seeded random weights)")
    dtype_option(p, DTYPE_HELP)
    quantization_options(p)
    graph_option(p)
    p.add_argument("--reload-cycles", type=non_negative, default=0, metavar="N",
                   help="weight-update cycles after the first run (default: 0)")
    seed_option(p, "seeds sampling and a preset's random weights (default: 0)")
    p.add_argument("--json", action="store_true",
                   help="print a machine-readable summary on stdout (text and ids per prompt)")
    p.add_argument("--rank-timeout", type=seconds, default=30.0, metavar="SECONDS",
                   help="how long to wait for the other ranks once one has failed (default: 30)")
    p.add_argument("--stall-timeout", type=seconds, default=60.0, metavar="SECONDS",
                   help="how long a rank may go without progress (stuck in a collective, a hung plugin) before the run "
                        "stops (default: 60)")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="load weights holding NaN or Inf instead of refusing them (experiments only)")
    canary_option(p)
    resource_options(p)
    cache_options(p)
    p.set_defaults(func=cmd_run)


def _logit_bias(text: str) -> tuple[int, float]:
    """ID=BIAS: a token id and the bias added to its logit."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ID=BIAS (a token id and a number, as 42=-5), got {text!r}"
        ) from None


def _prompt_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ConfigError(f"--prompt-ids {text!r}: expected comma-separated integers such as 1,2,3") from None


# Largest --prompts file fd reads (far beyond any context; /dev/zero and FIFOs are refused as special files).
MAX_PROMPTS_BYTES = 64 << 20


def _text_prompts(prompts: list[str] | None, path: str | None) -> tuple[str, ...]:
    """--prompt values, then the non-empty lines of the --prompts file (a regular file of UTF-8 text)."""
    from fd_core.runtime.files import read_text

    texts = list(prompts or ())
    if path is not None:
        text = read_text(
            path, f"--prompts {path}", MAX_PROMPTS_BYTES, error=ConfigError, fix="pass a text file, one prompt per line"
        )
        texts += [line.rstrip("\r") for line in text.split("\n") if line.strip()]
        if not texts:
            raise ConfigError(f"--prompts {path} holds no prompt; write one per line")
    return tuple(texts)


def _run_tp(requested: int | None, launched: tuple[int, int] | None) -> int:
    """--tp, or the launcher's world size when paddle.distributed.launch started this process."""
    if launched is None:
        return 2 if requested is None else requested
    if requested not in (None, launched[1]):
        raise ConfigError(
            f"--tp {requested} does not match the launcher's {launched[1]} processes; drop --tp under a launcher"
        )
    return launched[1]


def _print_text(index: int, text: str) -> None:
    """New text on stdout as it is produced (one prompt, an interactive terminal)."""
    out = stdout()
    out.write(text)
    out.flush()


def cmd_run(args: argparse.Namespace) -> int:
    from fd_core.host.backend import Backend
    from fd_core.host.loading import load_plugins
    from fd_core.host.output import fd_stdout_closed
    from fd_core.host.paddle_logs import quiet_paddle_logs
    from fd_core.runtime.job import run_plan
    from fd_core.runtime.plan import RunConfig, plan_run, plugin_env
    from fd_core.runtime.procstats import process_start_time
    from fd_core.runtime.ranks.spawn import Terminated, launched_rank, stop_signals_raise

    require_paddle()

    quiet_paddle_logs()
    launched = launched_rank()
    if fd_stdout_closed():
        raise ConfigError(
            "stdout is closed, and fd run writes its output there; redirect it (> out.txt, or > /dev/null to discard)"
        )
    texts = _text_prompts(args.prompt, args.prompts)
    id_prompts = tuple(_prompt_ids(p) for p in args.prompt_ids or ())
    run = RunConfig(
        model=args.model,
        tp=_run_tp(args.tp, launched),
        steps=args.steps,
        prompt_ids=id_prompts[0] if id_prompts else (1, 2, 3, 4),
        id_prompts=id_prompts if len(id_prompts) > 1 else (),
        images=tuple(args.image or ()),
        checkpoint=args.checkpoint,
        dtype=args.dtype,
        graph=args.graph,
        reload_cycles=args.reload_cycles,
        seed=args.seed,
        allow_non_finite=args.allow_non_finite,
        prompts=texts,
        chat=args.chat,
        stop=tuple(args.stop or ()),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=tuple(args.logit_bias or ()),
        min_p=args.min_p,
        min_tokens=args.min_tokens,
        kernel_canary=args.kernel_canary,
        cache_for_job=True,
        **shared_settings(args),
        # Text streams to an interactive terminal as it is produced (one prompt; several print in order at the end).
        stream=bool(texts) and len(texts) == 1 and not args.json and stdout().isatty(),
        started_at=process_start_time(ENTERED_AT),
    )
    if texts and id_prompts:
        raise ConfigError("pass text prompts (--prompt, --prompts) or token ids (--prompt-ids), not both")
    # Planned once, here; the session's ranks receive the plan (and, in this process, the plugins and backend it was
    # made with).
    plugins = load_plugins(plugin_env(run.platform))
    backend = Backend(plugins)
    plan = plan_run(run, plugins, backend=backend)
    # Paddle installs its own signal handlers when imported: first, so that ours go over them.
    import paddle  # noqa: F401

    try:
        with stop_signals_raise():
            # Forked, not spawned: this process has imported paddle but run nothing with it, and a forked rank
            # starts with that import done instead of paying it again (seconds).
            results = run_plan(plan, plugins, backend=backend, on_text=_print_text if run.stream else None,
                               rank_timeout=args.rank_timeout, stall_timeout=args.stall_timeout, start_method="fork")
    except Terminated as exc:  # SIGTERM, SIGHUP or SIGQUIT: 128 + its number
        print(exc.message(), file=sys.stderr)
        return exc.exit_code
    if run.stream:
        print(file=stdout(), flush=True)
    if launched is not None and launched[0] != 0:
        return 0  # under a launcher, rank 0 reports
    from fd_core.runtime.report import as_json, summary_lines

    verbose = os.environ.get("FD_VERBOSE", "0") not in ("", "0")
    if args.json:
        print(as_json(results), file=stdout())
    elif texts:
        # The text is the output; the report goes to stderr, so `fd run --prompt ... > out.txt` keeps only text.
        if not run.stream:
            print("\n\n".join(o["text"] for o in results[0]["outputs"]), file=stdout())
        print(fit(summary_lines(results, verbose)), file=sys.stderr)
    else:
        print(fit(summary_lines(results, verbose)), file=stdout())
    return 0
