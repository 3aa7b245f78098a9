"""The paged cache cases of the suite and the canary (kernel_checks.CACHE_CASES) against kernels that are right on
small cases and wrong on real-sized ones: each must differ from the native ops on some case. The kernels are the
native ops with one slip each, as a vendor's tiled kernel might make it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import paddle
import pytest

from fd_core import native_ops
from fd_core.runtime.kernel_checks import CACHE_CASES, cache_layout, run_cache_case


def _drops_last_partial_partition(q: Any, k: Any, v: Any, tables: Any, lens: Any) -> Any:
    """Decode attention in 128-position partitions that forgets a partial last one past the first."""
    cut = paddle.where(lens > 128, lens - lens % 128, lens)
    return native_ops.paged_attention(q, k, v, tables, cut)


def _longest_past_four_rows(q: Any, k: Any, v: Any, tables: Any, lens: Any) -> Any:
    """Decode attention that, past a 4-row tile, attends every row to the longest row's length."""
    if int(q.shape[0]) > 4:
        lens = paddle.full_like(lens, int(lens.max()))
    return native_ops.paged_attention(q, k, v, tables, lens)


def _causal_off_past_64(q: Any, k: Any, v: Any, tables: Any, prefix: Any) -> Any:
    """Prefill attention whose queries past a 64-query tile see one position too many."""
    if int(q.shape[1]) <= 64:
        return native_ops.paged_prefill_attention(q, k, v, tables, prefix)
    head = native_ops.paged_prefill_attention(q[:, :64], k, v, tables, prefix)
    tail = native_ops.paged_prefill_attention(q[:, 64:], k, v, tables, prefix + 65)
    return paddle.concat([head, tail], axis=1)


def _one_block_short(blocks: int, block_size: int, kv_heads: int, dim: int, dtype: str) -> Any:
    """A pool one block short, whose kernels clamp a block past its end to the last block they have (as a kernel that
    clamps its indices would; Paddle's CPU index_put_ would write out of bounds instead)."""
    return native_ops.allocate_kv_cache(blocks - 1, block_size, kv_heads, dim, dtype)


def _clamped_write(key: Any, value: Any, k: Any, v: Any, slots: Any) -> Any:
    size = int(k.shape[2])
    block = paddle.clip(slots // size, max=int(k.shape[1]) - 1)
    return native_ops.write_kv_cache(key, value, k, v, block * size + slots % size)


def _clamped(op: str) -> Any:
    def kernel(q: Any, k: Any, v: Any, tables: Any, *rest: Any) -> Any:
        return getattr(native_ops, op)(q, k, v, paddle.clip(tables, max=int(k.shape[1]) - 1), *rest)

    return kernel


def _ops(**changed: Any) -> SimpleNamespace:
    names = ("allocate_kv_cache", "write_kv_cache", "paged_attention", "paged_prefill_attention",
             "paged_packed_attention")
    return SimpleNamespace(**{n: changed.get(n, getattr(native_ops, n)) for n in names})


def _failing(ops: SimpleNamespace) -> list[str]:
    failing = []
    for index, case in enumerate(CACHE_CASES):
        want = run_cache_case(_ops(), case, "float32", 2, 4, 16, seed=index)
        try:
            got = run_cache_case(ops, case, "float32", 2, 4, 16, seed=index)
        except Exception:  # noqa: BLE001 - a kernel that raises on a case fails it
            failing.append(case.name)
            continue
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            failing.append(case.name)
    return failing


def test_the_real_sized_cases_use_every_block_of_their_pools() -> None:
    for case in CACHE_CASES[-2:]:
        tables, _, _ = cache_layout(case, seed=0)
        assert set(np.unique(tables)) == set(range(case.blocks)), case.name


@pytest.mark.parametrize("slip", [
    {"paged_attention": _drops_last_partial_partition},
    {"paged_attention": _longest_past_four_rows},
    {"paged_prefill_attention": _causal_off_past_64},
    {"allocate_kv_cache": _one_block_short, "write_kv_cache": _clamped_write,
     "paged_attention": _clamped("paged_attention"), "paged_prefill_attention": _clamped("paged_prefill_attention"),
     "paged_packed_attention": _clamped("paged_packed_attention")},
], ids=["partial-partition", "longest-past-4-rows", "causal-past-64", "pool-one-short"])
def test_a_slip_only_real_sizes_show_fails_a_case(slip: dict[str, Any]) -> None:
    failing = _failing(_ops(**slip))
    assert failing, "no case failed"
    assert all("whole pool" in name or "hundreds" in name for name in failing), failing
