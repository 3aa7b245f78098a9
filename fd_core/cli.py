"""The `fd` command: plugins | explain | run | save-random | check | bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Callable, NoReturn, Sequence

from fd_core.errors import ConfigError, FdError, RankError

EXIT_USAGE = 2
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports it


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as every other fd error
        self.exit(EXIT_USAGE, f"fd: error: {message} (see fd {self.prog.split()[-1]} --help)\n")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


def cmd_plugins(args: argparse.Namespace) -> int:
    from fd_core.plugins import load_plugins

    plugins = load_plugins()
    rows = [r.to_dict() for r in plugins.records]
    if args.json:
        _print_json({"platform": plugins.platform, "selection": plugins.selection, "plugins": rows})
        return 0
    print(f"platform: {plugins.platform} ({plugins.selection})")
    for kind in ("platform", "model", "extension"):
        group = [r for r in plugins.records if r.kind == kind]
        if not group:
            continue
        print(f"\n{kind} plugins:")
        for r in group:
            origin = f"{r.distribution} {r.version}" if r.distribution else "(not installed: passed in)"
            print(f"  {r.name:<12} {origin:<24} {r.status}")
            if r.load_error:
                print(f"  {'':<12} error: {r.load_error}")
            if r.hooks:
                print(f"  {'':<12} hooks: {', '.join(r.hooks)}")
    if plugins.registry:
        print("\narchitectures: " + ", ".join(f"{a.name} ({a.package})" for a in plugins.registry))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from fd_core.backend import load_backend
    from fd_core.config import ModelConfig, ParallelConfig
    from fd_core.plugins import load_plugins

    plugins = load_plugins()
    parallel = ParallelConfig(tp_size=args.tp)
    backend = load_backend(parallel, plugins=plugins)
    registry = plugins.registry
    if len(registry):
        arch = registry.get(args.model)  # an unknown name raises, listing the registered architectures
        config = arch.preset_config()
        model_line = f"{arch.name} (registered by {arch.package})"
    else:
        config = ModelConfig(architecture=args.model)
        model_line = f"{args.model} (no model package registers it)"
    decision = backend.graph_decision(config, requested=args.graph)
    if args.json:
        _print_json({**backend.describe(), "model": config.architecture, "graph": decision.to_dict()})
        return 0
    det = backend.detection
    print(f"platform: {backend.platform} ({plugins.selection})")
    state = "detected" if det.detected else "not detected"
    print(f"  {state}: {det.reason or '-'}")
    others = [r for r in plugins.records if r.kind == "platform" and not r.active]
    for r in others:
        print(f"  {r.name}: {r.status}")
    print(f"model: {model_line}, tp={args.tp}")
    print(f"all-reduce: {backend.all_reduce_binding}")
    print(f"graph: {decision.summary()}")
    for vote in decision.votes:
        print(f"  {vote.line()}")
    return 0


def _prompt_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ConfigError(f"--prompt-ids {text!r}: expected comma-separated integers such as 1,2,3") from None


def _run_tp(requested: int | None, launched: tuple[int, int] | None) -> int:
    """--tp, or the launcher's world size when paddle.distributed.launch started this process."""
    if launched is None:
        return 2 if requested is None else requested
    if requested not in (None, launched[1]):
        raise ConfigError(f"--tp {requested} does not match the launcher's {launched[1]} processes; drop --tp under a launcher")
    return launched[1]


def cmd_run(args: argparse.Namespace) -> int:
    from fd_core.distributed import (
        Terminated,
        launched_rank,
        quiet_paddle_logs,
        spawn_ranks,
    )
    from fd_core.runner import (
        RunConfig,
        as_json,
        plan_run,
        process_start_time,
        run_rank,
        spawned_rank,
        summary_lines,
    )

    quiet_paddle_logs()
    launched = launched_rank()
    run = RunConfig(
        model=args.model,
        tp=_run_tp(args.tp, launched),
        steps=args.steps,
        prompt_ids=_prompt_ids(args.prompt_ids),
        images=tuple(args.image or ()),
        checkpoint=args.checkpoint,
        dtype=args.dtype,
        graph=args.graph,
        reload_cycles=args.reload_cycles,
        seed=args.seed,
        started_at=process_start_time(),
    )
    if launched:
        # Started by paddle.distributed.launch: this process is one rank; rank 0 reports.
        result = spawned_rank(run)
        results = [result] if launched[0] == 0 else []
    else:
        plan = plan_run(run)
        if run.tp == 1:
            results = [run_rank(run)]
        else:
            try:
                # Forked, not spawned: this process has imported paddle but run nothing with it, and a
                # forked rank starts with that import done instead of paying it again (seconds here).
                import paddle.distributed  # noqa: F401 - before the clock: spawning needs it, and its import belongs to "start"

                run = dataclasses.replace(run, spawned_at=time.time())
                results = spawn_ranks(spawned_rank, (run,), run.tp, plan.dist_backend, grace=args.rank_timeout, start_method="fork")
            except Terminated:
                print("fd: terminated; every rank was stopped", file=sys.stderr)
                return EXIT_TERMINATED
            diverged = [r["rank"] for r in results if r["tokens"] != results[0]["tokens"]]
            if diverged:
                raise RankError(f"rank {diverged[0]} generated different tokens than rank 0; the ranks disagree")
    if results:
        _add_wall_time(results[0], run.started_at)
        print(as_json(results) if args.json else "\n".join(summary_lines(results)))
    return 0


