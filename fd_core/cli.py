"""The `fd` command: plugins | explain | run | serve | save-random | check | help, and the commands plugins add
(bench)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import warnings
from typing import Any, Callable, Iterator, Mapping, NoReturn, Sequence, TextIO

from fd_core.config import COMPUTE_DTYPES
from fd_core.contract import CONTRACT_VERSION
from fd_core.errors import SETTINGS_STYLE_ENV, ConfigError, FdError, install_hint
from fd_core.quantization import DEFAULT_GROUPS, SCHEMES, quantized_line

# When fd's entry point was imported: a run's clock starts here if the process was created long
# before, for something else, and exec'd fd (see procstats.process_start_time).
ENTERED_AT = time.time()

# fd's own subcommands: a plugin's command may not take these names.
CORE_COMMANDS = ("plugins", "explain", "run", "serve", "save-random", "check", "help")

EXIT_USAGE = 2
EXIT_NOT_VERIFIED = 3  # fd check: nothing failed, but the checks that need the hardware could not run
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports it; SIGHUP exits 129 and SIGQUIT 131 (Terminated.exit_code)


class CommandParser(argparse.ArgumentParser):
    """argparse with fd's usage errors: one line, exit 2, pointing to --help. For plugins' commands too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"fd: error: {message} (see {self.prog} --help)\n")


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


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text}")
    from fd_core.host.selection import MAX_TIMEOUT_S

    if value > MAX_TIMEOUT_S:  # a wait this long overflows (Python's timeouts end near 1e10 s)
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TIMEOUT_S} seconds (a week), got {text}")
    return value


def _stdout() -> TextIO:
    """fd's own output: the real stdout, while what plugins print goes to stderr (see
    fd_core.host.output.plugin_prints_to_stderr)."""
    from fd_core.host.output import fd_stdout

    return fd_stdout()


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False), file=_stdout())


def cmd_plugins(args: argparse.Namespace) -> int:
    from fd_core.host.loading import load_plugins

    # Not strict: a plugin that fails validation or registration is listed with its error, not fatal.
    plugins = load_plugins(strict=False, reserved_commands=CORE_COMMANDS)
    rows = [{**r.to_dict(), "kernels": plugins.kernels.by_plugin(r.name) if r.active else []} for r in plugins.records]
    if args.json:
        architectures = [a.to_dict() for a in plugins.registry]
        _print_json({"contract_version": CONTRACT_VERSION, "platform": plugins.platform, "selection": plugins.selection,
                     "plugins": rows, "architectures": architectures, "problems": plugins.problems})
    else:
        print("\n".join(_plugin_listing(plugins)), file=_stdout())
    if plugins.problems:
        # The listing is printed; the exit code and the last line say the set is not usable for a run.
        plugins.require_usable()
    return 0


WIDTH = 100  # human output wraps here; --json is the form for wider needs


def _wrapped(text: str, indent: int, hang: int = 0) -> list[str]:
    """`text` indented by `indent` and wrapped at WIDTH, continuation lines `hang` further in."""
    import textwrap

    return textwrap.wrap(text, WIDTH, initial_indent=" " * indent, subsequent_indent=" " * (indent + hang),
                         break_long_words=False, break_on_hyphens=False) or [" " * indent]


def _fit(lines: Sequence[str]) -> str:
    """Report lines wrapped at WIDTH: a line's continuation sits four columns in from where it starts,
    deeper than the two-column sub-lines (votes, other platforms) so that it never reads as one of them."""
    out: list[str] = []
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        out += _wrapped(line.strip(), indent, 4) if len(line) > WIDTH else [line]
    return "\n".join(out)


def _plugin_listing(plugins: Any) -> list[str]:
    """`fd plugins` as text: each plugin's name and origin, then its status, error and hooks beneath it."""
    lines = _wrapped(f"platform: {plugins.platform} ({plugins.selection})", 0, 2)
    # Capped: one long third-party name must not push every status towards the right margin.
    width = min(max((len(r.name) for r in plugins.records), default=0), 20) + 2
    for kind in ("platform", "model", "extension"):
        group = [r for r in plugins.records if r.kind == kind]
        if not group:
            continue
        lines += ["", f"{kind} plugins:"]
        for r in group:
            origin = f"{r.distribution} {r.version}" if r.distribution else "(not installed: passed in)"
            if r.contract:
                origin += f", contract {r.contract}" + ("" if r.contract_declared else " (not declared)")
            lines.append(f"  {r.name:<{width - 1}} {origin}")
            lines += _wrapped(r.status, 2 + width, 2)
            if r.load_error:
                lines += _wrapped(f"error: {r.load_error}", 2 + width, 7)
            if r.hooks:
                lines += _wrapped(f"hooks: {', '.join(r.hooks)}", 2 + width, 7)
            kernels = plugins.kernels.by_plugin(r.name) if r.active else []
            if kernels:
                lines += _wrapped(f"kernels: {', '.join(kernels)}", 2 + width, 9)
    if plugins.registry:
        # The name fd takes (--model), the names checkpoints' config.json use for it, and the plugin it came from.
        lines += ["", "architectures:"]
        width = max(len(a.name) for a in plugins.registry) + 2
        for a in plugins.registry:
            aliases = f"aliases: {', '.join(a.aliases)}; " if a.aliases else ""
            lines += _wrapped(f"{a.name:<{width}}{aliases}from plugin {a.package}", 2, width)
            if a.description:
                lines += _wrapped(a.description, 2 + width)
    # Last, beside the contract each plugin declares above: what this fd implements.
    return [*lines, "", f"fd's plugin contract: {CONTRACT_VERSION}"]


