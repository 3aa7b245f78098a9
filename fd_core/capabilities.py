"""What a platform declares it supports, so the conformance suite skips the rest with a reason."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What the platform under test supports; a check it does not support skips with the reason."""

    # World sizes the platform runs all-reduce at on this host; 2 enables the multi-rank checks.
    world_sizes: tuple[int, ...] = (1, 2)
    # Dtypes its all-reduce sums; float32 is required of every platform.
    dtypes: tuple[str, ...] = ("float32",)
    # Whether it provides a graph backend (fd_graph_backend).
    graphs: bool = True
    # Whether all-reduce also leaves the result in the input tensor (the result is always returned).
    in_place: bool = False


def capabilities_of(module: object) -> Capabilities:
    """A platform module's declared `FD_CAPABILITIES`, or the defaults."""
    declared = getattr(module, "FD_CAPABILITIES", None)
    return declared if isinstance(declared, Capabilities) else Capabilities()
