"""Kernel conformance: every non-native kernel in use against the native op, on generated inputs (the shapes of
every registered architecture and odd sizes, in every dtype the platform computes in), at each count of compute
threads a run may give a kernel. A model run with the kernels against the native ops is the suite's native-path
check (suite.ModelTests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import pytest

from fd_core.detection import Detection
from fd_core.host.loading import PluginSet
from fd_core.kernels import OPS, compute_threads, set_compute_threads
from fd_core.quantization import quantize

ODD = 13  # a size no vector unit divides
# Compute threads each case runs at (fd_core.kernels.compute_threads): one, and counts a kernel that splits its
# work must divide among, an odd one too.
THREAD_COUNTS = (1, 2, 3)
# A decode step's one-row product at a published model's size: large enough for a kernel to split it across threads.
LARGE = 1024


def _sizes(plugins: PluginSet) -> list[dict[str, int]]:
    """hidden, intermediate, head_dim, heads and kv heads of every registered architecture's preset, then odd ones."""
    from fd_core.runtime.plan import model_config_for

    found = []
    for arch in plugins.registry:
        c = model_config_for(arch, None)
        found.append({"hidden": c.hidden_size, "inter": c.intermediate_size, "head_dim": c.resolved_head_dim,
                      "heads": c.num_attention_heads, "kv": c.num_key_value_heads})
    found.append({"hidden": ODD, "inter": 2 * ODD + 1, "head_dim": 6, "heads": 6, "kv": 2})
    return [dict(t) for t in {tuple(sorted(d.items())) for d in found}]


