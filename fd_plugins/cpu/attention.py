"""The cpu platform's paged KV cache ops (writing new keys and values, attention over the blocks), on numpy views of
Paddle's own memory.

The native ops gather each row's blocks with `index_select` and multiply with Paddle's batched matmul, whose bundled
MKL runs an unvectorised kernel per small product on AMD CPUs: a decode step's attention took 35 ms at eight rows of
about 150 positions against 9 ms at one (docs/benchmarks.md; 11 and 5 ms here). Here the blocks are gathered with
`numpy.take` (whole blocks at a time) and the products go through numpy's BLAS, vectorised on any x86 CPU; the whole
batch is one call, rows of any length together, with no loop over sequences. The inputs are read in place through
DLPack views (no copy in); the result is written once into a new tensor (not through Paddle 3.3.1's leaking
`to_tensor`).

A static program cannot hold a numpy call: while a graph is captured, or outside eager mode, and for a cache that is
not float32, the native op runs instead.
"""

from __future__ import annotations

import math
from typing import Any

from fd_plugins.cpu.views import eager_float32, new_tensor

# Added to a hidden position's score: finite, so a row that sees nothing (a padding row of the null block) gets even
# weights and no NaN, as the native op gives it.
HIDDEN = -1e30


def _attend(q: Any, k_cache: Any, v_cache: Any, tables: Any, limits: Any) -> Any:
    """softmax(q k^T / sqrt(d)) v for numpy q [B, S, h, d] over each row's blocks, query (b, s) seeing positions
    below limits[b, s]; -> [B, S, h, d] float32."""
    import numpy as np

    batch, length, heads, dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    groups = heads // kv_heads
    span = tables.shape[1] * block_size
    # take copies whole blocks (8 KiB each at d = 128); fancy indexing over two axes was ten times slower.
    k = np.take(k_cache, tables, axis=1).reshape(kv_heads, batch, span, dim)
    v = np.take(v_cache, tables, axis=1).reshape(kv_heads, batch, span, dim)
    # One kv head's query heads and positions folded into columns, so its keys are read once: [kv_h, B, d, g * S].
    folded = q.reshape(batch, length, kv_heads, groups, dim).transpose(2, 0, 4, 3, 1).reshape(
        kv_heads, batch, dim, groups * length)
    # keys x queries (a tall product, the fast orientation), then scores laid out with positions last.
    scores = np.matmul(k, folded).transpose(0, 1, 3, 2).reshape(kv_heads, batch, groups, length, span).copy()
    scores *= 1.0 / math.sqrt(dim)
    hidden = np.arange(span)[None, None, :] >= limits[:, :, None]  # [B, S, span]
    np.copyto(scores, np.float32(HIDDEN), where=hidden[None, :, None])
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores.reshape(kv_heads, batch, groups * length, span), v)  # [kv_h, B, g * S, d]
    return out.reshape(kv_heads, batch, groups, length, dim).transpose(1, 3, 0, 2, 4).reshape(
        batch, length, heads, dim)


def write_kv_cache(key: Any, value: Any, k_cache: Any, v_cache: Any, slot_mapping: Any) -> None:
    """key and value [T, kv_h, d] into their slots, written in place through the caches' views: one numpy assignment
    per cache (the native op's index_put_ took 0.2 to 0.4 ms a layer)."""
    import numpy as np

    from fd_core import native_ops

    if not eager_float32(key, value, k_cache, v_cache) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        native_ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    slots = np.from_dlpack(slot_mapping).reshape(-1)
    for new, cache in ((key, k_cache), (value, v_cache)):
        view = np.from_dlpack(cache)
        kv_heads, blocks, block_size, dim = view.shape
        # [kv_h, blocks x block_size, d]: a slot indexes the middle axis; its tokens' heads go head-major.
        view.reshape(kv_heads, blocks * block_size, dim)[:, slots] = np.from_dlpack(new).transpose(1, 0, 2)


def paged_attention(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, context_lens: Any) -> Any:
    """Each row's one query [B, h, d] over positions [0, context_lens[b]) of its blocks -> [B, h, d]."""
    import numpy as np

    from fd_core import native_ops

    if not eager_float32(q, k_cache, v_cache):
        return native_ops.paged_attention(q, k_cache, v_cache, block_tables, context_lens)
    host = np.from_dlpack(q.contiguous())
    limits = np.from_dlpack(context_lens).astype(np.int64).reshape(-1, 1)
    out = _attend(host[:, None], np.from_dlpack(k_cache), np.from_dlpack(v_cache), np.from_dlpack(block_tables),
                  limits)
    return new_tensor(out[:, 0])


def paged_packed_attention(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, query_starts: Any,
                           context_lens: Any) -> Any:
    """Rows of new tokens packed end to end, q [T, h, d]: rows with as many new tokens go through one call (every
    decode row together), so the calls are as many as the distinct lengths, not the rows."""
    import numpy as np

    from fd_core import native_ops

    if not eager_float32(q, k_cache, v_cache):
        return native_ops.paged_packed_attention(q, k_cache, v_cache, block_tables, query_starts, context_lens)
    host = np.from_dlpack(q.contiguous())
    bounds = np.from_dlpack(query_starts).astype(np.int64).reshape(-1)
    contexts = np.from_dlpack(context_lens).astype(np.int64).reshape(-1)
    tables = np.from_dlpack(block_tables)
    keys, values = np.from_dlpack(k_cache), np.from_dlpack(v_cache)
    counts = np.diff(bounds)
    out = np.empty(host.shape, dtype=np.float32)
    for count in np.unique(counts):
        rows = np.flatnonzero(counts == count)
        tokens = bounds[rows][:, None] + np.arange(count)[None, :]  # [G, n]
        # Row b's i-th new token is at position contexts[b] - n + i and sees up to it.
        limits = (contexts[rows] - count)[:, None] + np.arange(1, count + 1)[None, :]
        out[tokens.reshape(-1)] = _attend(host[tokens], keys, values, tables[rows], limits).reshape(-1, *host.shape[1:])
    return new_tensor(out)


def paged_prefill_attention(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, prefix_lens: Any) -> Any:
    """New queries [B, S, h, d], row b's query i at position prefix_lens[b] + i, causally over its blocks."""
    import numpy as np

    from fd_core import native_ops

    if not eager_float32(q, k_cache, v_cache):
        return native_ops.paged_prefill_attention(q, k_cache, v_cache, block_tables, prefix_lens)
    host = np.from_dlpack(q.contiguous())
    # Query i of row b sees positions up to and including its own: below prefix + i + 1.
    limits = np.from_dlpack(prefix_lens).astype(np.int64)[:, None] + np.arange(1, host.shape[1] + 1)[None, :]
    out = _attend(host, np.from_dlpack(k_cache), np.from_dlpack(v_cache), np.from_dlpack(block_tables), limits)
    return new_tensor(out)
