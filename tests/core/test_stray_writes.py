"""The read-back check's stray-write part (kernel_checks.stray_write_problem), on the native cache ops and on
deliberately broken writes: a write that also touches the slot after each token, or rounds a step up to a tile, must be
named; the native write must pass."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import paddle
import pytest

from fd_core import native_ops
from fd_core.runtime.kernel_checks import read_back_problem


def _ops(write: Callable[..., None]) -> SimpleNamespace:
    return SimpleNamespace(allocate_kv_cache=native_ops.allocate_kv_cache, write_kv_cache=write,
                           read_kv_cache=native_ops.read_kv_cache)


def _next_slot_too(key: Any, value: Any, k_cache: Any, v_cache: Any, slots: Any) -> None:
    """Writes each token, then zeros at the slot after each (within the pool)."""
    native_ops.write_kv_cache(key, value, k_cache, v_cache, slots)
    pool = k_cache.shape[1] * k_cache.shape[2]
    after = paddle.clip(slots + 1, max=pool - 1)
    native_ops.write_kv_cache(paddle.zeros_like(key), paddle.zeros_like(value), k_cache, v_cache, after)


def _tile_of_four(key: Any, value: Any, k_cache: Any, v_cache: Any, slots: Any) -> None:
    """A step of fewer than 4 tokens writes a tile of 4: its tokens, then copies of its last token after them."""
    native_ops.write_kv_cache(key, value, k_cache, v_cache, slots)
    tokens = int(slots.shape[0])
    if tokens < 4:
        pool = k_cache.shape[1] * k_cache.shape[2]
        rest = paddle.clip(slots[-1:] + paddle.arange(1, 5 - tokens, dtype="int64"), max=pool - 1)
        last = paddle.concat([key[-1:]] * int(rest.shape[0]))
        native_ops.write_kv_cache(last, paddle.concat([value[-1:]] * int(rest.shape[0])), k_cache, v_cache, rest)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_write_passes(dtype: str) -> None:
    for seed, (kv_heads, dim, blocks, block_size) in enumerate(((2, 16, 9, 4), (1, 8, 4, 16), (3, 64, 3, 64))):
        assert read_back_problem(_ops(native_ops.write_kv_cache), dtype, kv_heads, dim, blocks, block_size,
                                 seed) is None


def test_a_write_outside_its_slots_is_named() -> None:
    """A tile rounded up only in steps of few tokens: the whole pool written at once reads back right, so only the
    rewrite in decode-sized calls sees it."""
    problem = read_back_problem(_ops(_tile_of_four), "float32", 2, 16, 9, 4, seed=0)
    assert problem is not None and problem.startswith("write_kv_cache given slots") and "other slot" in problem, \
        problem


def test_a_write_that_always_spills_fails_the_read_back_already() -> None:
    problem = read_back_problem(_ops(_next_slot_too), "float32", 2, 16, 9, 4, seed=0)
    assert problem is not None and "differ from what was written" in problem, problem
