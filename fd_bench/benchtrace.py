"""A tracing extension: a new-style pluggy wrapper around fd_all_reduce that counts calls."""

from __future__ import annotations

from typing import Any, Generator

from fd_core import hookimpl

NAME = "benchtrace"
CALLS = [0]


@hookimpl(wrapper=True)
def fd_all_reduce(tensor: Any, group: Any) -> Generator[None, Any, Any]:
    """Count the call and pass the result through."""
    CALLS[0] += 1
    result = yield
    return result
