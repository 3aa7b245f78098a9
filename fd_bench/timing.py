"""Interleaved A/B timing: warm-up, alternating batches, medians (perf_counter_ns throughout)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

# A side of a comparison: run `n` operations, return the elapsed nanoseconds.
Batch = Callable[[int], int]


@dataclass
class Samples:
    """Per-operation nanoseconds of every timed batch of one side."""

    per_op_ns: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.per_op_ns)

    @property
    def spread(self) -> tuple[float, float]:
        """(25th, 75th) percentile: how noisy the batches were."""
        if len(self.per_op_ns) < 4:
            return min(self.per_op_ns), max(self.per_op_ns)
        q = statistics.quantiles(self.per_op_ns, n=4)
        return q[0], q[2]


def interleave(sides: dict[str, Batch], ops: int, batches: int, warmup: int = 3) -> dict[str, Samples]:
    """Run every side's batch of `ops` operations in turn, `batches` times, alternating the order.

    Round i runs the sides in order when i is even and reversed when i is odd, so neither side
    always follows the other (caches, frequency steps and neighbours' load hit both alike).
    """
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            sides[name](ops)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(batches):
        for name in names if i % 2 == 0 else reversed(names):
            out[name].append(sides[name](ops) / ops)
    return {n: Samples(v) for n, v in out.items()}
