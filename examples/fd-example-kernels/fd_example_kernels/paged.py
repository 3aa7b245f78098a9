"""A paged KV cache in a layout of its own: token-major blocks [num_blocks, block_size, kv_heads, head_dim], as many
vendors' attention kernels read them (fd's native layout is head-major). The cache ops come together: fd never
reads the cache itself, so a layout change is only these functions (paged_packed_attention, contract 1.8, could be
left out: fd would run each row through this package's paged_prefill_attention; without read_kv_cache, contract 1.9,
its requests could not be handed to another instance).

FD_EXAMPLE_KERNELS_BREAK=paged_attention makes its decode attention skip each row's newest position, and
FD_EXAMPLE_KERNELS_BREAK=read_kv_cache makes its read take each slot's neighbour, and
FD_EXAMPLE_KERNELS_BREAK=write_kv_cache makes a write of fewer than 4 tokens spill copies of its last token into the
slots after it (a tile rounded up): plausible slips that `fd check` must catch (the package's tests use them)."""

from __future__ import annotations

import math
import os
from typing import Any


def allocate_kv_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: str) -> tuple[Any, Any]:
    """Two zeroed caches [num_blocks, block_size, kv_heads, head_dim]."""
    import paddle

    shape = [num_blocks, block_size, kv_heads, head_dim]
    return paddle.zeros(shape, dtype=dtype), paddle.zeros(shape, dtype=dtype)  # type: ignore[arg-type]


def write_kv_cache(key: Any, value: Any, k_cache: Any, v_cache: Any, slot_mapping: Any) -> None:
    """key, value [T, kv_h, d] at their slots: the cache seen as [num_blocks * block_size, kv_h, d] rows."""
    import paddle

    block_size = k_cache.shape[1]
    if os.environ.get("FD_EXAMPLE_KERNELS_BREAK") == "write_kv_cache" and 0 < key.shape[0] < 4:
        # A step of few tokens written as a tile of 4: copies of its last token spill into the slots after it.
        spill = 4 - key.shape[0]
        pool = k_cache.shape[0] * block_size
        slot_mapping = paddle.concat([slot_mapping, (slot_mapping[-1:] + paddle.arange(1, spill + 1)) % pool])
        key = paddle.concat([key, key[-1:].expand([spill, *key.shape[1:]])])
        value = paddle.concat([value, value[-1:].expand([spill, *value.shape[1:]])])
    index = (slot_mapping // block_size, slot_mapping % block_size)
    paddle.index_put_(k_cache, index, key)
    paddle.index_put_(v_cache, index, value)


def read_kv_cache(k_cache: Any, v_cache: Any, slot_mapping: Any) -> tuple[Any, Any]:
    """The keys and values at their slots, [T, kv_h, d] each (contract 1.9): the rows write_kv_cache wrote."""
    import paddle

    blocks, block_size, kv_heads, dim = k_cache.shape
    rows = slot_mapping.reshape([-1])
    if os.environ.get("FD_EXAMPLE_KERNELS_BREAK") == "read_kv_cache":
        rows = (rows + 1) % (blocks * block_size)  # the next slot's: off by one
    return (paddle.index_select(k_cache.reshape([blocks * block_size, kv_heads, dim]), rows, axis=0),
            paddle.index_select(v_cache.reshape([blocks * block_size, kv_heads, dim]), rows, axis=0))


def _attend(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, last: Any) -> Any:
    """q [B, S, h, d]; row b's query i sees positions [0, last[b, i]] of its blocks -> [B, S, h, d]."""
    import paddle
    import paddle.nn.functional as F

    batch, length, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    width = block_tables.shape[1]
    # [B, W, bs, kv, d] -> [B, W * bs, kv, d]: token-major blocks concatenate without a transpose.
    k = paddle.gather(k_cache, block_tables.reshape([-1])).reshape([batch, width * block_size, kv_heads, dim])
    v = paddle.gather(v_cache, block_tables.reshape([-1])).reshape([batch, width * block_size, kv_heads, dim])
    groups = heads // kv_heads
    k = paddle.repeat_interleave(k, groups, axis=2).transpose([0, 2, 3, 1]).astype("float32")  # [B, h, d, T]
    v = paddle.repeat_interleave(v, groups, axis=2).transpose([0, 2, 1, 3]).astype("float32")  # [B, h, T, d]
    scores = paddle.matmul(q.transpose([0, 2, 1, 3]).astype("float32"), k) / math.sqrt(dim)  # [B, h, S, T]
    positions = paddle.arange(width * block_size, dtype="int64").reshape([1, 1, 1, -1])
    hidden = positions > last.reshape([batch, 1, length, 1])
    scores = paddle.where(hidden, paddle.full_like(scores, float("-inf")), scores)
    out = paddle.matmul(F.softmax(scores, axis=-1), v)  # [B, h, S, d]
    return out.transpose([0, 2, 1, 3]).astype(q.dtype)


def paged_attention(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, context_lens: Any) -> Any:
    """One query a row [B, h, d] over positions [0, context_lens[b])."""
    last = context_lens - (2 if os.environ.get("FD_EXAMPLE_KERNELS_BREAK") == "paged_attention" else 1)
    return _attend(q.unsqueeze(1), k_cache, v_cache, block_tables, last.reshape([-1, 1])).squeeze(1)


def paged_prefill_attention(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, prefix_lens: Any) -> Any:
    """New queries [B, S, h, d], row b's query i at position prefix_lens[b] + i, causally."""
    import paddle

    last = prefix_lens.reshape([-1, 1]) + paddle.arange(q.shape[1], dtype="int64").reshape([1, -1])
    return _attend(q, k_cache, v_cache, block_tables, last)


def paged_packed_attention(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, query_starts: Any,
                           context_lens: Any) -> Any:
    """Rows of new tokens packed end to end, q [T, h, d] (contract 1.8): each token a row of one query at its own
    position, through its sequence's block table."""
    import paddle

    counts = query_starts[1:] - query_starts[:-1]
    row = paddle.repeat_interleave(paddle.arange(counts.shape[0], dtype="int64"), counts)  # each token's sequence
    index = paddle.arange(q.shape[0], dtype="int64") - paddle.gather(query_starts, row)  # its place in the row
    last = paddle.gather(context_lens - counts, row) + index
    return _attend(q.unsqueeze(1), k_cache, v_cache, paddle.gather(block_tables, row), last.reshape([-1, 1])).squeeze(1)