def cmd_explain(args: argparse.Namespace) -> int:
    from fd_core.config import ModelConfig, ParallelConfig
    from fd_core.host.backend import load_backend
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.memory import plan_memory
    from fd_core.runtime.plan import DEFAULT_MODEL, RunConfig, compute_dtype, plan_model, run_settings, run_threads
    from fd_core.runtime.report import (
        capture_line,
        capture_report,
        kernel_line,
        kv_cache_line,
        kv_cache_report,
        threads_line,
    )

    plugins = load_plugins()
    backend = load_backend(ParallelConfig(tp_size=args.tp), plugins=plugins)
    run = RunConfig(model=args.model, tp=args.tp, checkpoint=args.checkpoint, dtype=args.dtype,
                    quantization=args.quantization, quantization_group=args.quantization_group,
                    float_embeddings=args.float_embeddings, graph=args.graph,
                    memory_fraction=args.memory_fraction, threads=args.threads, kv_block_size=args.kv_block_size,
                    kv_cache_blocks=args.kv_cache_blocks, prefix_caching=args.prefix_caching,
                    max_batch=args.max_batch, max_prefill_tokens=args.max_prefill_tokens,
                    max_prefill_prompts=args.max_prefill_prompts)
    if len(plugins.registry):
        # What fd run plans, by the same function: the checkpoint's architecture and config.json, the layout fd run
        # would refuse refused here in the same words (no decision is shown for it), memory, threads and settings.
        model = plan_model(run, plugins, backend)
        config, memory, threads, settings = model.config, model.memory, model.threads, model.settings
        model_line = f"{model.arch.name} (registered by {model.arch.package})"
    else:
        name = args.model or DEFAULT_MODEL
        config = ModelConfig(architecture=name, dtype=compute_dtype(args.dtype, backend))
        model_line = f"{name} (no model package registers it)"
        settings = run_settings(run, backend, config.dtype)
        memory = plan_memory(
            config, args.tp, backend.detection, args.memory_fraction, backend.platform, config.architecture,
            block_size=settings.kv_block_size, kv_cache_blocks=args.kv_cache_blocks, max_batch=settings.max_batch,
            max_prefill_tokens=settings.max_prefill_tokens,
        )
        threads = run_threads(run, backend.detection)
    decision = backend.graph_decision(config, requested=args.graph)
    kv = kv_cache_report(memory, backend.kernels.providers(), args.prefix_caching, settings.max_prefill_tokens)
    capture = capture_report(backend.detection.capture_sizes, settings.max_batch)
    if args.json:
        _print_json({**backend.describe(), "model": config.architecture, "graph": decision.to_dict(),
                     "capture": capture, "dtype": config.dtype, "quantization": config.quantization,
                     "memory": memory.to_dict(), "threads": threads.to_dict(), "kv_cache": kv,
                     "settings": settings.to_dict()})
        return 0
    det = backend.detection
    lines = [
        f"platform: {backend.platform} ({plugins.selection})",
        f"  {'detected' if det.detected else 'not detected'}: {det.reason or '-'}",
    ]
    lines += [f"  {r.name}: {r.status}" for r in plugins.records if r.kind == "platform" and not r.active]
    lines += [f"model: {model_line}, tp={args.tp}", f"all-reduce: {backend.all_reduce_binding}",
              f"kernels: {kernel_line(backend.kernels.providers())}", f"graph: {decision.summary()}"]
    lines += [f"  {vote.line()}" for vote in decision.votes]
    if decision.allowed:
        lines.append(capture_line(capture))
    quantized = (f"; {quantized_line(config.quantization, config.quantization_group, config.float_embeddings)} "
                 f"(quant_matmul, weights quantized at load)" if config.quantization else "")
    lines += [f"dtype: {config.dtype}{quantized}", threads_line(threads.to_dict()), f"memory: {memory.summary()}",
              kv_cache_line(kv), "settings (each the option's, the platform's or fd's default):"]
    lines += [f"  {line}" for line in settings.lines()]
    print(_fit(lines), file=_stdout())
    return 0


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


