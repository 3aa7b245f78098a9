"""An exception as the one line fd reports: the informative line of a multi-line message (Paddle's static-graph and
C++ reports open with boilerplate), and the likely cause fd attached to it (add_hint)."""

from __future__ import annotations

import re

# First lines that open a report whose informative line comes later: Paddle's static-graph (dy2static) wrapper, the
# Python and C++ tracebacks, Paddle's summary heading.
_HEADERS = frozenset({
    "In transformed code:", "In user code:", "Traceback (most recent call last):",
    "C++ Traceback (most recent call last):", "Error Message Summary:",
})
# An exception as a traceback's last line states it ("ValueError: ...", "paddle.base.core.InvalidArgumentError: ...").
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception|Exit|Interrupt))(?::\s|$)")
# A report's furniture, never its informative line: rules, source positions and markers, Paddle's notes, C++ frames.
_FURNITURE = re.compile(r"^(?:[-=~^*]+|File \".*|.*<--- HERE|\[Hint: .*|\[operator <.*|\d+\s+\S.*)$")
_HINT = "fd_hint"


def _informative(text: str) -> tuple[str, bool] | None:
    """informative_line's answer, and whether it is a report's exception line (which names its own type)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    lines = [line for line in lines if line and not re.fullmatch(r"[-=~^*\s]+", line)]
    if not lines:
        return None
    if lines[0] not in _HEADERS:
        return lines[0], False
    for line in reversed(lines[1:]):
        match = _EXCEPTION.match(line)
        if match is not None:
            return match.group(1) + line[match.end(1):], True  # "paddle.base.core.XError: ..." -> "XError: ..."
    meaningful = [line for line in lines[1:] if not _FURNITURE.match(line)]
    return (meaningful[-1] if meaningful else lines[0]), False


def informative_line(text: str) -> str | None:
    """The line of a message (or a traceback) that says what went wrong: the first, unless it opens a report; then
    the report's last exception line (the error itself, after the traceback-like lines), else its last line that is
    not furniture. None for an empty text."""
    found = _informative(text)
    return None if found is None else found[0]


def error_line(exc: BaseException) -> str:
    """`Type: the informative line of its message` (a report's own exception line as it states it), then the likely
    cause fd attached (add_hint), if any."""
    name = type(exc).__name__
    found = _informative(str(exc))
    line = name if found is None else found[0] if found[1] else f"{name}: {found[0]}"
    hint = getattr(exc, _HINT, None)
    return f"{line}; {hint}" if isinstance(hint, str) and hint else line


def add_hint(exc: BaseException, hint: str) -> None:
    """Attach what a failure likely means and its fix to `exc`, for error_line to append to its one line."""
    try:
        setattr(exc, _HINT, hint)
    except (AttributeError, TypeError):  # an exception type without attributes of its own: its line goes without
        pass
