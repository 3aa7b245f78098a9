"""The cpu platform's thread policy (its fd_rank_start and fd_before_step): the plan's compute threads applied to
Paddle's thread pools (MKL's products, its OpenMP loops, Intel OpenMP's spin time) for each phase."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Mapping

from fd_core.lifecycle import RankContext

# The variable a user of a CPU build sets threads with; Paddle's import writes it as 1 when it is unset.
THREADS_ENV = "OMP_NUM_THREADS"
# OpenMP runtimes a Paddle build links (Intel's with MKL, GNU's otherwise), as their sonames.
OPENMP_LIBRARIES = ("libiomp5.so", "libgomp.so.1")


def users_threads_env(env: Mapping[str, str] | None = None, paddle_imported: bool | None = None) -> str | None:
    """THREADS_ENV when the user set it (Detection.threads_env), else None: a "1" found after paddle was imported is
    paddle's own, not the user's."""
    env = os.environ if env is None else env
    imported = "paddle" in sys.modules if paddle_imported is None else paddle_imported
    raw = env.get(THREADS_ENV, "").strip()
    return THREADS_ENV if raw and not (imported and raw == "1") else None


def openmp_loops(env: Mapping[str, str] | None = None) -> int:
    """Threads of Paddle's own OpenMP loops (elementwise ops, norms, cache writes): the user's THREADS_ENV, else 1. On
    a decode step's small tensors a second OpenMP thread costs more than it gives (docs/benchmarks.md measures it)."""
    raw = (os.environ if env is None else env).get(THREADS_ENV, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def phase_threads(rank: RankContext, rows: int | None) -> int:
    """MKL's threads for one phase: a decode step of one row on 1 (its kernels still get rank.threads, through
    fd_core.kernels.compute_threads), a prefill (`rows` None) or a wider step on rank.threads; a count the user chose,
    in every phase.

    MKL ran a one-row matrix-vector product on one thread whatever it was given on the machine docs/benchmarks.md
    measures: a second MKL thread only woke for attention's small products, which it slowed (the thread asleep
    between them: KMP_BLOCKTIME). The rank's threads go to the kernels that split a one-row product themselves.
    """
    if rows == 1 and rank.threads > 1 and not rank.threads_chosen:
        return 1
    return rank.threads


def apply_threads(count: int, openmp: int | None = None) -> None:
    """Set this process's MKL threads to `count` and the calling thread's OpenMP loops to `openmp` (default
    openmp_loops()); a forked rank inherits its parent's setting."""
    from paddle.base import core

    openmp = openmp_loops() if openmp is None else openmp
    core.set_num_threads(count)
    if openmp != count:
        set_openmp_threads(openmp)
    if count > 1 and "KMP_BLOCKTIME" not in os.environ:
        # Intel's OpenMP keeps an idle worker spinning for 200 ms after each parallel region: a core
        # taken from the host's other processes (a peer rank among them) between every matrix
        # product. Sleeping at once measured faster on a shared host (docs/benchmarks.md, "Threads").
        runtime = openmp_runtime()
        if runtime is not None and hasattr(runtime, "kmp_set_blocktime"):
            runtime.kmp_set_blocktime(0)


def limit_numpy_blas(count: int) -> bool:
    """Run numpy's BLAS (the cpu attention kernel's products, fd_plugins.cpu.attention) on `count` threads; False
    without threadpoolctl (the cpu extra installs it).

    Its OpenBLAS threads otherwise start as many as there are cores and contend with Paddle's OpenMP workers between
    ops: eight rows' attention over 300 positions took 7 ms a layer that way against 1 ms on one thread.
    """
    controller = _blas_controller()
    if controller is None:
        return False
    found = controller.select(internal_api="openblas")
    found.limit(limits=count)
    return bool(found.lib_controllers)


@functools.cache
def _blas_controller() -> Any:
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return ThreadpoolController()


_runtime: list[Any] = []  # the runtime once found (it stays loaded): every phase asks for it


def openmp_runtime() -> Any:
    """The OpenMP runtime already loaded in this process (ctypes), None if none is: never loads a second one."""
    import ctypes

    if _runtime:
        return _runtime[0]
    for name in OPENMP_LIBRARIES:
        try:
            _runtime.append(ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL))
            return _runtime[0]
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
