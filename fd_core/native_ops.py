"""The native implementations of fd's named ops (fd_core.kernels.OPS): Paddle's public API, the default
kernels and the reference a plugin's kernel is checked against. Loaded when a Backend is built."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import paddle
import paddle.nn.functional as F

from fd_core.graphs import capturing


def matmul(x: paddle.Tensor, weight: paddle.Tensor, transpose_weight: bool) -> paddle.Tensor:
    """x @ weight, or x @ weight^T when transpose_weight (Paddle's own product)."""
    return paddle.matmul(x, weight, transpose_y=transpose_weight)


def quant_matmul(x: paddle.Tensor, weight: paddle.Tensor, scales: paddle.Tensor, bits: int) -> paddle.Tensor:
    """x @ W^T for the weight fd's quantized form stands for, dequantized whole in float32 (the reference)."""
    from fd_core.quantization import dequantize

    w = dequantize(weight, scales, bits, x.shape[-1])
    return paddle.matmul(x.astype("float32"), w, transpose_y=True).astype(x.dtype)


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """weight * (x / rms(x)): the statistics in float32, cast back to x's dtype before the weight, as the references
    do."""
    x32 = x.astype("float32")
    x32 = x32 * paddle.rsqrt(paddle.mean(x32 * x32, axis=-1, keepdim=True) + eps)
    return x32.astype(x.dtype) * weight


def add_rms_norm(
    x: paddle.Tensor, residual: paddle.Tensor, weight: paddle.Tensor, eps: float
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(rms_norm(x + residual), x + residual): the add in x's dtype, then the norm exactly as rms_norm computes it."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate: paddle.Tensor, up: paddle.Tensor) -> paddle.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def gelu(x: paddle.Tensor, approximate: str) -> paddle.Tensor:
    """GELU in float32, cast back to x's dtype: erf ("none"), the tanh approximation ("tanh"), or x * sigmoid(1.702 x)
    ("sigmoid", quick GELU)."""
    x32 = x if x.dtype == paddle.float32 else x.astype("float32")
    if approximate == "none":
        out = F.gelu(x32)
    elif approximate == "tanh":
        out = F.gelu(x32, approximate=True)
    elif approximate == "sigmoid":
        out = x32 * F.sigmoid(1.702 * x32)
    else:
        raise ValueError(f"gelu: approximate must be 'none', 'tanh' or 'sigmoid', got {approximate!r}")
    return out if out.dtype == x.dtype else out.astype(x.dtype)


def moe_experts(
    x: paddle.Tensor, gate: paddle.Tensor, up: paddle.Tensor, down: paddle.Tensor, chosen: paddle.Tensor,
    weights: paddle.Tensor,
) -> paddle.Tensor:
    """sum_j weights[t, j] * SwiGLU expert chosen[t, j] of x[t], for x [T, H] -> [T, H].

    Two strategies. Gathered (fixed shapes, capturable): each token's k experts gathered and run as one batched
    product, taken inside a capture (or a static program) and whenever the T x k gathered experts are no more than
    the E there are (a decode step's few tokens). Looped (shapes depend on the routing, eager only): each expert runs
    on the tokens routed to it at a nonzero weight, and is skipped when there are none, so the tokens given weight 0
    (another modality's) cost nothing.
    """
    tokens, top_k = chosen.shape[0], chosen.shape[1]
    if capturing() or not paddle.in_dynamic_mode() or tokens * top_k <= gate.shape[0]:
        return _moe_gathered(x, gate, up, down, chosen, weights)
    return _moe_looped(x, gate, up, down, chosen, weights)


def _moe_gathered(
    x: paddle.Tensor, gate: paddle.Tensor, up: paddle.Tensor, down: paddle.Tensor, chosen: paddle.Tensor,
    weights: paddle.Tensor,
) -> paddle.Tensor:
    """Every (token, choice) pair's expert gathered: [T*k, I, H] weights multiplied batched, the k results summed."""
    tokens, top_k = x.shape[0], chosen.shape[1]
    flat = chosen.reshape([-1])
    xs = paddle.repeat_interleave(x, top_k, axis=0).unsqueeze(1)  # [T*k, 1, H]
    gated = paddle.matmul(xs, paddle.gather(gate, flat), transpose_y=True)
    upped = paddle.matmul(xs, paddle.gather(up, flat), transpose_y=True)
    out = paddle.matmul(F.silu(gated) * upped, paddle.gather(down, flat), transpose_y=True)  # [T*k, 1, H]
    return paddle.sum(out.reshape([tokens, top_k, -1]) * weights.unsqueeze(-1), axis=1)


def _moe_looped(
    x: paddle.Tensor, gate: paddle.Tensor, up: paddle.Tensor, down: paddle.Tensor, chosen: paddle.Tensor,
    weights: paddle.Tensor,
) -> paddle.Tensor:
    """Each expert on the tokens that chose it at a nonzero weight, its weighted output added to theirs."""
    out = paddle.zeros_like(x)
    live = weights != 0
    for e in range(gate.shape[0]):
        hit = chosen == e
        rows = paddle.nonzero(paddle.any(hit & live, axis=-1)).reshape([-1])
        if rows.shape[0] == 0:
            continue
        token_weight = paddle.sum(paddle.gather(weights * hit.astype(weights.dtype), rows), axis=-1)
        xe = paddle.gather(x, rows)
        he = F.silu(paddle.matmul(xe, gate[e], transpose_y=True)) * paddle.matmul(xe, up[e], transpose_y=True)
        ye = paddle.matmul(he, down[e], transpose_y=True) * token_weight.unsqueeze(-1)
        out = paddle.scatter(out, rows, paddle.gather(out, rows) + ye)
    return out


def rotary_embedding(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, layout: str) -> paddle.Tensor:
    """x [B, heads, S, d] rotated by the tables [S, d/2] (or [B, 1, S, d/2], a row's own) in float32, in the 'half'
    or 'interleaved' layout."""
    x32 = x.astype("float32")
    if layout == "interleaved":
        pairs = x32.reshape([0, 0, 0, -1, 2])
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = paddle.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        return rotated.reshape([0, 0, 0, -1]).astype(x.dtype)
    half = x.shape[-1] // 2
    first, second = x32[..., :half], x32[..., half:]
    return paddle.concat([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


def attention(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor | None) -> paddle.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v with grouped-query heads.

    The query heads of one kv head are folded into its rows ([B, kv_h, g * S, d]), so k and v are
    read once, not repeated g times.
    """
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    q = q.reshape([batch, kv_heads, groups * length, dim])
    scores = paddle.matmul(q, k, transpose_y=True).astype("float32") * (1.0 / math.sqrt(dim))
    if mask is not None:
        scores = (scores.reshape([batch, kv_heads, groups, length, -1]) + mask).reshape(
            [batch, kv_heads, groups * length, -1]
        )
    out = paddle.matmul(F.softmax(scores, axis=-1).astype(v.dtype), v)
    return out.reshape([batch, heads, length, dim])


def allocate_kv_cache(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: str
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """One layer's zeroed key and value caches, [kv_heads, num_blocks, block_size, head_dim] each: head-major, so
    gathering a sequence's blocks gives [kv_heads, blocks x block_size, head_dim] with no transpose."""
    shape = [kv_heads, num_blocks, block_size, head_dim]
    return paddle.zeros(shape, dtype=dtype), paddle.zeros(shape, dtype=dtype)  # type: ignore[arg-type]


def write_kv_cache(
    key: paddle.Tensor, value: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor,
    slot_mapping: paddle.Tensor,
) -> None:
    """key and value [T, kv_h, d] into their slots: one index_put_ per cache at (head, block, offset) triples."""
    tokens, kv_heads, dim = key.shape
    block_size = k_cache.shape[2]
    slots = slot_mapping.reshape([1, -1]).expand([kv_heads, tokens]).reshape([-1])
    heads = paddle.arange(kv_heads, dtype="int64").reshape([-1, 1]).expand([kv_heads, tokens]).reshape([-1])
    index = (heads, slots // block_size, slots % block_size)
    paddle.index_put_(k_cache, index, key.transpose([1, 0, 2]).reshape([-1, dim]))
    paddle.index_put_(v_cache, index, value.transpose([1, 0, 2]).reshape([-1, dim]))


def read_kv_cache(
    k_cache: paddle.Tensor, v_cache: paddle.Tensor, slot_mapping: paddle.Tensor,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """The keys and values at `slot_mapping` [T], [T, kv_h, d] each: one index_select per cache over its positions
    (the [kv_h, blocks x block_size, d] view of the head-major layout is a reshape, not a copy)."""
    kv_heads, blocks, block_size, dim = k_cache.shape

    def read(cache: paddle.Tensor) -> paddle.Tensor:
        flat = cache.reshape([kv_heads, blocks * block_size, dim])
        if cache.dtype == paddle.float16 and dim % 2 == 0:
            # Moved as bits, two values an int32: not every build has a float16 index_select.
            bits = paddle.index_select(flat.view(paddle.int32), slot_mapping.reshape([-1]), axis=1)
            picked = bits.view(paddle.float16)
        else:
            picked = paddle.index_select(flat, slot_mapping.reshape([-1]), axis=1)
        return picked.transpose([1, 0, 2])

    return read(k_cache), read(v_cache)


def _gathered(cache: paddle.Tensor, block_tables: paddle.Tensor) -> paddle.Tensor:
    """The blocks of each row in order: [kv_h, B, W x block_size, d]."""
    kv_heads, _, block_size, dim = cache.shape
    batch, width = block_tables.shape
    blocks = paddle.index_select(cache, block_tables.reshape([-1]), axis=1)  # [kv_h, B * W, bs, d]
    return blocks.reshape([kv_heads, batch, width * block_size, dim])


def _paged(
    q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor, block_tables: paddle.Tensor,
    visible: paddle.Tensor,
) -> paddle.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for q [B, S, h, d] over each row's blocks, `visible` [B, S, W x bs] bool;
    -> [B, S, h, d]."""
    batch, length, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    groups = heads // kv_heads
    k, v = _gathered(k_cache, block_tables), _gathered(v_cache, block_tables)
    # The query heads of one kv head folded into its rows: [kv_h, B, g * S, d], so k and v are read once.
    folded = q.reshape([batch, length, kv_heads, groups, dim]).transpose([2, 0, 3, 1, 4])
    scores = paddle.matmul(folded.reshape([kv_heads, batch, groups * length, dim]), k, transpose_y=True)
    scores = scores.astype("float32").reshape([kv_heads, batch, groups, length, -1]) * (1.0 / math.sqrt(dim))
    scores = scores + (visible.astype("float32") - 1.0).unsqueeze(0).unsqueeze(2) * 1e30
    probs = F.softmax(scores, axis=-1).astype(v.dtype).reshape([kv_heads, batch, groups * length, -1])
    out = paddle.matmul(probs, v).reshape([kv_heads, batch, groups, length, dim])
    return out.transpose([1, 3, 0, 2, 4]).reshape([batch, length, heads, dim]).astype(q.dtype)


def paged_attention(
    q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor, block_tables: paddle.Tensor,
    context_lens: paddle.Tensor,
) -> paddle.Tensor:
    """Each row's one query [B, h, d] over positions [0, context_lens[b]) of its blocks -> [B, h, d]."""
    span = block_tables.shape[1] * k_cache.shape[2]
    visible = paddle.arange(span, dtype="int64").reshape([1, 1, -1]) < context_lens.reshape([-1, 1, 1])
    return _paged(q.unsqueeze(1), k_cache, v_cache, block_tables, visible).squeeze(1)


def paged_prefill_attention(
    q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor, block_tables: paddle.Tensor,
    prefix_lens: paddle.Tensor,
) -> paddle.Tensor:
    """New queries [B, S, h, d], row b's query i at position prefix_lens[b] + i, causally over its blocks."""
    span = block_tables.shape[1] * k_cache.shape[2]
    at = prefix_lens.reshape([-1, 1, 1]) + paddle.arange(q.shape[1], dtype="int64").reshape([1, -1, 1])
    visible = paddle.arange(span, dtype="int64").reshape([1, 1, -1]) <= at
    return _paged(q, k_cache, v_cache, block_tables, visible)


def paged_packed_attention(
    q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor, block_tables: paddle.Tensor,
    query_starts: paddle.Tensor, context_lens: paddle.Tensor,
) -> paddle.Tensor:
    """Rows of new tokens packed end to end, q [T, h, d]: each row through paged_prefill_attention."""
    return packed_through(paged_prefill_attention)(q, k_cache, v_cache, block_tables, query_starts, context_lens)


def packed_through(prefill_attention: Any) -> Any:
    """paged_packed_attention composed of a paged_prefill_attention (the one in use: its cache layout is the
    platform's): each row's queries [1, n, h, d] after its prefix, concatenated in order."""

    def packed(q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor, block_tables: paddle.Tensor,
               query_starts: paddle.Tensor, context_lens: paddle.Tensor) -> paddle.Tensor:
        bounds = [int(b) for b in np.asarray(query_starts.numpy() if isinstance(query_starts, paddle.Tensor)
                                                 else query_starts).reshape(-1)]
        contexts = context_lens.numpy() if isinstance(context_lens, paddle.Tensor) else np.asarray(context_lens)
        parts = []
        for row in range(len(bounds) - 1):
            start, end = bounds[row], bounds[row + 1]
            prefix = paddle.full([1], int(contexts[row]) - (end - start), dtype="int64")
            parts.append(prefill_attention(q[start:end].unsqueeze(0), k_cache, v_cache, block_tables[row : row + 1],
                                           prefix)[0])
        return paddle.concat(parts, axis=0)

    return packed


def apply_penalties(
    logits: paddle.Tensor, prompt_mask: paddle.Tensor, output_counts: paddle.Tensor, presence: paddle.Tensor,
    frequency: paddle.Tensor, repetition: paddle.Tensor,
) -> paddle.Tensor:
    """Repetition on the prompt's and output's tokens, then frequency and presence on the output's, in float32."""
    x = logits.astype("float32")
    counts = output_counts.astype("float32")
    present = (output_counts > 0).astype("float32")
    seen = paddle.logical_or(prompt_mask.astype("bool"), output_counts > 0)
    factor = repetition.astype("float32").reshape([-1, 1])
    x = paddle.where(seen, paddle.where(x > 0, x / factor, x * factor), x)
    return (x - frequency.astype("float32").reshape([-1, 1]) * counts
            - presence.astype("float32").reshape([-1, 1]) * present)


def _host(logits: Any) -> np.ndarray:
    values = logits.astype("float32").numpy() if isinstance(logits, paddle.Tensor) else logits
    return np.asarray(values, dtype=np.float64)


def sample(logits: Any, temperature: float, top_k: int, top_p: float, uniform: Sequence[float]) -> list[int]:
    """Greedy (temperature 0) or the inverse-CDF draw at each row's uniform number, after temperature, top-k, top-p."""
    rows = _host(logits)
    if temperature == 0:
        return [int(i) for i in rows.argmax(axis=-1)]
    return [_draw(row, temperature, top_k, top_p, float(u)) for row, u in zip(rows, uniform, strict=True)]


# The most probable tokens top-p first looks among; it looks among 8x as many while their mass falls short.
NUCLEUS_CANDIDATES = 256


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest prefix of the tokens by descending probability (ties in id order) whose mass reaches top_p, at
    least one token. Sorting the whole vocabulary (12 ms a row at 100k tokens) is needed only when the few most
    probable tokens fall short: the prefix is found among every token at least as probable as the count-th, in the
    same order and with the same running sums as a full sort gives them."""
    size = probs.size
    count = min(NUCLEUS_CANDIDATES, size)
    while True:
        if count >= size:
            order = np.argsort(-probs, kind="stable")
        else:
            least = np.partition(probs, size - count)[size - count]
            candidates = np.flatnonzero(probs >= least)  # in id order, so the stable sort keeps ties in id order
            order = candidates[np.argsort(-probs[candidates], kind="stable")]
        end = int(np.searchsorted(np.cumsum(probs[order]), top_p))
        if end < order.size or count >= size:
            return order[: end + 1]
        count *= 8


def _probabilities(row: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution sample draws from for one row of logits (float64): softmax(row / temperature), restricted to
    the top_k highest and then to the top-p nucleus, renormalised."""
    scores = row / temperature
    if 0 < top_k < scores.size:
        kth = np.partition(scores, -top_k)[-top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if top_p < 1.0:
        keep = _nucleus(probs, top_p)
        mask = np.zeros_like(probs)
        mask[keep] = 1.0
        probs = probs * mask
        probs /= probs.sum()
    return probs


def _inverse_cdf(probs: np.ndarray, uniform: float) -> int:
    """The token whose cumulative interval (in id order, over the unnormalised mass) holds uniform x the mass."""
    cumulative = np.cumsum(probs)
    return int(min(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"), probs.size - 1))


def _draw(row: np.ndarray, temperature: float, top_k: int, top_p: float, uniform: float) -> int:
    return _inverse_cdf(_probabilities(row, temperature, top_k, top_p), uniform)


def accept_draft(
    logits: Any, proposals: Sequence[Sequence[int]], temperature: float, top_k: int, top_p: float,
    uniform: Sequence[Sequence[float]], draft_probs: Any = None,
) -> list[list[int]]:
    """Each row's accepted proposals and one token more: greedy, the proposals that equal the argmax and then the
    argmax; sampled, rejection sampling that keeps the distribution `sample` draws from (kernels.OPS says exactly)."""
    count = len(proposals)
    if temperature == 0:
        # The argmax of every position where it is (one int a position to the host), ties to the lowest id.
        best = paddle.argmax(logits, axis=-1) if isinstance(logits, paddle.Tensor) else np.argmax(logits, axis=-1)
        best = np.asarray(best.numpy() if isinstance(best, paddle.Tensor) else best).reshape(count, -1)
        # A draft that gave its proposal no mass (q 0) has it rejected, as the sampled rule says (ratio 0).
        drafted = None if draft_probs is None else _host(draft_probs)
        out = []
        for b, row in enumerate(proposals):
            taken = 0
            while (taken < len(row) and int(row[taken]) == int(best[b, taken])
                   and (drafted is None or drafted[b, taken, int(row[taken])] > 0)):
                taken += 1
            out.append([int(t) for t in row[:taken]] + [int(best[b, taken])])
        return out
    rows = _host(logits)
    drafts = None if draft_probs is None else _host(draft_probs)
    out = []
    for b, row in enumerate(proposals):
        draws = [float(u) for u in uniform[b]]
        accepted: list[int] = []
        for i, token in enumerate(int(t) for t in row):
            p = _probabilities(rows[b, i], temperature, top_k, top_p)
            q = None if drafts is None else drafts[b, i]
            ratio = p[token] if q is None else (p[token] / q[token] if q[token] > 0 else 0.0)
            if draws[i] < ratio:
                accepted.append(token)
                continue
            # Rejected: the rest of p beyond what the draft put there, drawn at the uniform's place past the ratio
            # (given a rejection it is uniform in [0, 1) again).
            residual = p.copy()
            if q is None:
                residual[token] = 0.0
            else:
                residual = np.maximum(p - q, 0.0)
            if not residual.sum() > 0:
                residual = p
            again = (draws[i] - ratio) / (1.0 - ratio) if ratio < 1.0 else 0.0
            out.append(accepted + [_inverse_cdf(residual, again)])
            break
        else:
            last = len(accepted)
            out.append(accepted + [_draw(rows[b, last], temperature, top_k, top_p, draws[last])])
    return out
