"""What every `fd` command shares: the exit codes, the usage-error parser, the argparse types, fd's own stdout and
the wrapping of human output, and the check that Paddle is installed."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any, Callable, NoReturn, Sequence, TextIO

from fd_core.errors import FdError

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


def int_at_least(minimum: int) -> Callable[[str], int]:
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


positive = int_at_least(1)
non_negative = int_at_least(0)


def seconds(text: str) -> float:
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


def stdout() -> TextIO:
    """fd's own output: the real stdout, while what plugins print goes to stderr (see
    fd_core.host.output.plugin_prints_to_stderr)."""
    from fd_core.host.output import fd_stdout

    return fd_stdout()


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False), file=stdout())


WIDTH = 100  # human output wraps here; --json is the form for wider needs


def wrapped(text: str, indent: int, hang: int = 0) -> list[str]:
    """`text` indented by `indent` and wrapped at WIDTH, continuation lines `hang` further in."""
    import textwrap

    return textwrap.wrap(text, WIDTH, initial_indent=" " * indent, subsequent_indent=" " * (indent + hang),
                         break_long_words=False, break_on_hyphens=False) or [" " * indent]


def fit(lines: Sequence[str]) -> str:
    """Report lines wrapped at WIDTH: a line's continuation sits four columns in from where it starts,
    deeper than the two-column sub-lines (votes, other platforms) so that it never reads as one of them."""
    out: list[str] = []
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        out += wrapped(line.strip(), indent, 4) if len(line) > WIDTH else [line]
    return "\n".join(out)


def require_paddle() -> None:
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

