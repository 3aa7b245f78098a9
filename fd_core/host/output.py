"""fd's own output kept apart from what plugins print: the real stdout for fd, stderr for everything else."""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Iterator, TextIO

# The stdout fd's own output goes to while plugin_prints_to_stderr is in effect, and whether it is
# (the real stdout is None when the process was started with file descriptor 1 closed).
_fd_stdout: TextIO | None = None
_redirected = False


def fd_stdout() -> TextIO:
    """Where fd writes its own output (--json, the generated text, reports): the real stdout, even while
    plugin_prints_to_stderr sends what everything else prints to stderr."""
    return _fd_stdout if _redirected and _fd_stdout is not None else sys.stdout


def fd_stdout_closed() -> bool:
    """Whether the process has no stdout to write fd's output to (started with it closed)."""
    return (_fd_stdout if _redirected else sys.stdout) is None


@contextlib.contextmanager
def plugin_prints_to_stderr() -> Iterator[TextIO]:
    """While fd runs one of its commands, what a plugin prints (at import, from a hook, a kernel, a
    thread) goes to stderr, so that `--json` and the text on stdout are fd's alone; fd writes its own
    output to fd_stdout(), which this yields. Ranks forked meanwhile inherit the arrangement."""
    global _fd_stdout, _redirected
    if _redirected:  # already in effect (a rank forked from a command)
        yield fd_stdout()
        return
    lines = _WholeLines(sys.stderr)
    _fd_stdout, sys.stdout, _redirected = sys.stdout, lines, True
    try:
        yield fd_stdout()
    finally:
        lines.flush()
        sys.stdout, _fd_stdout, _redirected = _fd_stdout, None, False


class _WholeLines(io.TextIOBase):
    """Text for `stream` passed on a whole line at a time, in one write: the ranks of a run share stderr, and under
    PYTHONUNBUFFERED (write-through) print's text and its newline are two writes, between which another rank's
    line could land."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            done, _, self.pending = self.pending.rpartition("\n")
            self.stream.write(done + "\n")
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.stream.write(self.pending)
            self.pending = ""
        self.stream.flush()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self.stream, "encoding", "utf-8"))
