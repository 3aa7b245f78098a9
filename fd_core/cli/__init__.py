"""The `fd` command: plugins | explain | run | serve | save-random | check | help, and the commands plugins add
(bench). One module per command holds its options and its code; main.py builds the parser and dispatches."""

from __future__ import annotations

from fd_core.cli.common import CORE_COMMANDS, CommandParser
from fd_core.cli.main import build_parser, main

__all__ = ["CORE_COMMANDS", "CommandParser", "build_parser", "main"]
