"""What a platform declares it supports, so the conformance suite skips the rest with a reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Capabilities:
    """What the platform under test supports; a check it does not support skips with the reason."""

    # World sizes the platform runs all-reduce at on this host; 2 enables the multi-rank checks.
    world_sizes: tuple[int, ...] = (1, 2)
    # Dtypes its all-reduce sums; float32 is required of every platform.
    dtypes: tuple[str, ...] = ("float32",)
    # Whether it provides a graph backend (fd_graph_backend).
    graphs: bool = True
    # World sizes at which its graphs may capture an all-reduce ("graphs only at tp=1" is (1,)).
    graph_world_sizes: tuple[int, ...] = (1, 2)
    # Dtypes whose all-reduce its graphs capture (each is checked inside a captured graph at tp=2).
    graph_dtypes: tuple[str, ...] = ("float32",)
    # Whether all-reduce also leaves the result in the input tensor (the result is always returned).
    in_place: bool = False
    # Whether fd_clean_memory_fragments frees the tensors of the state dict it is given (device
    # platforms do; a host platform's allocator returns memory itself, so its cleanup may leave them).
    cleanup_releases_state: bool = False
    # Relative tolerance of the all-reduce sum, by dtype (overrides the defaults below): an element may
    # differ from the exact sum by rtol times the sum of the inputs' magnitudes.
    tolerances: Mapping[str, float] = field(default_factory=dict)

    def rtol(self, dtype: str) -> float:
        """The relative tolerance the sum of `dtype` is checked with: by default four units in the last place
        of the dtype (a sum rounded once, or summed wider and rounded back), exact for integers."""
        default = _DEFAULT_RTOL.get(dtype, 0.0)
        return float(self.tolerances.get(dtype, default))


# Four times each dtype's machine epsilon (2**-52, 2**-23, 2**-10, 2**-7).
_DEFAULT_RTOL = {"float64": 4 * 2.0**-52, "float32": 4 * 2.0**-23, "float16": 4 * 2.0**-10, "bfloat16": 4 * 2.0**-7}


def capabilities_of(module: object) -> Capabilities:
    """A platform module's declared `FD_CAPABILITIES`, or the defaults."""
    declared = getattr(module, "FD_CAPABILITIES", None)
    return declared if isinstance(declared, Capabilities) else Capabilities()
