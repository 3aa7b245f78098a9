"""A one-row decode step computes on one MKL thread and gives the plan's threads to the kernels that split a product
(fd_core.kernels.compute_threads), a prefill and a wider step on the plan's: read from MKL itself and from the kernel's
own view inside each phase (the engine sets the kernels' count, the cpu platform's fd_before_step MKL's; MKL does not thread a one-row product, docs/benchmarks.md)."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from fd_core.host.backend import load_backend
from fd_core.kernels import compute_threads
from fd_core.lifecycle import RankContext
from fd_core.runtime.engine.loop import Engine
from fd_core.runtime.engine.runner import ModelRunner
from fd_core.runtime.plan import model_config_for
from fd_core.runtime.request import Request
from fd_plugins.cpu.threads import apply_threads


def mkl_threads() -> int:
    """What MKL will run its next product on, asked of the MKL library this process loaded."""
    import paddle

    paddle.matmul(paddle.ones([2, 2]), paddle.ones([2, 2]))  # paddle loads MKL at its first product
    paths = {line.split()[-1] for line in open("/proc/self/maps") if "libmklml" in line or "libmkl_rt" in line}
    if not paths:
        pytest.skip("this paddle build links no MKL")
    return int(ctypes.CDLL(sorted(paths)[0]).MKL_Get_Max_Threads())


def test_one_row_decodes_on_one_thread_and_prefill_and_two_rows_on_the_plans() -> None:
    backend = load_backend(env={"FD_PLATFORM": "cpu"})
    arch = backend.plugins.registry.get("ernie4_5")
    runner = ModelRunner(backend, arch, model_config_for(arch, None), seed=0, graph="off")
    runner.load()
    runner.decide()
    model = runner.model
    seen: list[tuple[Any, ...]] = []
    prefill, decode = model.prefill, model.decode_step

    def timed_prefill(*args: Any, **kwargs: Any) -> Any:
        seen.append(("prefill", mkl_threads(), compute_threads()))
        return prefill(*args, **kwargs)

    def timed_decode(tokens: Any, batch: Any) -> Any:
        seen.append(("decode", batch.rows, mkl_threads(), compute_threads()))
        return decode(tokens, batch)

    model.prefill, model.decode_step = timed_prefill, timed_decode
    try:
        alone = Engine(runner, rank=RankContext(threads=2)).generate(Request.greedy([[5, 6, 7]], 3))
        assert seen == [("prefill", 2, 2), ("decode", 1, 1, 2), ("decode", 1, 1, 2)]
        seen.clear()
        Engine(runner, rank=RankContext(threads=2)).generate(Request.greedy([[5, 6, 7], [8, 9]], 3))
        assert seen == [("prefill", 2, 2), ("decode", 2, 2, 2), ("decode", 2, 2, 2)]
        # What it computes is the same on either count.
        seen.clear()
        again = Engine(runner, rank=RankContext(threads=1)).generate(Request.greedy([[5, 6, 7]], 3))
        assert [c.token_ids for c in again] == [c.token_ids for c in alone] and seen[0] == ("prefill", 1, 1)
    finally:
        apply_threads(1)
