"""The server's own log on stderr, one line a message."""

from __future__ import annotations

import sys


def log(message: str) -> None:
    """One line on stderr: the server's own log (uvicorn's access log is off)."""
    # One write with its newline: a script reading the lines (the ready line) never sees half of one.
    sys.stderr.write(f"fd serve: {message}\n")
    sys.stderr.flush()
