"""A throwaway platform whose all-reduce returns at once, and a tracing wrapper: the dispatch rows' plugins.

Registered in-process only, through `load_plugins(env, extra=[...])`; never installed.
"""

from __future__ import annotations

from typing import Any

from fd_core import Detection, hookimpl

NAME = "benchplat"


@hookimpl
def fd_platform_detect() -> Detection:
    """Never chosen on its own: selected with FD_PLATFORM=benchplat."""
    return Detection(detected=False, priority=-100, reason="benchmark-only platform", dist_backend="gloo")


@hookimpl
def fd_all_reduce(tensor: Any, group: Any) -> Any:
    """A collective that returns at once: what is left is the cost of reaching it."""
    return tensor
