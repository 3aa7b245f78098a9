"""Registers `fd bench` through the fd_register_commands hook, so that fd_core imports no benchmark code."""

from __future__ import annotations

from typing import Callable

from fd_core import hookimpl

# The version of fd's plugin contract this plugin was written for (fd_core.contract).
FD_CONTRACT = "1.1"


def _run(args: list[str]) -> int:
    from fd_bench import main

    return main(args)


@hookimpl
def fd_register_commands(register: Callable[..., None]) -> None:
    """Add `fd bench` (its options are the benchmark runner's own; see docs/benchmarks.md)."""
    register("bench", "benchmarks of the plugin layer and the models (see docs/benchmarks.md)", _run)
