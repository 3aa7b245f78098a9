"""`fd`'s entry: the parser of every command (each command's module adds its own), help, the commands plugins add,
and the mapping of errors to one line and an exit code."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

from fd_core.cli import check, explain, plugins, run, save_random, serve
from fd_core.cli.common import CORE_COMMANDS, EXIT_INTERRUPTED, EXIT_USAGE, CommandParser, stdout
from fd_core.errors import SETTINGS_STYLE_ENV, ConfigError, FdError


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fd-backends")
    except PackageNotFoundError:
        return "unknown (not installed)"


VERBOSE_HELP = "let Paddle's own logs and warnings through (default: kept off the terminal; sets FD_VERBOSE=1)"


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
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser, metavar="COMMAND")
    models: dict[str, Any] = {
        "epilog": "architectures (--model takes a name or an alias):\n" + "\n".join(architectures)
        if architectures else None,
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }
    p = sub.add_parser("help", help="show help for fd or for one command")
    p.add_argument("topic", nargs="?", default=None, metavar="COMMAND", help="a command (default: fd itself)")
    p.set_defaults(func=lambda args: _help(parser, sub, args.topic, commands or {}))
    plugins.add_parser(sub)
    explain.add_parser(sub, models)
    run.add_parser(sub, models)
    serve.add_parser(sub, models)
    check.add_parser(sub)
    save_random.add_parser(sub, models)
    for own in (c for c in CORE_COMMANDS if c != "help"):  # `fd run -v` as `fd -v run`
        sub.choices[own].add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
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
        parser.print_help(stdout())
        return 0
    if topic not in sub.choices:
        raise ConfigError(f"no command {topic!r}; commands: {', '.join(sorted(sub.choices))}")
    sub.choices[topic].print_help(stdout())
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
        if getattr(args, "verbose", False):
            os.environ["FD_VERBOSE"] = "1"
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