def cases(op: str, plugins: PluginSet, dtype: str, seed: int = 0) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """(description, arguments) for `op`: random values (not small integers), in `dtype`."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(seed)

    def t(*shape: int, kind: Any = dtype) -> Any:
        return paddle.to_tensor(rng.standard_normal(shape).astype("float32")).astype(kind)

    for s in _sizes(plugins):
        h, d, heads, kv = s["hidden"], s["head_dim"], s["heads"], s["kv"]
        if op == "rms_norm":
            norms: tuple[tuple[int, ...], ...] = ((1, 1, h), (2, 5, h), (3, heads, d))
            for shape in norms:
                yield f"x{list(shape)}", (t(*shape), t(shape[-1]), 1e-6)
                # Rows whose mean square is about epsilon (a hidden state near zero), at the epsilons the published
                # configs use: there epsilon is half the denominator, so one dropped, 10x or 0.1x off shows.
                for eps in (1e-6, 1e-5):
                    small = (t(*shape, kind="float32") * eps ** 0.5).astype(dtype)
                    yield f"x{list(shape)} of mean square ~ eps={eps:g}", (small, t(shape[-1]), eps)
        elif op == "add_rms_norm":
            for shape in ((1, 1, h), (2, 5, h)):
                yield f"x{list(shape)} + residual", (t(*shape), t(*shape), t(shape[-1]), 1e-6)
                # A sum of mean square ~ eps (a sublayer's output nearly cancelling the residual stream): epsilon is
                # then half the denominator, and a norm of x or of the residual alone is far off.
                for eps in (1e-6, 1e-5):
                    residual = t(*shape, kind="float32")
                    near = residual * -1.0 + t(*shape, kind="float32") * eps ** 0.5
                    yield (f"x{list(shape)} + residual of mean square ~ eps={eps:g}",
                           (near.astype(dtype), residual.astype(dtype), t(shape[-1]), eps))
        elif op == "gelu":
            for approximate in ("none", "tanh", "sigmoid"):
                # An MLP's activations [rows, intermediate] and a hidden state's [1, 1, H] at each architecture's
                # size, and odd ones; values spread to +-12: the tanh and sigmoid forms differ from erf's most around
                # +-2, and every form saturates further out.
                for shape in ((5, s["inter"]), (1, 1, h), (7, ODD)):
                    yield f"x{list(shape)} approximate={approximate!r}", (t(*shape) * 4, approximate)
        elif op == "silu_and_mul":
            shapes: tuple[tuple[int, ...], ...] = ((1, 1, s["inter"]), (2, 5, s["inter"]), (7, 1, 1, ODD))
            for shape in shapes:
                yield f"gate{list(shape)}", (t(*shape), t(*shape))
        elif op == "rotary_embedding":
            for layout in ("half", "interleaved"):
                for batch, length in ((1, 1), (2, 5)):
                    angles = rng.uniform(-20, 20, (length, d // 2)).astype("float32")
                    cos, sin = paddle.to_tensor(np.cos(angles)), paddle.to_tensor(np.sin(angles))
                    yield f"x[{batch}, {heads}, {length}, {d}] {layout}", (t(batch, heads, length, d), cos, sin, layout)
                    # As the attention layer passes it: a transpose of [B, S, heads, d].
                    yield (f"x[{batch}, {heads}, {length}, {d}] {layout} (a transposed view)",
                           (t(batch, length, heads, d).transpose([0, 2, 1, 3]), cos, sin, layout))
                    # As the decoder passes the tables: one per row [B, 1, S, d/2] (rows at their own positions).
                    rows = rng.uniform(-20, 20, (batch, 1, length, d // 2)).astype("float32")
                    yield (f"x[{batch}, {heads}, {length}, {d}] {layout}, "
                           f"tables per row [{batch}, 1, {length}, {d // 2}]",
                           (t(batch, heads, length, d), paddle.to_tensor(np.cos(rows)), paddle.to_tensor(np.sin(rows)),
                            layout))
        elif op == "attention":
            for batch, length, total in ((1, 5, 5), (2, 1, 9), (1, 3, 11), (2, 4, 4)):
                # Causal over the last `length` of `total` positions: what prefill (length == total) and decode pass.
                offset = total - length
                allowed = np.arange(total)[None, :] <= offset + np.arange(length)[:, None]
                mask = paddle.to_tensor(np.where(allowed, 0.0, -np.inf).astype("float32"))
                yield (f"q[{batch}, {heads}, {length}, {d}] kv[{batch}, {kv}, {total}, {d}]",
                       (t(batch, heads, length, d), t(batch, kv, total, d), t(batch, kv, total, d), mask))
                # k and v as the layer passes them: the first `total` positions of a head-major cache [B, kv, T, d].
                cache_k, cache_v = t(batch, kv, total + 3, d), t(batch, kv, total + 3, d)
                yield (f"q[{batch}, {heads}, {length}, {d}] kv views of a cache [{batch}, {kv}, {total + 3}, {d}]",
                       (t(batch, heads, length, d), cache_k[:, :, :total], cache_v[:, :, :total], mask))
                # The mask as the decoder passes it: each row's own [B, 1, 1, S, T], a large negative number where
                # masked, row b's first b slots masked too (its left padding in a batch of unequal prompts).
                padded = np.stack([allowed & (np.arange(total)[None, :] >= b) for b in range(batch)])[:, None, None]
                rows_mask = paddle.to_tensor(np.where(padded, 0.0, -1e9).astype("float32"))
                yield (f"q[{batch}, {heads}, {length}, {d}] kv[{batch}, {kv}, {total}, {d}], "
                       f"mask per row [{batch}, 1, 1, {length}, {total}]",
                       (t(batch, heads, length, d), t(batch, kv, total, d), t(batch, kv, total, d), rows_mask))
            yield f"q[1, {heads}, 4, {d}] no mask", (t(1, heads, 4, d), t(1, kv, 4, d), t(1, kv, 4, d), None)
        elif op == "matmul":
            inter = s["inter"]
            yield f"x[1, 1, {h}] @ w[{h}, {inter}]", (t(1, 1, h), t(h, inter), False)
            yield f"x[2, 5, {h}] @ w[{h}, {inter}]", (t(2, 5, h), t(h, inter), False)
            # The LM head's: hidden [B, H] @ [H, vocab / tp]
            yield f"x[1, {h}] @ w[{h}, {inter}]", (t(1, h), t(h, inter), False)
            yield f"x[1, {h}] @ w[{inter}, {h}]^T", (t(1, h), t(inter, h), True)
            yield f"x[3, 1, {inter}] @ w[{h}, {inter}]^T", (t(3, 1, inter), t(h, inter), True)
        elif op == "quant_matmul":
            inter = s["inter"]
            for bits in (8, 4):
                for count, (n, k) in ((1, (inter, h)), (5, (h, inter)), (2, (ODD, ODD))):
                    values, scales = quantize(t(n, k, kind="float32"), bits)
                    yield f"x[{count}, {k}] @ wint{bits}[{n}, {k}]^T", (t(count, k), values, scales, bits)
        elif op == "sample":
            vocab = 50 + s["hidden"]
            for temperature, top_k, top_p in (
                (0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.95)
            ):
                yield (f"logits[4, {vocab}] temperature={temperature} top_k={top_k} top_p={top_p}",
                       (t(4, vocab, kind="float32") * 3, temperature, top_k, top_p, rng.random(4).tolist()))
        elif op == "apply_penalties":
            vocab = 50 + s["hidden"]
            # Tokens in the prompt only, in the output only, in both and in neither, on positive and negative logits;
            # penalties of both signs, and a row that applies none (repetition 1, the others 0).
            counts = rng.integers(1, 5, (4, vocab)) * (rng.random((4, vocab)) < 0.3)
            yield (f"logits[4, {vocab}]",
                   (t(4, vocab, kind="float32") * 3, paddle.to_tensor(rng.random((4, vocab)) < 0.3),
                    paddle.to_tensor(counts.astype("int32")), paddle.to_tensor([0.5, 0.0, -1.2, 2.0], "float32"),
                    paddle.to_tensor([0.3, 1.1, 0.0, -0.5], "float32"),
                    paddle.to_tensor([1.3, 1.0, 0.7, 2.0], "float32")))
    if op == "matmul":
        # One row against a weight of the size a real model's decode step multiplies by (4.2 M elements: 8 MiB in a
        # 16-bit dtype, 16 MiB in float32), odd sizes.
        yield f"x[1, 1, {LARGE}] @ w[{LARGE}, {4 * LARGE + ODD}]", (t(1, 1, LARGE), t(LARGE, 4 * LARGE + ODD), False)
        yield (f"x[1, 1, {4 * LARGE + ODD}] @ w[{4 * LARGE + ODD}, {LARGE}]",
               (t(1, 1, 4 * LARGE + ODD), t(4 * LARGE + ODD, LARGE), False))
        yield f"x[1, {LARGE}] @ w[{LARGE}, {4 * LARGE + ODD}]", (t(1, LARGE), t(LARGE, 4 * LARGE + ODD), False)
        yield f"x[1, {LARGE}] @ w[{4 * LARGE + ODD}, {LARGE}]^T", (t(1, LARGE), t(4 * LARGE + ODD, LARGE), True)
    if op == "add_rms_norm":
        # A published model's hidden size (ERNIE-4.5-0.3B's), a decode step's rows.
        yield f"x[2, 1, {LARGE}] + residual", (t(2, 1, LARGE), t(2, 1, LARGE), t(LARGE), 1e-5)
    if op == "gelu":
        # A vision tower's MLP at a published width (patches x 4 x 1024 + odd).
        for approximate in ("none", "tanh", "sigmoid"):
            yield (f"x[3, {4 * LARGE + ODD}] approximate={approximate!r}",
                   (t(3, 4 * LARGE + ODD) * 4, approximate))
    if op == "rms_norm":
        # A published model's hidden size (ERNIE-4.5-0.3B's), with rows near zero as above.
        for eps in (1e-6, 1e-5):
            small = (t(2, 1, LARGE, kind="float32") * eps ** 0.5).astype(dtype)
            yield f"x[2, 1, {LARGE}] of mean square ~ eps={eps:g}", (small, t(LARGE), eps)
    if op == "moe_experts":
        yield from _moe_cases(plugins, dtype, rng)
    if op == "quant_matmul":
        for bits in (8, 4):
            values, scales = quantize(t(4 * LARGE + ODD, LARGE, kind="float32"), bits)
            yield f"x[1, 1, {LARGE}] @ wint{bits}[{4 * LARGE + ODD}, {LARGE}]^T", (t(1, 1, LARGE), values, scales, bits)


# The mixture of experts' cases: few experts of a small width (the op's cost is E x I x H; the shapes that matter are
# the hidden sizes, the token counts and the routing), real top-k counts.
MOE_EXPERTS, MOE_INTERMEDIATE = 8, 2 * ODD + 1


def _moe_cases(plugins: PluginSet, dtype: str, rng: Any) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """moe_experts at each registered architecture's hidden size and odd ones: a decode step of one token, a few
    decode rows, a prefill of more tokens than the experts (each expert on its routed tokens), a prefill with some
    weights exactly 0 (another modality's tokens) and an expert no token chose."""
    import numpy as np
    import paddle

    kind: Any = dtype

    def t(*shape: int, scale: float = 1.0) -> Any:
        return paddle.to_tensor((rng.standard_normal(shape) * scale).astype("float32")).astype(kind)

    def routing(tokens: int, k: int, experts: int, unused: int | None = None) -> tuple[Any, Any]:
        """k distinct experts a token (never `unused`), weights summing to 1 as the router's renormalised ones."""
        pool = [e for e in range(experts) if e != unused]
        chosen = np.stack([rng.choice(pool, k, replace=False) for _ in range(tokens)]).astype(np.int64)
        weights = rng.random((tokens, k)).astype("float32") + 0.05
        return paddle.to_tensor(chosen), weights / weights.sum(-1, keepdims=True)

    hiddens = sorted({s["hidden"] for s in _sizes(plugins)} | {LARGE})
    e, i = MOE_EXPERTS, MOE_INTERMEDIATE
    for h in hiddens:
        # gate and up scaled by 2/sqrt(H): their products about 2 whatever H (silu neither linear nor saturated), the
        # result about 10 (well inside float16's range; the tolerance's atol small beside it).
        gate, up, down = t(e, i, h, scale=2 * h ** -0.5), t(e, i, h, scale=2 * h ** -0.5), t(e, h, i)
        for tokens, k, what in ((1, 2, "a decode step"), (1, 6, "a decode step"), (3, 2, "decode rows"),
                                (2 * e + 3, 2, "a prefill"), (ODD, 6, "a prefill")):
            chosen, weights = routing(tokens, k, e)
            yield (f"x[{tokens}, {h}] experts[{e}, {i}, {h}] top-{k}, {what}",
                   (t(tokens, h), gate, up, down, chosen, paddle.to_tensor(weights).astype(kind)))
        # A prefill of text and picture tokens as one modality's experts see it: the other modality's rows at weight
        # 0 (every choice), some rows with one choice at 0, and expert 0 chosen by no token.
        tokens, k = 2 * e + 5, 2
        chosen, weights = routing(tokens, k, e, unused=0)
        other = rng.random(tokens) < 0.4
        weights[other] = 0.0
        weights[~other & (rng.random(tokens) < 0.3), 0] = 0.0
        yield (f"x[{tokens}, {h}] experts[{e}, {i}, {h}] top-{k}, a prefill with {int(other.sum())} rows at weight 0 "
               f"and some choices at weight 0",
               (t(tokens, h), gate, up, down, chosen, paddle.to_tensor(weights).astype(kind)))
        # The same routing for few tokens (the gathered strategy's): zero weights there too.
        yield (f"x[2, {h}] experts[{e}, {i}, {h}] top-{k}, decode rows with a choice at weight 0",
               (t(2, h), gate, up, down, chosen[:2],
                paddle.to_tensor(np.asarray([[0.0, 1.0], [0.3, 0.7]], dtype="float32")).astype(kind)))


def _numpy(value: Any) -> Any:
    import numpy as np

    return np.asarray(
        value.astype("float32").numpy() if hasattr(value, "astype") and hasattr(value, "numpy") else value,
        dtype=np.float64,
    )


# The names of an op's several results, in order (for a failure's message).
RESULTS = {"add_rms_norm": ("normed", "summed")}


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def compare(op: str, got: Any, want: Any, dtype: str, args: tuple[Any, ...], native: Any) -> str | None:
    """None when `got` matches the native result `want` at the op's tolerance, else what differs."""
    import numpy as np

    if op == "sample":
        got, want = list(got), list(want)
        if got == want:
            return None
        # A draw exactly at a boundary of the cumulative distribution may fall either way.
        logits, temperature, top_k, top_p, uniform = args
        if len(got) != len(want):
            return f"returned {len(got)} tokens for {len(want)} rows"
        for b, (g, w) in enumerate(zip(got, want, strict=True)):
            if g != w:
                near = {native.sample(logits, temperature, top_k, top_p,
                                      [min(max(u + e, 0.0), 1.0 - 1e-12) for u in uniform])[b]
                        for e in (-1e-6, 1e-6)}
                if g not in near:
                    return f"row {b} chose token {g}, the native op {w}"
        return None
    if isinstance(want, tuple):  # several results (add_rms_norm's normed and summed): each compared, named
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"returned {_kind(got)}, the native op a tuple of {len(want)}"
        names = RESULTS.get(op, ())
        for n, (g, w) in enumerate(zip(got, want, strict=True)):
            problem = compare(op, g, w, dtype, args, native)
            if problem:
                return f"result {n}{f' ({names[n]})' if n < len(names) else ''}: {problem}"
        return None
    if not hasattr(got, "shape") or not hasattr(got, "dtype"):
        return f"returned {_kind(got)}, the native op a tensor"
    if tuple(got.shape) != tuple(want.shape) or str(got.dtype) != str(want.dtype):
        return f"returned {got.dtype}{list(got.shape)}, the native op {want.dtype}{list(want.shape)}"
    rtol, atol = OPS[op].tolerances[dtype]
    a, b = _numpy(got), _numpy(want)
    bad = ~np.isclose(a, b, rtol=rtol, atol=atol) | (np.isfinite(a) != np.isfinite(b))
    if not bad.any():
        return None
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    error = float(np.nanmax(np.abs(a - b)))
    return (
        f"largest error {error:.3g} (rtol {rtol:g}, atol {atol:g}); "
        f"first difference at {list(index)}: {a[index]:.6g}, native {b[index]:.6g}"
    )


# The ops that touch the paged KV cache: their layout is the platform's, so they are checked together (the platform's
# allocate, write and attention against the native ones), never one against the other's layout.
CACHE_OPS = ("allocate_kv_cache", "write_kv_cache", "paged_attention", "paged_prefill_attention")


@dataclass(frozen=True)
class CacheCase:
    """One paged-cache scenario: sequences of `lengths` positions in blocks of `block_size` (their tables drawn at
    random from a pool of `blocks`, rows `shared` sharing their first full blocks), then `new` tokens a row attending
    through them (1: a decode step; more: a prefill chunk after the cached prefix)."""

    name: str
    lengths: tuple[int, ...]
    new: int
    block_size: int
    blocks: int
    shared: int = 0


CACHE_CASES = (
    CacheCase("decode, rows of different lengths, a partial last block", (7, 1, 20), 1, 4, 24),
    CacheCase("decode, two rows sharing their first blocks", (12, 14), 1, 4, 16, shared=2),
    CacheCase("prefill chunk after a cached prefix, rows of different lengths", (9, 3, 16), 5, 4, 32),
    CacheCase("prefill from position 0 (no prefix), blocks of 16", (0, 0), 17, 16, 8),
    CacheCase("decode, one block a row at block size 64", (63, 1), 1, 64, 6),
)


def cache_layout(case: CacheCase, seed: int) -> tuple[Any, Any, Any]:
    """(block tables [B, W] with the null block 0 as padding, each row's positions' slots, context lengths) for
    `case`: non-contiguous blocks drawn at random, a row's first `shared` full blocks the first row's."""
    import numpy as np

    rng = np.random.default_rng(seed)
    total = [n + case.new for n in case.lengths]
    need = [-(-t // case.block_size) for t in total]
    width = max(need)
    free = list(rng.permutation(np.arange(1, case.blocks)))
    tables = np.zeros((len(total), width), dtype=np.int64)
    for row, count in enumerate(need):
        for i in range(count):
            tables[row, i] = tables[0, i] if row and i < case.shared else free.pop()
    slots = [[int(tables[row, p // case.block_size]) * case.block_size + p % case.block_size for p in range(t)]
             for row, t in enumerate(total)]
    return tables, slots, np.asarray(total, dtype=np.int64)


def run_cache_case(ops: Any, case: CacheCase, dtype: str, kv_heads: int, heads: int, dim: int, seed: int,
                   graphs: Any = None) -> Any:
    """The case through `ops` (allocate, write the prefix and the new tokens, attend); with `graphs`, the new tokens'
    write and attention run inside a graph captured through it (and replayed). Returns the attention's result as float64
    numpy."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(seed)
    tables, slots, total = cache_layout(case, seed)
    rows = len(total)
    k_cache, v_cache = ops.allocate_kv_cache(case.blocks, case.block_size, kv_heads, dim, dtype)

    def t(*shape: int) -> Any:
        return paddle.to_tensor(rng.standard_normal(shape).astype("float32")).astype(dtype)  # type: ignore[arg-type]

    keys = [t(int(n), kv_heads, dim) for n in total]
    values = [t(int(n), kv_heads, dim) for n in total]
    prefix = [int(n) - case.new for n in total]
    # The cached prefix (a shared block written by every row that holds it, with the first row's values).
    for row in range(rows):
        if prefix[row]:
            at = paddle.to_tensor(np.asarray(slots[row][: prefix[row]], dtype=np.int64))
            key, value = keys[row][: prefix[row]], values[row][: prefix[row]]
            if row and case.shared:
                overlap = min(prefix[row], case.shared * case.block_size)
                key = paddle.concat([keys[0][:overlap], key[overlap:]]) if overlap else key
                value = paddle.concat([values[0][:overlap], value[overlap:]]) if overlap else value
            ops.write_kv_cache(key, value, k_cache, v_cache, at)
    new_keys = paddle.concat([keys[row][prefix[row]:] for row in range(rows)])
    new_values = paddle.concat([values[row][prefix[row]:] for row in range(rows)])
    new_slots = paddle.to_tensor(
        np.asarray([s for row in range(rows) for s in slots[row][prefix[row]:]], dtype=np.int64)
    )
    table = paddle.to_tensor(tables)
    if case.new == 1:
        q = t(rows, heads, dim)
        lens = paddle.to_tensor(total)

        def step(q: Any, key: Any, value: Any, k: Any, v: Any, at: Any, table: Any, lens: Any) -> Any:
            ops.write_kv_cache(key, value, k, v, at)
            return ops.paged_attention(q, k, v, table, lens)

        inputs = [q, new_keys, new_values, k_cache, v_cache, new_slots, table, lens]
    else:
        q = t(rows, case.new, heads, dim)
        starts = paddle.to_tensor(np.asarray(prefix, dtype=np.int64))

        def step(q: Any, key: Any, value: Any, k: Any, v: Any, at: Any, table: Any, lens: Any) -> Any:
            ops.write_kv_cache(key, value, k, v, at)
            return ops.paged_prefill_attention(q, k, v, table, lens)

        inputs = [q, new_keys, new_values, k_cache, v_cache, new_slots, table, starts]
    if graphs is None:
        out = step(*inputs)
    else:
        from fd_core.graphs import capture_scope

        with capture_scope():
            graphs.capture(("fd-check", case.name), step, inputs)
        out = graphs.replay(("fd-check", case.name), inputs)
    return _numpy(out)


@pytest.mark.usefixtures("started_rank")
class KernelTests:
    """Every kernel a plugin registered for fd's named ops, checked against the native op."""

    def test_the_paged_kv_cache_ops_match_the_native_ones(self, plugins: PluginSet, hardware: Detection) -> None:
        """The platform's (or an extension's) cache ops, in whatever layout its allocate_kv_cache makes, give the native
        ops' attention on random block tables: non-contiguous and shared blocks, partial last blocks, rows of different
        lengths, decode and prefill, every dtype it computes in, eagerly and inside a graph its backend captures."""
        import numpy as np

        from fd_core import native_ops
        from fd_core.host.backend import Backend
        from fd_core.host.kernel_table import KernelTable, Ops

        backend = Backend(plugins)
        ours = {op: backend.ops.providers[op] for op in CACHE_OPS if not backend.ops.native(op)}
        if not ours:
            pytest.skip(f"{plugins.platform}: the paged KV cache runs the native ops (no cache kernel registered)")
        native = Ops(KernelTable(), native_ops)
        who = ", ".join(f"{op} ({p})" for op, p in ours.items())
        failures = []
        graphs = None
        if backend.graph_mode is not None and not any(backend.kernels.uncapturable().get(op) for op in CACHE_OPS):
            graphs = backend.graph_backend()
        for dtype in [d for d in hardware.dtypes if d in OPS["paged_attention"].dtypes]:
            rtol, atol = OPS["paged_attention"].tolerances[dtype]
            for index, case in enumerate(CACHE_CASES):
                for kv_heads, heads, dim in ((2, 4, 16), (1, 3, 8)):
                    want = run_cache_case(native, case, dtype, kv_heads, heads, dim, seed=index)
                    for where, through in (("eagerly", None), ("in a captured graph", graphs)):
                        if where != "eagerly" and through is None:
                            continue
                        try:
                            got = run_cache_case(backend.ops, case, dtype, kv_heads, heads, dim, seed=index,
                                                 graphs=through)
                        except Exception as exc:  # noqa: BLE001 - the kernels' own error, reported with its case
                            failures.append(f"{dtype} {case.name}, {heads} heads over {kv_heads}, {where}: raised "
                                            f"{type(exc).__name__}: {exc}")
                            continue
                        bad = ~np.isclose(got, want, rtol=rtol, atol=atol) if got.shape == want.shape else None
                        if bad is None:
                            failures.append(f"{dtype} {case.name}, {where}: returned {list(got.shape)}, the native "
                                            f"ops {list(want.shape)}")
                        elif bad.any():
                            error = float(np.nanmax(np.abs(got - want)))
                            failures.append(f"{dtype} {case.name}, {heads} heads over {kv_heads}, {where}: largest "
                                            f"error {error:.3g} (rtol {rtol:g}, atol {atol:g})")
        if failures:
            # Which op: decode cases read through paged_attention, prefill cases through paged_prefill_attention; both
            # failing points at what they share, the cache's writes or layout.
            kinds = {"decode" if " decode" in f else "prefill" for f in failures}
            suspect = ("paged_attention" if kinds == {"decode"} else "paged_prefill_attention" if kinds == {"prefill"}
                       else "write_kv_cache or allocate_kv_cache (every kind of case fails)")
            raise AssertionError(
                f"{suspect}: the paged KV cache ops {who} differ from the native ones: {failures[0]} "
                f"({len(failures)} case(s) in all)\n" + "\n".join(failures[:20])
            )

    def test_every_kernel_in_use_matches_the_native_op(self, plugins: PluginSet, hardware: Detection) -> None:
        from fd_core import native_ops
        from fd_core.host.backend import Backend

        backend = Backend(plugins)
        ours = {op: p for op, p in backend.ops.providers.items() if not backend.ops.native(op) and op not in CACHE_OPS}
        if not ours:
            pytest.skip(f"{plugins.platform}: every op runs the native implementation (no kernel registered)")
        failures, unchecked, checked = [], [], 0
        for op, provider in ours.items():
            dtypes = [d for d in hardware.dtypes if d in OPS[op].dtypes]
            unchecked += [f"{op} in {d}" for d in hardware.dtypes if d not in OPS[op].dtypes]
            for dtype in dtypes:
                for what, args in cases(op, plugins, dtype):
                    # The reference first, on copies: a kernel that writes into its inputs must not change what it is
                    # compared with.
                    try:
                        want = getattr(native_ops, op)(*_copies(args))
                    except Exception as exc:  # noqa: BLE001 - fd's own reference failed: said so, with the case
                        failures.append(_reference_failed(op, dtype, what, args, exc))
                        continue
                    for threads in THREAD_COUNTS:
                        at = f" on {threads} compute threads" if threads > 1 else ""
                        before = _copies(args)
                        try:
                            got = _on_threads(threads, getattr(backend.ops, op), args)
                        except Exception as exc:  # noqa: BLE001 - the kernel's own error, reported with its case
                            failures.append(f"{op} ({provider}) {dtype} {what}{at}: raised {type(exc).__name__}: "
                                            f"{_first_line(exc)}")
                            continue
                        checked += 1
                        problem = compare(op, got, want, dtype, args, native_ops) or _changed(args, before)
                        if problem:
                            failures.append(f"{op} ({provider}) {dtype} {what}{at}: {problem}")
        # The first line (what `fd check` shows) names each failing op with its first case; every case follows.
        first = {f.split(" ", 1)[0]: f for f in reversed(failures)}
        assert not failures, (
            "; ".join(reversed(first.values())) + f" ({len(failures)} case(s) in all)\n" + "\n".join(failures[:40])
        )
        if not checked:
            pytest.skip(
                f"{plugins.platform}: no kernel case could be checked: the ops define no tolerance for "
                f"{', '.join(unchecked)}"
            )


    def test_prepared_weights_give_the_native_results_and_follow_a_reload(
        self, plugins: PluginSet, hardware: Detection
    ) -> None:
        """A kernel with a prepare function, called as the shared layers call it (its weights prepared once), against
        the native op; then the same weight tensors refilled in place with new values (a reload) and prepared
        again: the result must follow the new values (a preparation cached by the tensor's identity does not)."""
        from fd_core import native_ops
        from fd_core.host.backend import Backend

        backend = Backend(plugins)
        ops = backend.ops
        ours = {op: p for op, p in ops.providers.items() if ops.prepares(op)}
        if not ours:
            pytest.skip(f"{plugins.platform}: no kernel in use prepares its weights")
        failures = []
        for op, provider in ours.items():
            for dtype in [d for d in hardware.dtypes if d in OPS[op].dtypes]:
                for what, shared in cases(op, plugins, dtype):
                    # A case's own copies: its reload refills them, and cases share weights (the experts' do).
                    args = _copies(shared)
                    for when in ("prepared at load", "after a reload (the same tensors refilled, prepared again)"):
                        if when.startswith("after"):
                            _reload(op, args)
                        try:
                            got = ops.prepared(op)(args[0], *ops.prepare(op, *args[1:]))
                        except Exception as exc:  # noqa: BLE001 - the kernel's own error, reported with its case
                            failures.append(f"{op} ({provider}) {dtype} {what}, {when}: raised "
                                            f"{type(exc).__name__}: {exc}")
                            break
                        try:
                            want = getattr(native_ops, op)(*_copies(args))
                        except Exception as exc:  # noqa: BLE001 - fd's own reference failed: said so, with the case
                            failures.append(_reference_failed(op, dtype, what, args, exc))
                            break
                        problem = compare(op, got, want, dtype, args, native_ops)
                        if problem:
                            failures.append(f"{op} ({provider}) {dtype} {what}, {when}: {problem}")
                            break
        assert not failures, failures[0] + f" ({len(failures)} case(s) in all)\n" + "\n".join(failures[:40])


def _reference_failed(op: str, dtype: str, what: str, args: tuple[Any, ...], exc: Exception) -> str:
    """A failure of fd's own native op on a case, labelled as such (not the plugin's kernel), with the arguments'
    shapes and dtypes."""
    shown = ", ".join(f"{n}={a.dtype}{list(a.shape)}".replace("paddle.", "") if hasattr(a, "shape") else f"{n}={a!r}"
                      for n, a in zip(OPS[op].args, args, strict=True))
    return (f"{op} {dtype} {what}: fd's native reference (fd_core.native_ops.{op}, not the plugin's kernel) raised "
            f"{type(exc).__name__} on ({shown}): {_first_line(exc)}; the op cannot be checked in {dtype} on this "
            f"Paddle build")


def _first_line(exc: Exception) -> str:
    """An exception's message's first line (Paddle's add a multi-line hint), or its type's name."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _reload(op: str, args: tuple[Any, ...]) -> None:
    """Refill the op's prepared tensors among `args` in place with other values, as a weight reload does: the same
    tensor objects, new contents."""
    import numpy as np
    import paddle

    given = dict(zip(OPS[op].args, args, strict=True))
    if op == "quant_matmul":
        weight, scales = given["weight"], given["scales"]
        fresh = np.random.default_rng(7).standard_normal((weight.shape[0], args[0].shape[-1])).astype("float32")
        values, new_scales = quantize(paddle.to_tensor(fresh), given["bits"])
        paddle.assign(values, output=weight)
        paddle.assign(new_scales, output=scales)
        return
    for name in OPS[op].prepared:
        tensor = given[name]
        # Another sign and scale, the case's conditioning kept: a shift (all weights off zero together) would make the
        # experts' sums cancel, where any two orders of summing differ by more than the tolerance.
        paddle.assign((-1.5 * tensor.astype("float32")).astype(tensor.dtype), output=tensor)


def _on_threads(threads: int, kernel: Any, args: tuple[Any, ...]) -> Any:
    """kernel(*args) with compute_threads() at `threads`, as the engine sets it for a phase."""
    held = compute_threads()
    set_compute_threads(threads)
    try:
        return kernel(*args)
    finally:
        set_compute_threads(held)


def _copies(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if hasattr(a, "clone") else a for a in args)


def _changed(args: tuple[Any, ...], before: tuple[Any, ...]) -> str | None:
    """Which input the kernel wrote into, if any (the ops are pure: inputs must come back as they were)."""
    import numpy as np

    for index, (now, then) in enumerate(zip(args, before, strict=True)):
        if hasattr(now, "numpy") and not np.array_equal(_numpy(now), _numpy(then), equal_nan=True):
            return f"the kernel wrote into its argument {index + 1}"
    return None
