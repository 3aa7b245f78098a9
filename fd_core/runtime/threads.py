"""Compute threads per rank: how many (decided once, in the plan) and how they are applied to Paddle's
thread pools (MKL's products, its OpenMP loops, Intel OpenMP's spin time) for each phase.

This is the host platform's policy, gathered here with one entry point the engine calls
(`apply_phase`) until the rank lifecycle hooks let the platform own it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from fd_core.errors import ConfigError, setting
from fd_core.kernels import set_compute_threads


@dataclass(frozen=True)
class Threads:
    """How many compute threads each rank runs, and why (plain data: it travels in the Plan)."""

    per_rank: int
    reason: str
    # Threads of Paddle's own OpenMP loops (elementwise ops, norms, cache writes); the matrix products
    # (MKL) take per_rank. 1 unless the user's OMP_NUM_THREADS asks for more: on a decode step's small
    # tensors a second OpenMP thread costs more than it gives (docs/benchmarks.md measures it).
    openmp: int = 1
    # Whether the user chose the count (--threads, OMP_NUM_THREADS): then every phase keeps it (phase_threads).
    chosen: bool = False
    # Threads a kernel may split one op across (fd_core.kernels.compute_threads); None: per_rank.
    kernels: int | None = None

    @property
    def for_kernels(self) -> int:
        return self.per_rank if self.kernels is None else self.kernels

    def to_dict(self) -> dict[str, Any]:
        one_row = phase_threads(self, 1)
        return {"per_rank": self.per_rank, "reason": self.reason, "openmp": self.openmp,
                "one_row_decode": one_row.per_rank, "one_row_decode_kernels": one_row.for_kernels}


THREADS_ENV = "OMP_NUM_THREADS"


def decide_threads(
    requested: int | None, ranks_on_host: int, cores: int, env: Mapping[str, str], paddle_imported: bool = False,
    cores_from: str = "",
) -> Threads:
    """Compute threads per rank: --threads, else the user's OMP_NUM_THREADS, else the usable cores shared among the
    host's ranks.

    `cores` is what the platform reports this process may use (Detection.host_cores: the affinity
    mask capped by the cgroup quota), else the affinity mask; `cores_from` says which. Paddle's
    import writes OMP_NUM_THREADS=1 when it is unset, so a "1" found after paddle was imported is
    paddle's, not the user's.
    """
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"{setting('threads')} must be >= 1, got {requested}")
        return Threads(requested, "--threads", chosen=True)
    raw = env.get(THREADS_ENV, "").strip()
    if raw and not (paddle_imported and raw == "1"):
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(
                f"{THREADS_ENV}={raw!r} is not a number of threads; set it to a positive integer or unset it"
            ) from None
        if value < 1:
            raise ConfigError(f"{THREADS_ENV}={raw!r} must be >= 1; set it to a positive integer or unset it")
        return Threads(value, THREADS_ENV, openmp=value, chosen=True)
    ranks = max(1, ranks_on_host)
    per_rank = max(1, max(1, cores) // ranks)
    return Threads(
        per_rank,
        f"{cores} usable core(s){f' ({cores_from})' if cores_from else ''}, shared by {ranks} rank(s) on this host",
    )


def apply_threads(threads: Threads) -> None:
    """Set this process's compute threads (Paddle's OpenMP and MKL pools; a forked rank inherits its parent's setting)
    and the calling thread's compute_threads() for kernels."""
    from paddle.base import core

    set_compute_threads(threads.for_kernels)
    core.set_num_threads(threads.per_rank)
    if threads.openmp != threads.per_rank:
        set_openmp_threads(threads.openmp)
    if threads.per_rank > 1 and "KMP_BLOCKTIME" not in os.environ:
        # Intel's OpenMP keeps an idle worker spinning for 200 ms after each parallel region: a core
        # taken from the host's other processes (a peer rank among them) between every matrix
        # product. Sleeping at once measured faster on a shared host (docs/benchmarks.md, "Threads").
        runtime = openmp_runtime()
        if runtime is not None and hasattr(runtime, "kmp_set_blocktime"):
            runtime.kmp_set_blocktime(0)


def apply_phase(threads: Threads, rows: int | None) -> None:
    """What the engine calls before each phase (a prefill: `rows` None; a decode step of `rows` cache rows): the
    phase's threads applied to this process's pools and the calling thread's kernels."""
    apply_threads(phase_threads(threads, rows))


def phase_threads(threads: Threads, rows: int | None) -> Threads:
    """The threads one phase computes on: a decode step of one cache row on one MKL thread, its kernels (a product
    split across threads) on all the plan gives; a prefill (`rows` None) or a wider decode step on all of them;
    a count the user chose, in every phase.

    MKL ran a one-row matrix-vector product on one thread whatever it was given on the machine
    docs/benchmarks.md measures: a second MKL thread only woke for attention's small products, which
    it slowed (docs/benchmarks.md, "Threads"; the thread asleep between them: KMP_BLOCKTIME). The rank's threads go
    to the kernels that split a one-row product themselves instead. `--threads` keeps its count where that differs.
    """
    if rows == 1 and threads.per_rank > 1 and not threads.chosen:
        return Threads(
            1, f"{threads.reason}; a one-row decode step's library products on 1", 1, kernels=threads.per_rank
        )
    return threads


# OpenMP runtimes a Paddle build links (Intel's with MKL, GNU's otherwise), as their sonames.
OPENMP_LIBRARIES = ("libiomp5.so", "libgomp.so.1")


def openmp_runtime() -> Any:
    """The OpenMP runtime already loaded in this process (ctypes), None if none is: never loads a second one."""
    import ctypes

    for name in OPENMP_LIBRARIES:
        try:
            return ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    return None


def set_openmp_threads(count: int) -> bool:
    """Limit the loaded OpenMP runtime to `count` threads; False if none is loaded.

    MKL keeps its own count (set by core.set_num_threads), so its products still run on every
    thread while Paddle's own OpenMP loops (norms, rotary, cache writes) run on `count`.
    """
    import ctypes

    runtime = openmp_runtime()
    if runtime is None:
        return False
    runtime.omp_set_num_threads(ctypes.c_int(count))
    return True