def _require_paddle() -> None:
    """A one-line error when no Paddle build is installed; the extras that provide one are read from the package's
    metadata."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, requires

    if importlib.util.find_spec("paddle") is not None:
        return
    try:
        extras = sorted({r.split("extra ==")[1].strip().strip("'\"") for r in requires("fd-backends") or []
                         if r.lower().startswith("paddlepaddle") and "extra ==" in r})
    except PackageNotFoundError:
        extras = []
    choices = " or ".join(f"pip install '.[{e}]' in a checkout" for e in extras) or "install PaddlePaddle"
    raise FdError(
        f"PaddlePaddle is not installed; {choices}, or a device build as docs/install.md says "
        f"(one build only: each provides the same paddle package)"
    )


def _print_text(index: int, text: str) -> None:
    """New text on stdout as it is produced (one prompt, an interactive terminal)."""
    out = _stdout()
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

    _require_paddle()

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
        quantization=args.quantization,
        quantization_group=args.quantization_group,
        float_embeddings=args.float_embeddings,
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
        max_batch=args.max_batch,
        memory_fraction=args.memory_fraction,
        threads=args.threads,
        kv_block_size=args.kv_block_size,
        kv_cache_blocks=args.kv_cache_blocks,
        prefix_caching=args.prefix_caching,
        max_prefill_tokens=args.max_prefill_tokens,
        max_prefill_prompts=args.max_prefill_prompts,
        kernel_canary=args.kernel_canary,
        # Text streams to an interactive terminal as it is produced (one prompt; several print in order at the end).
        stream=bool(texts) and len(texts) == 1 and not args.json and _stdout().isatty(),
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
        print(file=_stdout(), flush=True)
    if launched is not None and launched[0] != 0:
        return 0  # under a launcher, rank 0 reports
    from fd_core.runtime.report import as_json, summary_lines

    verbose = os.environ.get("FD_VERBOSE", "0") not in ("", "0")
    if args.json:
        print(as_json(results), file=_stdout())
    elif texts:
        # The text is the output; the report goes to stderr, so `fd run --prompt ... > out.txt` keeps only text.
        if not run.stream:
            print("\n\n".join(o["text"] for o in results[0]["outputs"]), file=_stdout())
        print(_fit(summary_lines(results, verbose)), file=sys.stderr)
    else:
        print(_fit(summary_lines(results, verbose)), file=_stdout())
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"fd serve needs the serve extra ({' and '.join(missing)} not installed): "
                          f"{install_hint('serve')}")
    _require_paddle()
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
                 graph=args.graph, seed=args.seed, max_batch=args.max_batch, rank_timeout=args.rank_timeout,
                 stall_timeout=args.stall_timeout, memory_fraction=args.memory_fraction, threads=args.threads,
                 kv_block_size=args.kv_block_size, kv_cache_blocks=args.kv_cache_blocks,
                 prefix_caching=args.prefix_caching, max_prefill_tokens=args.max_prefill_tokens,
                 max_prefill_prompts=args.max_prefill_prompts, quantization=args.quantization,
                 quantization_group=args.quantization_group, float_embeddings=args.float_embeddings,
                 grammar_timeout=args.grammar_timeout,
                 kernel_canary=args.kernel_canary)


def cmd_save_random(args: argparse.Namespace) -> int:
    from fd_core.host.paddle_logs import quiet_paddle_logs
    from fd_core.runtime.save_random import save_random_checkpoint

    _require_paddle()

    quiet_paddle_logs()
    if args.tokenizer:
        from fd_core.serve.tiny import write_tiny_checkpoint

        path = write_tiny_checkpoint(args.directory, args.model, seed=args.seed, config_path=args.config,
                                     dtype=args.dtype)
    else:
        path = save_random_checkpoint(args.model, args.directory, seed=args.seed, config_path=args.config,
                                      dtype=args.dtype)
    print(f"wrote {path}{' (with a tokenizer and a chat template)' if args.tokenizer else ''}", file=_stdout())
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    import os
    import signal
    from pathlib import Path

    try:
        import pytest
    except ImportError:
        raise FdError(
            "fd check runs the conformance suite with pytest, which is not installed; "
            f"{install_hint('test')}"
        ) from None

    from fd_core.contract import deprecations
    from fd_core.host.loading import load_plugins
    from fd_core.host.paddle_logs import quiet_paddle_logs
    from fd_core.runtime.ranks import spawn as distributed
    from fd_core.testing import check_module, model_check_module
    from fd_core.testing.suite import THIRD_PARTY_CHECKS

    _require_paddle()
    quiet_paddle_logs()
    from fd_core.testing.pytest_plugin import ResultTable

    if args.platform is None:
        platform = load_plugins().platform
    else:
        platform = args.platform
        installed = [r.name for r in load_plugins(strict=False).records if r.kind == "platform"]
        if platform not in installed:
            raise FdError(
                f"no installed platform is named {platform!r}; installed: {', '.join(sorted(installed))} "
                f"(see fd plugins)"
            )
    checked = load_plugins({**os.environ, "FD_PLATFORM": platform})  # a broken platform fails here, in one line
    table = ResultTable()
    module = Path(check_module.__file__)
    extra = ["-k", args.k] if args.k else []
    model = None
    if args.model is not None:  # the model suite (fd_core/testing/model_suite.py) on the selected platform
        model = checked.registry.get(args.model).name  # an unknown name fails here, listing the registered ones
        module = Path(model_check_module.__file__)
        extra += ["--fd-model", model]
        os.environ["FD_PLATFORM"] = platform  # the suite's plans and ranks select the platform checked
    # SIGTERM (SIGHUP, SIGQUIT) stops the suite as Ctrl-C does (pytest ends the session on
    # KeyboardInterrupt). Paddle installs its own handler when imported, so import it first and install ours over it.
    import paddle  # noqa: F401

    class StopBetweenChecks:
        """Raises a signal's stop when the running check ends: raised inside Paddle's C++ code (a graph
        being captured in this process), the exception aborts the process (SIGABRT) instead of stopping it."""

        in_check = False
        pending: BaseException | None = None

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> Any:
            self.in_check = True
            try:
                result = yield
            finally:
                self.in_check = False
            if self.pending is not None:
                raise self.pending
            return result

    guard = StopBetweenChecks()

    def on_signal(signum: int, frame: Any) -> None:
        table.interrupted = signal.Signals(signum).name
        stop = distributed.note_stop_signal(signum) if signum in distributed.STOP_SIGNALS else KeyboardInterrupt()
        if guard.in_check and guard.pending is None:  # a second signal stops at once
            guard.pending = stop
            return
        raise stop

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, *distributed.STOP_SIGNALS)}
    try:
        code = pytest.main(
            # The suite's own settings, whatever pytest configuration the directory fd check runs in holds (its
            # addopts may name options of the terminal reporter this run replaces).
            ["-p", "no:terminal", "-p", "no:cacheprovider", "-o", "addopts=", f"--rootdir={module.parent}",
             "--fd-platform", platform, *extra, str(module)],
            plugins=[table, guard],
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    counts = table.counts()
    if code == pytest.ExitCode.NO_TESTS_COLLECTED and args.k:
        target = f"--model {model}" if model else platform
        raise ConfigError(
            f"no check of the conformance suite matches -k {args.k!r}; run fd check {target} without -k to see them all"
        )
    if (
        code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.INTERRUPTED)
        and not table.rows
        and not table.interrupted
    ):
        print(f"fd: error: the conformance suite did not run (pytest exit code {int(code)})", file=sys.stderr)
        return 1
    unverified = [
        r for r in table.rows
        if r.outcome == "skipped"
        and ("hardware not detected here" in r.detail or r.detail.startswith("not verified:"))
    ]
    if code == pytest.ExitCode.INTERRUPTED or table.interrupted:
        verdict, status = "interrupted: only the checks listed ran; nothing is verified", (
            128 + (distributed.stop_signal or signal.SIGTERM) if distributed.sigterm_received else EXIT_INTERRUPTED)
    elif counts["failed"] or code == pytest.ExitCode.TESTS_FAILED:
        verdict, status = f"failed ({counts['failed']} check(s))", 1
        failed = {r.check.rsplit("::", 1)[-1].split("[")[0] for r in table.rows if r.outcome == "failed"}
        if failed and failed <= set(THIRD_PARTY_CHECKS):
            # A vendor certifying a platform must see that someone else's model package is what failed.
            verdict += (f": only the checks of third-party model packages failed ({', '.join(sorted(failed))}); "
                        f"the platform's own checks passed")
    elif unverified and model is not None:
        verdict = (
            f"not verified: {len(unverified)} check(s) could not run here "
            f"({unverified[0].detail.removeprefix('not verified: ')})"
        )
        status = 0 if args.allow_unverified else EXIT_NOT_VERIFIED
    elif unverified:
        verdict = f"not verified: {len(unverified)} check(s) need {platform}'s hardware, which is not here"
        status = 0 if args.allow_unverified else EXIT_NOT_VERIFIED
    else:
        verdict, status = "passed", 0
    names = [r.check.rsplit("::", 1)[-1] for r in table.rows]
    ordered = sorted(zip(names, table.rows, strict=True), key=lambda pair: pair[0])
    if args.json:
        rows = [{"check": name, "outcome": row.outcome, "detail": row.detail,
                 "third_party": name.split("[")[0] in THIRD_PARTY_CHECKS} for name, row in ordered]
        _print_json({"platform": platform, **({"model": model} if model else {}), "checks": rows, "counts": counts,
                     "verdict": verdict, "exit_code": status, "deprecations": deprecations()})
        return status
    # One row a check, never wrapped, so that grep finds a check with its outcome and detail
    # (pytest's own summary lines are the same); --json is the form to parse.
    width = max(map(len, names), default=10)
    print(
        f"conformance of model {model!r} on platform {platform!r}:" if model
        else f"conformance of platform {platform!r}:",
        file=_stdout(),
    )
    for name, row in ordered:
        print(f"  {row.outcome:<8} {name:<{width}}  {row.detail}".rstrip(), file=_stdout())
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped", file=_stdout())
    print(f"verdict: {verdict}", file=sys.stderr if verdict.startswith("interrupted") else _stdout())
    for note in deprecations():  # works today; a plugin's author has until the named version to change it
        print(f"deprecated: {note}", file=_stdout())
    return status


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fd-backends")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _cache_options(p: argparse.ArgumentParser) -> None:
    """The batch and the paged KV cache's options, as fd run, fd serve and fd explain take them."""
    from fd_core.detection import DEFAULT_KV_BLOCK_SIZE
    from fd_core.runtime.memory import DEFAULT_MAX_PREFILL_TOKENS
    from fd_core.runtime.settings import DEFAULT_MAX_BATCH

    p.add_argument("--kv-block-size", type=_positive, default=None, metavar="N",
                   help=f"positions a KV-cache block holds (default: the platform's, else {DEFAULT_KV_BLOCK_SIZE})")
    p.add_argument("--kv-cache-blocks", type=_positive, default=None, metavar="N",
                   help="KV-cache blocks a rank allocates, at most what the memory plan leaves (default: that, capped "
                        "by the platform's KV budget and by what --max-batch sequences of the whole context could use)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share full KV-cache blocks between sequences with the same prefix (default: share)")
    p.add_argument("--max-batch", type=_positive, default=None, metavar="N",
                   help=f"most sequences decoded together (default: the platform's, else {DEFAULT_MAX_BATCH})")
    p.add_argument("--max-prefill-tokens", type=_positive, default=None, metavar="N",
                   help=f"most prompt tokens one step prefills, beside the running decodes; a longer prompt is "
                        f"prefilled in chunks (default: the platform's, else {DEFAULT_MAX_PREFILL_TOKENS})")
    p.add_argument("--max-prefill-prompts", type=_positive, default=None, metavar="N",
                   help="most prompts one step prefills (default: the platform's, else as many as the token budget "
                        "allows)")


