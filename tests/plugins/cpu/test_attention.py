"""The cpu platform's paged KV cache kernels (fd_plugins/cpu/attention.py), run for real against an oracle computed
another way: a loop over rows, heads and positions that reads each position's block from the table by hand."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from fd_core import native_ops
from fd_plugins.cpu import attention

RNG = np.random.default_rng(11)
KV_HEADS, HEADS, DIM, BLOCK, BLOCKS = 2, 8, 16, 4, 40


def _caches() -> tuple[paddle.Tensor, paddle.Tensor]:
    shape = (KV_HEADS, BLOCKS, BLOCK, DIM)
    return (paddle.to_tensor(RNG.standard_normal(shape).astype("float32")),
            paddle.to_tensor(RNG.standard_normal(shape).astype("float32")))


def _oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, tables: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """q [B, S, h, d]; query (b, s) sees positions below limits[b, s], position p at block tables[b, p // BLOCK]."""
    batch, length, heads, dim = q.shape
    out = np.zeros((batch, length, heads, dim))
    for b in range(batch):
        for s in range(length):
            for h in range(heads):
                kv = h // (heads // KV_HEADS)
                seen = range(int(limits[b, s]))
                keys = np.array([k[kv, tables[b, p // BLOCK], p % BLOCK] for p in seen], dtype=np.float64)
                values = np.array([v[kv, tables[b, p // BLOCK], p % BLOCK] for p in seen], dtype=np.float64)
                scores = keys @ q[b, s, h].astype(np.float64) / math.sqrt(dim)
                weights = np.exp(scores - scores.max())
                out[b, s, h] = (weights / weights.sum()) @ values
    return out


def _tables(batch: int, width: int) -> np.ndarray:
    # Blocks scattered over the cache in no order (block 0 is the null block).
    return (1 + RNG.permutation(BLOCKS - 1)[: batch * width]).reshape(batch, width).astype(np.int64)


def test_decode_attention_over_rows_of_different_lengths_equals_the_oracle() -> None:
    k, v = _caches()
    tables = _tables(5, 6)
    lens = np.array([1, 7, 24, 13, 4], dtype=np.int64)
    q = RNG.standard_normal((5, HEADS, DIM)).astype("float32")
    got = attention.paged_attention(paddle.to_tensor(q), k, v, paddle.to_tensor(tables), paddle.to_tensor(lens))
    want = _oracle(q[:, None], k.numpy(), v.numpy(), tables, lens[:, None])[:, 0]
    assert got.dtype == paddle.float32 and list(got.shape) == [5, HEADS, DIM]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_prefill_attention_after_a_cached_prefix_equals_the_oracle() -> None:
    k, v = _caches()
    tables = _tables(3, 5)
    prefixes = np.array([0, 9, 14], dtype=np.int64)
    q = RNG.standard_normal((3, 6, HEADS, DIM)).astype("float32")
    got = attention.paged_prefill_attention(paddle.to_tensor(q), k, v, paddle.to_tensor(tables),
                                            paddle.to_tensor(prefixes))
    want = _oracle(q, k.numpy(), v.numpy(), tables, prefixes[:, None] + np.arange(1, 7)[None, :])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_packed_rows_of_any_lengths_equal_the_oracle() -> None:
    """Decode rows (one token) beside prefill chunks after prefixes, packed end to end: each token as the oracle
    attends it, at its own position through its row's table."""
    k, v = _caches()
    tables = _tables(4, 6)
    counts, contexts = [1, 5, 1, 3], [9, 14, 24, 3]
    q = RNG.standard_normal((sum(counts), HEADS, DIM)).astype("float32")
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    got = attention.paged_packed_attention(paddle.to_tensor(q), k, v, paddle.to_tensor(tables),
                                           paddle.to_tensor(bounds), paddle.to_tensor(np.asarray(contexts)))
    for row, (count, context) in enumerate(zip(counts, contexts, strict=True)):
        limits = np.arange(context - count + 1, context + 1)[None, :]
        want = _oracle(q[None, bounds[row]:bounds[row + 1]], k.numpy(), v.numpy(), tables[row:row + 1], limits)[0]
        np.testing.assert_allclose(got.numpy()[bounds[row]:bounds[row + 1]], want, rtol=1e-5, atol=1e-5)


def test_a_padding_row_that_sees_nothing_is_finite_and_leaves_the_others_alone() -> None:
    """A padding row (the null block, no positions) gets even weights as the native op gives it, never NaN."""
    k, v = _caches()
    tables = np.array([[0, 0], [3, 5]], dtype=np.int64)
    lens = np.array([0, 6], dtype=np.int64)
    q = paddle.to_tensor(RNG.standard_normal((2, HEADS, DIM)).astype("float32"))
    args = (k, v, paddle.to_tensor(tables), paddle.to_tensor(lens))
    got = attention.paged_attention(q, *args).numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, native_ops.paged_attention(q, *args).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], _oracle(q.numpy()[1:, None], k.numpy(), v.numpy(), tables[1:],
                                               lens[1:, None])[0, 0], rtol=1e-5, atol=1e-5)


def test_the_cache_write_puts_each_token_at_its_slot_in_place() -> None:
    k, v = _caches()
    before_k, before_v = k.numpy().copy(), v.numpy().copy()
    slots = np.array([5, 17, 0, 42, 43], dtype=np.int64)  # slot 0: a padding token's, in the null block
    key = RNG.standard_normal((5, KV_HEADS, DIM)).astype("float32")
    value = RNG.standard_normal((5, KV_HEADS, DIM)).astype("float32")
    attention.write_kv_cache(paddle.to_tensor(key), paddle.to_tensor(value), k, v, paddle.to_tensor(slots))
    for token, slot in enumerate(slots):
        before_k[:, slot // BLOCK, slot % BLOCK] = key[token]
        before_v[:, slot // BLOCK, slot % BLOCK] = value[token]
    np.testing.assert_array_equal(k.numpy(), before_k)
    np.testing.assert_array_equal(v.numpy(), before_v)


def test_outside_eager_mode_the_native_ops_run() -> None:
    """A static program cannot hold a numpy call: traced, the kernels build the native ops' program, whose result
    equals the eager kernel's."""
    k, v = _caches()
    tables, lens = _tables(2, 3), np.array([5, 12], dtype=np.int64)
    q = RNG.standard_normal((2, HEADS, DIM)).astype("float32")
    eager = attention.paged_attention(paddle.to_tensor(q), k, v, paddle.to_tensor(tables), paddle.to_tensor(lens))
    paddle.enable_static()
    try:
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            names = ("q", "k", "v", "t", "l")
            arrays = (q, k.numpy(), v.numpy(), tables, lens)
            inputs = [paddle.static.data(n, list(a.shape), str(a.dtype)) for n, a in zip(names, arrays, strict=True)]
            out = attention.paged_attention(*inputs)
        got = paddle.static.Executor(paddle.CPUPlace()).run(main, feed=dict(zip(names, arrays, strict=True)), fetch_list=[out])[0]
    finally:
        paddle.disable_static()
    np.testing.assert_allclose(got, eager.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8])
def test_a_wide_batch_costs_no_python_loop_per_row(rows: int) -> None:
    """Rows are one call's arrays: the kernel's numpy calls do not grow with the batch (counted, not timed)."""
    calls = []
    original = np.matmul

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)

    k, v = _caches()
    q = paddle.to_tensor(RNG.standard_normal((rows, HEADS, DIM)).astype("float32"))
    tables, lens = _tables(rows, 2), np.full(rows, 7, dtype=np.int64)
    np.matmul = counted  # type: ignore[assignment]
    try:
        attention.paged_attention(q, k, v, paddle.to_tensor(tables), paddle.to_tensor(lens))
    finally:
        np.matmul = original  # type: ignore[assignment]
    assert len(calls) == 2