def _add_wall_time(result: dict[str, Any], started_at: float | None) -> None:
    """Rank 0's result gains the wall time so far and, after spawned ranks, their teardown as a phase."""
    now = time.time()
    if started_at is None:
        return
    finished = result.pop("finished_at", now)
    if now - finished > 1e-3:
        result["timings_s"]["teardown"] = round(now - finished, 4)
    result["wall_s"] = round(now - started_at, 4)


def cmd_save_random(args: argparse.Namespace) -> int:
    from fd_core.distributed import quiet_paddle_logs
    from fd_core.runner import save_random_checkpoint

    quiet_paddle_logs()
    path = save_random_checkpoint(args.model, args.directory, seed=args.seed, config_path=args.config, dtype=args.dtype)
    print(f"wrote {path}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    try:
        import pytest
    except ImportError:
        raise FdError("fd check runs the conformance suite with pytest, which is not installed; pip install 'fd-backends[test]'") from None

    from fd_core.plugins import load_plugins
    from fd_core.testing import check_module
    from fd_core.testing.pytest_plugin import ResultTable

    platform = args.platform or load_plugins().platform
    load_plugins({**os.environ, "FD_PLATFORM": platform})  # an unknown or broken platform fails here, in one line
    table = ResultTable()
    module = Path(check_module.__file__)
    extra = ["-k", args.k] if args.k else []
    code = pytest.main(
        ["-p", "no:terminal", "-p", "no:cacheprovider", f"--rootdir={module.parent}", "--fd-platform", platform, *extra, str(module)],
        plugins=[table],
    )
    print(f"conformance of platform {platform!r}:")
    names = [r.check.rsplit("::", 1)[-1] for r in table.rows]
    width = max(map(len, names), default=10)
    for name, row in sorted(zip(names, table.rows), key=lambda pair: pair[0]):
        print(f"  {row.outcome:<8} {name:<{width}}  {row.detail}".rstrip())
    counts = table.counts()
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) and not table.rows:
        print(f"fd: error: the conformance suite did not run (pytest exit code {int(code)})", file=sys.stderr)
        return 1
    return 1 if counts["failed"] or code == pytest.ExitCode.TESTS_FAILED else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from fd_bench import main as bench_main

    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fd", description="Pluggable hardware backends for PaddlePaddle inference.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plugins", help="list every discovered plugin, its hooks and its detection answer")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("explain", help="show the chosen platform and the graph decision with every vote")
    p.add_argument("--model", default="ernie4_5", help="architecture name (default: ernie4_5)")
    p.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size (default: 1)")
    p.add_argument("--graph", choices=("auto", "on", "off"), default="auto",
                   help="auto: capture unless a plugin vetoes or reports no gain; on: capture unless a plugin vetoes; off: eager")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("run", help="run a model: load, clean, decide, capture, generate")
    p.add_argument("--model", default=None, help="architecture (default: the checkpoint's, else ernie4_5)")
    p.add_argument("--tp", type=_positive, default=None, help="tensor-parallel ranks (default: 2; under a launcher, its world size)")
    p.add_argument("--steps", type=_positive, default=16, help="tokens to generate (default: 16)")
    p.add_argument("--prompt-ids", default="1,2,3,4", help="comma-separated prompt token ids")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="a picture for a VL model: PNG, JPEG, or .npy [C,H,W] in [0,1]; repeat for several images, in the order of their placeholders")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory as transformers saves it (config.json, *.safetensors)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16", "float64"),
                   help="compute dtype (default: the platform's preferred one; float32 on cpu)")
    p.add_argument("--graph", choices=("auto", "on", "off"), default="auto",
                   help="auto: capture unless a plugin vetoes or reports no gain; on: capture unless a plugin vetoes; off: eager")
    p.add_argument("--reload-cycles", type=_non_negative, default=0, help="weight-update cycles after the first run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print a machine-readable summary")
    p.add_argument("--rank-timeout", type=float, default=30.0, help="seconds to wait for the other ranks once one has failed")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="run the conformance suite against an installed platform")
    p.add_argument("platform", nargs="?", default=None, help="platform name (default: the active one)")
    p.add_argument("-k", default=None, help="only checks matching this pytest -k expression")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("bench", help="benchmarks of the plugin layer (see benchmarks/README.md)", add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark runner (--smoke, --json PATH, --rows ...)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("save-random", help="write a seeded random checkpoint in the published layout (safetensors + config.json)")
    p.add_argument("--model", default="ernie4_5", help="architecture whose tiny preset to use (default: ernie4_5)")
    p.add_argument("--config", default=None, help="a config.json to use instead of the preset (e.g. a published model's)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="dtype the tensors are stored in")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("directory")
    p.set_defaults(func=cmd_save_random)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The benchmark runner parses its own options (argparse.REMAINDER drops a leading --option).
        return cmd_bench(argparse.Namespace(bench_args=argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except FdError as exc:
        print(f"fd: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # `fd plugins --json | head` closed the pipe: not an error of ours.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("fd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