def _canary_option(p: argparse.ArgumentParser) -> None:
    """--no-kernel-canary, as fd run and fd serve take it."""
    p.add_argument("--no-kernel-canary", dest="kernel_canary", action="store_false",
                   help="do not check, on each rank before the first request, the plugins' kernels the run calls "
                        "against fd's native ops (for a platform certified with fd check; default: check, well under "
                        "a second)")


def build_parser(
    commands: Mapping[str, tuple[str, Any, str]] | None = None, architectures: Sequence[str] = ()
) -> argparse.ArgumentParser:
    """The parser of `fd`'s own subcommands, and the names and help of those plugins add (they parse their own
    options).

    `architectures` (lines naming each registered architecture) close the help of the commands taking --model.
    """
    parser = CommandParser(prog="fd", description="Pluggable hardware backends for PaddlePaddle inference.",
                           epilog="fd help COMMAND shows a command's options; docs: README.md and docs/ in the "
                                  "repository.")
    parser.add_argument("--version", action="version", version=f"fd {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="let Paddle's own logs and warnings through "
                             "(default: kept off the terminal; sets FD_VERBOSE=1)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser, metavar="COMMAND")
    models: dict[str, Any] = {
        "epilog": "architectures (--model takes a name or an alias):\n" + "\n".join(architectures)
        if architectures else None,
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }
    graph_help = ("auto: capture unless a plugin vetoes or reports no gain; on: capture unless a plugin vetoes; "
                  "off: eager, no plugin asked (default: auto)")
    from fd_core.config import DEFAULT_MEMORY_FRACTION

    memory_help = (f"the share of each device's free memory for weights and KV cache, in (0, 1]; the cache's capacity "
                   f"(batch x context) is what the weights leave (default: {DEFAULT_MEMORY_FRACTION})")
    quantization_help = ("weight-only quantization of the linear layers and the LM head at load: wint8 (int8 "
                         "weights) or wint4 (4-bit), a scale per group of inputs (--quantization-group); a tied "
                         "embedding looks tokens up in the head's quantized table; norms, routers and vision towers "
                         "stay in the compute dtype (default: none)")
    float_help = "under --quantization, keep the embedding table and the LM head in the compute dtype"
    group_help = (f"inputs one scale of --quantization covers, or 0 for one scale per output channel (default: "
                  f"{', '.join(f'{g} for {s}' for s, g in DEFAULT_GROUPS.items())}; a weight whose inputs are no "
                  f"multiple of it is quantized per output channel)")
    threads_help = ("compute threads per rank (default: the platform's threads variable if the user set it "
                    "(fd explain names it), else the cores this process may use (affinity mask, cgroup quota) "
                    "shared among the ranks on this host)")

    p = sub.add_parser("help", help="show help for fd or for one command")
    p.add_argument("topic", nargs="?", default=None, metavar="COMMAND", help="a command (default: fd itself)")
    p.set_defaults(func=lambda args: _help(parser, sub, args.topic, commands or {}))

    p = sub.add_parser("plugins", help="list every discovered plugin, its hooks and its detection answer")
    p.add_argument("--json", action="store_true", help="print JSON instead of the listing")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("explain", help="show the chosen platform and the graph decision with every vote", **models)
    p.add_argument("--model", default=None, metavar="ARCH",
                   help="architecture name or alias (default: the checkpoint's, else ernie4_5)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a model directory, as fd run takes it: its config.json sizes the plan, no weight is read "
                        "(default: the --model preset)")
    p.add_argument("--tp", type=_positive, default=2, metavar="N",
                   help="tensor-parallel ranks, as fd run takes them (default: 2)")
    p.add_argument("--graph", choices=("auto", "on", "off"), default="auto", help=graph_help)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES,
                   help="compute dtype, as fd run takes it (default: the platform's preferred one)")
    p.add_argument("--quantization", default=None, choices=tuple(SCHEMES), help=quantization_help)
    p.add_argument("--quantization-group", type=int, default=None, metavar="N", help=group_help)
    p.add_argument("--float-embeddings", action="store_true", help=float_help)
    p.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION, metavar="F", help=memory_help)
    p.add_argument("--threads", type=_positive, default=None, metavar="N", help=threads_help)
    _cache_options(p)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("run", help="run a model: load, clean, decide, capture, generate", **models)
    p.add_argument("--model", default=None, metavar="ARCH",
                   help="architecture name or alias (default: the checkpoint's, else ernie4_5)")
    p.add_argument("--tp", type=_positive, default=None, metavar="N",
                   help="tensor-parallel ranks (default: 2; under a launcher, its world size)")
    p.add_argument("--max-new-tokens", "--steps", dest="steps", type=_positive, default=16, metavar="N",
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
    p.add_argument("--top-k", type=_non_negative, default=None, metavar="K",
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
    p.add_argument("--min-tokens", type=_non_negative, default=0, metavar="N",
                   help="generate at least N tokens before an end-of-sequence id may end a prompt (default: 0)")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="a picture for a VL model: PNG, JPEG, or .npy [3,H,W] in [0,1]; repeat for several, in the "
                        "order of their placeholders (default: none)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a checkpoint directory as transformers saves it: config.json, *.safetensors "
                        "(default: seeded random weights)")
    p.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES,
                   help="compute dtype (default: the platform's preferred one, the first it lists; see fd plugins)")
    p.add_argument("--quantization", default=None, choices=tuple(SCHEMES), help=quantization_help)
    p.add_argument("--quantization-group", type=int, default=None, metavar="N", help=group_help)
    p.add_argument("--float-embeddings", action="store_true", help=float_help)
    p.add_argument("--graph", choices=("auto", "on", "off"), default="auto", help=graph_help)
    p.add_argument("--reload-cycles", type=_non_negative, default=0, metavar="N",
                   help="weight-update cycles after the first run (default: 0)")
    p.add_argument("--seed", type=_non_negative, default=0, metavar="N",
                   help="seeds sampling and a preset's random weights (default: 0)")
    p.add_argument("--json", action="store_true",
                   help="print a machine-readable summary on stdout (text and ids per prompt)")
    p.add_argument("--rank-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                   help="how long to wait for the other ranks once one has failed (default: 30)")
    p.add_argument("--stall-timeout", type=_seconds, default=60.0, metavar="SECONDS",
                   help="how long a rank may go without progress (stuck in a collective, a hung plugin) before the run "
                        "stops (default: 60)")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="load weights holding NaN or Inf instead of refusing them (experiments only)")
    _canary_option(p)
    p.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION, metavar="F", help=memory_help)
    p.add_argument("--threads", type=_positive, default=None, metavar="N", help=threads_help)
    _cache_options(p)
    p.set_defaults(func=cmd_run)

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
    p.add_argument("--tp", type=_positive, default=1, metavar="N", help="tensor-parallel ranks (default: 1)")
    p.add_argument("--host", default="127.0.0.1", metavar="HOST",
                   help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=_int_at_least(0), default=8000, metavar="PORT",
                   help="port to listen on; 0 picks a free one (default: 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="refuse /v1 requests without the header 'Authorization: Bearer KEY' "
                        "(default: $FD_API_KEY, else no key)")
    p.add_argument("--max-queue", type=_positive, default=64, metavar="N",
                   help="most requests admitted at once (waiting or running); more get 503 with Retry-After "
                        "(default: 64)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, how long admitted requests may run on before they are cancelled "
                        "(default: 30)")
    p.add_argument("--image-root", action="append", default=None, metavar="DIR",
                   help="a directory whose files chat requests may name as pictures "
                        "(repeatable; default: none, data URLs only)")
    p.add_argument("--max-request-bytes", type=_positive, default=16 << 20, metavar="N",
                   help="largest request body taken; a larger one gets 413 before it is parsed "
                        "(default: 16777216, 16 MiB)")
    p.add_argument("--max-images", type=_non_negative, default=16, metavar="N",
                   help="most pictures one chat request may hold; more get 400 before any is read (default: 16)")
    p.add_argument("--max-pixels", type=_positive, default=64 * 1024 * 1024, metavar="N",
                   help="most pixels one chat request's pictures may hold together, counted from their headers "
                        "before each is decoded; more get 400 (default: 67108864)")
    p.add_argument("--header-timeout", type=_seconds, default=10.0, metavar="SECONDS",
                   help="how long a connection may take to send a request's headers before it gets 408 and is "
                        "closed (default: 10)")
    p.add_argument("--body-timeout", type=_seconds, default=60.0, metavar="SECONDS",
                   help="how long a request's body may take to arrive after its headers before it gets 408 "
                        "(default: 60)")
    p.add_argument("--max-connections", type=_positive, default=256, metavar="N",
                   help="most connections held open at once; one more gets 503 and is closed (default: 256)")
    p.add_argument("--grammar-timeout", type=_seconds, default=DEFAULT_GRAMMAR_TIMEOUT_S, metavar="SECONDS",
                   help="how long a request's response_format, guided_regex or tool choice may take to compile for "
                        "the model's tokens (off the event loop); longer gets 400 "
                        f"(default: {DEFAULT_GRAMMAR_TIMEOUT_S:g})")
    p.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES,
                   help="compute dtype (default: the platform's preferred one, the first it lists; see fd plugins)")
    p.add_argument("--quantization", default=None, choices=tuple(SCHEMES), help=quantization_help)
    p.add_argument("--quantization-group", type=int, default=None, metavar="N", help=group_help)
    p.add_argument("--float-embeddings", action="store_true", help=float_help)
    p.add_argument("--graph", choices=("auto", "on", "off"), default="auto", help=graph_help)
    p.add_argument("--seed", type=_non_negative, default=0, metavar="N",
                   help="seeds the tiny preset's random weights (default: 0)")
    p.add_argument("--rank-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                   help="how long to wait for the other ranks once one has failed (default: 30)")
    p.add_argument("--stall-timeout", type=_seconds, default=60.0, metavar="SECONDS",
                   help="how long a rank may go without progress before the server stops (default: 60)")
    _canary_option(p)
    p.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION, metavar="F", help=memory_help)
    p.add_argument("--threads", type=_positive, default=None, metavar="N", help=threads_help)
    _cache_options(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("check",
                       help="run the conformance suite against an installed platform (needs pytest: the [test] extra)")
    p.add_argument("platform", nargs="?", default=None, help="platform name (default: the active one)")
    p.add_argument("--model", default=None, metavar="ARCH",
                   help="run the model suite (tp, graph, clear, reload, reference) on this architecture instead "
                        "(default: none)")
    p.add_argument("-k", default=None, metavar="EXPR",
                   help="only checks matching this pytest -k expression (default: all)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="exit 0 when nothing failed but checks that need the hardware (or, with --model, the "
                        "reference) were skipped (default: exit 3)")
    p.add_argument("--json", action="store_true",
                   help="print JSON (every check, its outcome and detail, the verdict) instead of the table")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("save-random",
                       help="write a seeded random checkpoint in the published layout (safetensors + config.json)",
                       **models)
    p.add_argument("--model", default="ernie4_5", metavar="ARCH",
                   help="architecture whose tiny preset to use (default: ernie4_5)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a config.json to use instead of the preset, e.g. a published model's (default: none)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype the tensors are stored in (default: float32)")
    p.add_argument("--seed", type=_non_negative, default=0, metavar="N", help="seed of the random weights (default: 0)")
    p.add_argument("--tokenizer", action="store_true",
                   help="also write a small byte-level BPE tokenizer with a chat template (with picture tokens for a "
                        "model that takes pictures), so that text prompts, --chat, pictures, LLM and fd serve work "
                        "offline (the text is noise)")
    p.add_argument("directory", metavar="DIR", help="where to write it: a new or empty directory")
    p.set_defaults(func=cmd_save_random)

    for name, (summary, _run, owner) in sorted((commands or {}).items()):
        p = sub.add_parser(name, help=f"{summary} [from plugin {owner}]", add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _architecture_lines() -> list[str]:
    """One line per registered architecture for --help (empty if the plugins cannot be loaded: help still works)."""
    from fd_core.host.loading import load_plugins

    try:
        registry = load_plugins(strict=False).registry
    except FdError:
        return []
    width = max((len(a.name) for a in registry), default=0) + 2
    return [
        f"  {a.name:<{width}}{', '.join(a.aliases) or '-'}" + (" (vision-language)" if a.multimodal else "")
        for a in registry
    ]


def _help(
    parser: argparse.ArgumentParser, sub: Any, topic: str | None, commands: Mapping[str, tuple[str, Any, str]]
) -> int:
    if topic is not None and topic in commands:  # a plugin's command parses its own options, --help among them
        return int(commands[topic][1](["--help"]) or 0)
    if topic is None:
        parser.print_help(_stdout())
        return 0
    if topic not in sub.choices:
        raise ConfigError(f"no command {topic!r}; commands: {', '.join(sorted(sub.choices))}")
    sub.choices[topic].print_help(_stdout())
    return 0


def _plugin_commands(argv: Sequence[str]) -> dict[str, tuple[str, Any, str]]:
    """Subcommands plugins add; plugins are loaded only when argv does not start with one of fd's own."""
    from fd_core.host.loading import load_plugins

    if argv and argv[0] in CORE_COMMANDS and argv[0] != "help":  # fd help knows every command, plugins' too
        return {}
    try:
        return load_plugins(strict=False, reserved_commands=CORE_COMMANDS).commands
    except FdError:
        return {}  # fd's own commands report the problem; help and usage still work

@contextlib.contextmanager
def _settings_as_flags() -> Iterator[None]:
    """Messages from below the command line name a setting as its flag (fd_core.errors.setting), here and in the
    ranks."""
    held = os.environ.get(SETTINGS_STYLE_ENV)
    os.environ[SETTINGS_STYLE_ENV] = "cli"
    try:
        yield
    finally:
        if held is None:
            os.environ.pop(SETTINGS_STYLE_ENV, None)
        else:
            os.environ[SETTINGS_STYLE_ENV] = held


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # fd's own options come before the command; taken off first so that `fd -v bench ...` reaches the plugin's command.
    while argv[:1] and argv[0] in ("-v", "--verbose"):
        os.environ["FD_VERBOSE"] = "1"  # the ranks inherit it
        argv.pop(0)
    # A deprecated form of the contract a plugin uses is shown once (Python hides DeprecationWarning outside __main__).
    warnings.filterwarnings("default", category=DeprecationWarning, message=r".* is deprecated in fd's contract")
    commands = _plugin_commands(argv)
    try:
        if argv and argv[0] in commands:
            # A plugin's command parses its own options (argparse.REMAINDER would drop a leading --option).
            return int(commands[argv[0]][1](argv[1:]) or 0)
        wants_help = bool({"-h", "--help"} & set(argv)) or argv[:1] == ["help"]
        parser = build_parser(commands, _architecture_lines() if wants_help else ())
        args = parser.parse_args(argv)
        func: Callable[[argparse.Namespace], int] = args.func
        from fd_core.host.output import plugin_prints_to_stderr

        if args.command == "help":  # a plugin command's help is the plugin's own output
            return func(args)
        # What a plugin prints (at import, from a hook or a kernel, here or in a rank) must not mix with --json or the
        # text; errors below name the flags the user typed.
        with plugin_prints_to_stderr(), _settings_as_flags():
            return func(args)
    except FdError as exc:
        print(f"fd: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # `fd plugins --json | head` closed the pipe: not an error of ours.
        sys.stderr.close()
        return 0
    except OSError as exc:
        # The file system refused (permissions, a full disk, a name too long, a path that is a file):
        # the path and the system's reason are what a user needs, not a traceback.
        where = f"{exc.filename}: " if exc.filename else ""
        with contextlib.suppress(OSError):
            print(f"fd: error: {where}{exc.strerror or exc}; check the path, its permissions and the free space",
                  file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        from fd_core.runtime.ranks.spawn import Terminated

        if isinstance(exc, Terminated):  # SIGTERM, SIGHUP or SIGQUIT while ranks ran: 128 + its number
            print(exc.message(), file=sys.stderr)
            return exc.exit_code
        print("fd: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
