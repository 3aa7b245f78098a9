"""`fd check`: the conformance suite (or, with --model, the model suite) on an installed platform, as a table or
JSON, with fd's exit codes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fd_core.cli.common import EXIT_INTERRUPTED, EXIT_NOT_VERIFIED, print_json, require_paddle, stdout
from fd_core.errors import ConfigError, FdError, install_hint


def add_parser(sub: Any) -> None:
    """The command and its options."""
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

    require_paddle()
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
    elif unverified:
        # A check that could not run for another reason than absent hardware (no reference, no case of its kernels
        # in the platform's dtypes) is named by its own reason.
        reasons = [r.detail for r in unverified if "hardware not detected here" not in r.detail]
        if reasons or model is not None:
            verdict = (
                f"not verified: {len(unverified)} check(s) could not run here "
                f"({(reasons or [unverified[0].detail])[0].removeprefix('not verified: ')})"
            )
        else:
            verdict = f"not verified: {len(unverified)} check(s) need {platform}'s hardware, which is not here"
        status = 0 if args.allow_unverified else EXIT_NOT_VERIFIED
    else:
        verdict, status = "passed", 0
    names = [r.check.rsplit("::", 1)[-1] for r in table.rows]
    ordered = sorted(zip(names, table.rows, strict=True), key=lambda pair: pair[0])
    if args.json:
        rows = [{"check": name, "outcome": row.outcome, "detail": row.detail,
                 "third_party": name.split("[")[0] in THIRD_PARTY_CHECKS} for name, row in ordered]
        print_json({"platform": platform, **({"model": model} if model else {}), "checks": rows, "counts": counts,
                     "verdict": verdict, "exit_code": status, "deprecations": deprecations()})
        return status
    # One row a check, never wrapped, so that grep finds a check with its outcome and detail
    # (pytest's own summary lines are the same); --json is the form to parse.
    width = max(map(len, names), default=10)
    print(
        f"conformance of model {model!r} on platform {platform!r}:" if model
        else f"conformance of platform {platform!r}:",
        file=stdout(),
    )
    for name, row in ordered:
        print(f"  {row.outcome:<8} {name:<{width}}  {row.detail}".rstrip(), file=stdout())
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped", file=stdout())
    print(f"verdict: {verdict}", file=sys.stderr if verdict.startswith("interrupted") else stdout())
    for note in deprecations():  # works today; a plugin's author has until the named version to change it
        print(f"deprecated: {note}", file=stdout())
    return status
