"""Benchmarks of the plugin layer: hot-path dispatch, start-up, decode at tp=2, all-reduce by plugin, reloads.

Run `fd bench` (or `python -m fd_bench`); `--smoke` is the short CI mode. Every comparison runs its two
sides interleaved in one process or one run, after a warm-up, and reports medians and their ratio.
Importing this package imports neither paddle nor fd_core's plugins; each row imports what it needs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["ROWS", "main"]

# Row name -> what it compares (the order of the table).
ROWS: dict[str, str] = {
    "dispatch": "Backend all-reduce bound at build time vs a direct call of the same implementation",
    "dispatch_vs_hook": "the bound all-reduce vs the plain pluggy hook call",
    "dispatch_wrapper": "Backend with a tracing wrapper vs the plain hook call with the same wrapper",
    "tp1": "Backend all-reduce at one rank vs a function returning the tensor",
    "decode": "ERNIE-4.5 tiny decode step at tp=2 (gloo): through fd_core vs all-reduce wired to paddle.distributed",
    "startup": "python -c 'import fd_core' and fd plugins vs python -c pass, whole processes",
    "allreduce": "cpu platform (shared memory) vs gloo all-reduce at tp=2: 1 KiB, 64 KiB, 1 MiB, 16 MiB",
    "graph": "tiny ERNIE decode step, static graph vs eager, cpu platform, tp=1",
    "reload": "time and RSS across weight-reload cycles of ModelRunner",
    "realsize": ("ERNIE-4.5-0.3B (random bf16 weights): fd run at tp=1 and tp=2 vs transformers at 1 and 2 threads, "
                 "vs the matrix-vector ceiling and tp=2's products with its all-reduces alone, tp=2 beside a busy "
                 "thread; peak RSS vs weights + cache"),
    "step": ("where an ERNIE-4.5-0.3B decode step's time goes at tp=1 and tp=2: matrix work, attention, LM head, "
             "sampling, KV writes, all-reduce waits"),
    "kvwrite": "one decode step's KV-cache writes at cache lengths 80 and 320, eager and in a static program",
    "kernels": "a layer's call of a resolved op vs a direct call; the cpu platform's fused RMSNorm vs the native op",
    "serve": ("fd serve at 1, 4 and 16 concurrent streaming clients vs the same requests through LLM one at a time: "
              "req/s, tok/s, time to first token; and at 4 clients, logprobs, n=4 and a json_schema response_format "
              "vs plain requests (tok/s, time to first token, ms per token)"),
    "serving": ("fd serve on ERNIE-4.5-0.3B (random weights, no tokenizer) at 1, 4 and 8 concurrent clients, each "
                "a streamed 128-id prompt and 64 greedy tokens: aggregate tok/s, time to first token, inter-token "
                "latency p50 and p99"),
    "prefix": ("8 requests sharing a 1,024-token system prompt through fd serve: time to first token, prefix caching "
               "on vs off"),
    "capacity": ("sequences of 64 to 2,048 positions running together at one KV budget: blocks vs the fixed slots "
                 "before"),
    "chunked": "the largest gap of a running stream while a 4,096-token prompt arrives: chunked prefill vs whole",
    "decode_paged": "decode tok/s at batch 1 and 8: the paged KV cache vs the fixed-slot code before it (its commit)",
    "speculative": ("ERNIE-4.5-0.3B at batch 1 and 8: speculative decoding (k=4) vs plain, with n-gram proposals, "
                    "with every proposal wrong, with every and half of the proposals accepted, and with the model as "
                    "its own draft"),
    "quant": ("ERNIE-4.5-0.3B batch 1 decode: --quantization wint8 (and wint4) vs float32 at fd's faster layout, vs "
              "transformers; peak RSS per rank vs float32's weights + cache"),
    "disagg": ("prefill and decode on separate instances: a 0.3B-size prompt's keys and values through the shm and tcp "
               "transports vs a memory copy; inter-token latency of 4 decoding streams while 1,024-id prompts arrive, "
               "prefill and decode instances on a core each behind the router vs one fd serve on both"),
    "llamacpp": ("llama.cpp beside fd on the same ERNIE-4.5-0.3B weights (its own converter): batch 1 decode in f32, "
                 "q8_0 and q4_0 vs fd float32, wint8 and wint4; llama-server vs fd serve at 1, 4 and 8 clients; the "
                 "same greedy tokens (needs FD_LLAMA_CPP, a llama.cpp build)"),
}
DEFAULT_JSON = Path("benchmarks/results/latest.json")
# A smoke run (CI) must not overwrite the recorded full run.
DEFAULT_SMOKE_JSON = Path("benchmarks/results/latest-smoke.json")


def _repo_root(start: Path) -> Path | None:
    """The fd-backends checkout containing `start`, if any (a pyproject.toml naming the project)."""
    for d in (start, *start.parents):
        pyproject = d / "pyproject.toml"
        if pyproject.is_file() and 'name = "fd-backends"' in pyproject.read_text(errors="replace"):
            return d
    return None


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    from fd_core.cli import CommandParser

    parser = CommandParser(prog="fd bench", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="short CI mode (< 60 s): proves every row runs; its numbers are not the record")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help=f"write the results as JSON (default inside the repository: {DEFAULT_JSON}, or "
                             f"{DEFAULT_SMOKE_JSON} with --smoke; outside it: none; '-' prints the JSON to stdout)")
    parser.add_argument("--rows", default=None, help=f"comma-separated rows to run (default: all): {','.join(ROWS)}")
    args = parser.parse_args(argv)
    if args.json not in (None, "-"):
        # Named by the user: written where they said, never into directories made up on the way.
        path = Path(args.json)
        if not args.json.strip():
            parser.error("--json needs a file name, or - for stdout")
        if path.is_dir() or args.json.endswith(("/", "\\")):
            parser.error(f"--json {args.json} is a directory; name a file in it")
        if path.parent.exists() and not path.parent.is_dir():
            parser.error(f"--json {args.json}: {path.parent} is not a directory; choose another path")
        if not path.parent.is_dir():
            parser.error(f"--json {args.json}: directory {path.parent} does not exist; "
                         "create it or choose another path")
    if args.rows is None:
        args.selected = list(ROWS)
    else:
        wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
        unknown = [r for r in wanted if r not in ROWS]
        if unknown or not wanted:
            parser.error(f"unknown row(s) {', '.join(unknown) or '(none given)'}; choose from {','.join(ROWS)}")
        args.selected = [r for r in ROWS if r in wanted]
    return args


def _runners(selected: list[str], smoke: bool) -> list[tuple[tuple[str, ...], Callable[[], list[Any]]]]:
    """(rows covered, a function producing their lines), grouped so that each spawn or process serves several rows."""
    from fd_bench import graph, kernels, kvwrite, micro, realsize, reload, startup, tp2

    chosen = set(selected)
    jobs: list[tuple[tuple[str, ...], Callable[[], list[Any]]]] = []
    micro_rows = tuple(r for r in ("dispatch", "dispatch_vs_hook", "dispatch_wrapper", "tp1") if r in chosen)
    if micro_rows:
        jobs.append((micro_rows, lambda: micro.dispatch_rows(chosen, smoke)))
    if "startup" in chosen:
        jobs.append((("startup",), lambda: startup.startup_rows(smoke)))
    tasks = tuple(t for t in ("decode", "allreduce") if t in chosen)
    if tasks:

        def ranks() -> list[Any]:
            results = tp2.run(tasks, smoke)
            lines = tp2.decode_lines(results) if "decode" in tasks else []
            return lines + (tp2.allreduce_lines(results) if "allreduce" in tasks else [])

        jobs.append((tasks, ranks))
    if "graph" in chosen:
        jobs.append((("graph",), lambda: graph.graph_rows(smoke)))
    if "reload" in chosen:
        jobs.append((("reload",), lambda: reload.reload_rows(smoke)))
    sized = tuple(r for r in ("realsize", "step") if r in chosen)
    if sized:

        def real() -> list[Any]:
            m = realsize.measure(smoke)
            return ((realsize.realsize_rows(smoke, m) if "realsize" in sized else [])
                    + (realsize.step_rows(smoke, m) if "step" in sized else []))

        jobs.append((sized, real))
    if "kvwrite" in chosen:
        jobs.append((("kvwrite",), lambda: kvwrite.kvwrite_rows(smoke)))
    if "quant" in chosen:
        from fd_bench import quant

        jobs.append((("quant",), lambda: quant.quant_rows(smoke)))
    if "speculative" in chosen:
        from fd_bench import speculative

        jobs.append((("speculative",), lambda: speculative.speculative_rows(smoke)))
    if "kernels" in chosen:
        jobs.append((("kernels",), lambda: kernels.kernel_rows(smoke)))
    if "serve" in chosen:
        from fd_bench import serving

        jobs.append((("serve",), lambda: serving.serve_rows(smoke)))
    if "serving" in chosen:
        from fd_bench import serving_load

        jobs.append((("serving",), lambda: serving_load.serving_rows(smoke)))
    if "disagg" in chosen:
        from fd_bench import disagg

        jobs.append((("disagg",), lambda: disagg.transfer_rows() + disagg.serving_rows(smoke)))
    if "llamacpp" in chosen:
        from fd_bench import llamacpp

        jobs.append((("llamacpp",), lambda: llamacpp.llamacpp_rows(smoke)))
    paged_rows = {"prefix": "prefix_rows", "capacity": "capacity_rows", "chunked": "chunked_rows",
                  "decode_paged": "decode_rows"}
    for row, function in paged_rows.items():
        if row in chosen:
            from fd_bench import paged

            def run_paged(function: str = function) -> list[Any]:
                return list(getattr(paged, function)(smoke))

            jobs.append(((row,), run_paged))
    return jobs


def main(argv: list[str] | None = None) -> int:
    """Run the selected rows, print the table, write JSON; 0 when every row ran (missed targets do not fail)."""
    args = _parse(argv)
    from fd_core.host.paddle_logs import quiet_paddle_logs

    quiet_paddle_logs()  # before any row imports paddle
    from fd_bench.report import Line, impossible, machine, table

    prog = "python -m fd_bench" if sys.argv and sys.argv[0].endswith("__main__.py") else "fd bench"
    command = " ".join([prog, *(sys.argv[1:] if argv is None else argv)])
    info = machine()
    # With `--json -`, stdout holds the JSON and nothing else; the human report goes to stderr.
    out = sys.stderr if args.json == "-" else sys.stdout
    print(f"fd bench ({'smoke' if args.smoke else 'full'}): {info['nproc']} cpus, {info['cpu_model']}, "
          f"Python {info['python']}, paddle {info['paddlepaddle']}", file=out, flush=True)
    lines: list[Line] = []
    errors: dict[str, str] = {}
    timings: dict[str, float] = {}
    started = time.perf_counter()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    for rows, job in _runners(args.selected, args.smoke):
        t0 = time.perf_counter()
        print(f"  running {', '.join(rows)} ...", file=sys.stderr, flush=True)
        try:
            lines.extend(job())
        except Exception as exc:  # noqa: BLE001 - one broken row must not hide the others
            errors.update({r: f"{type(exc).__name__}: {exc}" for r in rows})
            traceback.print_exc()
            lines.extend(Line(row=r, case="failed", a="-", b="-", a_value=None, b_value=None, unit="", ratio=None,
                              ratio_label="", target="", met=False, note=f"error: {type(exc).__name__}: {exc}")
                         for r in rows)
        timings[",".join(rows)] = time.perf_counter() - t0
    for ln in lines:
        problem = impossible(ln)
        if problem is not None:
            # A value no measurement can give (a negative size, a NaN ratio) is a broken row, never a verdict.
            errors[ln.row] = f"{ln.case}: {problem}"
            ln.met, ln.note = None, f"error: {problem}" + (f"; {ln.note}" if ln.note else "")
    order = {r: i for i, r in enumerate(ROWS)}
    lines.sort(key=lambda ln: order[ln.row])
    print(file=out)
    print(table(lines, args.smoke), file=out)
    total = time.perf_counter() - started
    checked = [ln for ln in lines if ln.met is not None]
    summary = {
        "met": sorted({ln.row for ln in checked if ln.met} - {ln.row for ln in checked if not ln.met},
                      key=order.__getitem__),
        "missed": sorted({ln.row for ln in checked if not ln.met}, key=order.__getitem__),
        "reported": sorted({ln.row for ln in lines if ln.met is None} - set(errors), key=order.__getitem__),
        "errors": sorted(errors, key=order.__getitem__),
    }
    print(f"\n{'smoke run: numbers are not the record; ' if args.smoke else ''}"
          f"targets met: {', '.join(summary['met']) or 'none'}; missed: {', '.join(summary['missed']) or 'none'}; "
          f"errors: {', '.join(summary['errors']) or 'none'}; total {total:.1f} s", file=out)
    doc = {
        "mode": "smoke" if args.smoke else "full",
        "command": command,
        "machine": info,
        "started": started_at,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(total, 2),
        "seconds_by_job": {k: round(v, 2) for k, v in timings.items()},
        "rows": list(args.selected),
        "summary": summary,
        "errors": errors,
        "lines": [ln.to_dict() for ln in lines],
    }
    target = args.json
    if target is None:
        root = _repo_root(Path.cwd())
        target = str(root / (DEFAULT_SMOKE_JSON if args.smoke else DEFAULT_JSON)) if root is not None else None
    if target == "-":
        print(json.dumps(doc, indent=2))
    elif target is not None:
        path = Path(target)
        if args.json is None:
            path.parent.mkdir(parents=True, exist_ok=True)  # the repository's own results directory
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"results: {path}", file=out)
    return 1 if errors else 0
