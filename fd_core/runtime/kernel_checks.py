"""Kernels checked against fd's native ops: the generated cases of every op (random values at a model's sizes and
odd ones), the comparison at the op's tolerance, and the paged KV cache's scenarios. `fd check`'s kernel suite
(fd_core.testing.kernels) and the kernel canary every rank runs before its first request (`kernel_canary`) both go
through this code, so a check a user runs is the check the run made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

from fd_core.config import ModelConfig
from fd_core.errors import FdError, KernelMismatch, PluginError, in_terms
from fd_core.host.kernel_table import KernelTable, Ops
from fd_core.kernels import OPS, compute_threads, set_compute_threads
from fd_core.quantization import DEFAULT_GROUPS, bits_of, head_bits, quantize

ODD = 13  # a size no vector unit divides
# Uniforms the sample op is checked at over one row: a token's share changed by 1 / SAMPLE_GRID changes a draw.
SAMPLE_GRID = 64
# A decode step's one-row product at a published model's size: large enough for a kernel to split it across threads.
LARGE = 1024


def cases(
    op: str, sizes: Sequence[Mapping[str, int]], dtype: str, seed: int = 0, *, large: bool = True,
    bits: Sequence[int] = (8, 4), grouped: bool = True,
) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """(description, arguments) for `op` at each of `sizes` (hidden, inter, head_dim, heads, kv): random values (not
    small integers), in `dtype`; `large` adds a published model's sizes (a decode step's one-row product of a large
    weight), `bits` the quantized products' widths, `grouped` quant_matmul's group-wise scales (contract 1.6: a kernel
    written for an earlier contract only ever receives per-channel scales)."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(seed)

    def t(*shape: int, kind: Any = dtype) -> Any:
        return paddle.to_tensor(rng.standard_normal(shape).astype("float32")).astype(kind)

    for s in sizes:
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
            for width in bits:
                for count, (n, k) in ((1, (inter, h)), (5, (h, inter)), (2, (ODD, ODD))):
                    values, scales = quantize(t(n, k, kind="float32"), width)
                    yield f"x[{count}, {k}] @ wint{width}[{n}, {k}]^T", (t(count, k), values, scales, width)
                # In groups (contract 1.6): the scheme's default group, and a group size no power of two.
                group = DEFAULT_GROUPS[f"wint{width}"]
                if not grouped:
                    continue
                if h % group == 0:
                    values, scales = quantize(t(inter, h, kind="float32"), width, group=group)
                    yield (f"x[3, {h}] @ wint{width}[{inter}, {h}]^T in groups of {group}",
                           (t(3, h), values, scales, width))
                values, scales = quantize(t(ODD, 96, kind="float32"), width, group=24)
                yield f"x[2, 96] @ wint{width}[{ODD}, 96]^T in groups of 24", (t(2, 96), values, scales, width)
        elif op == "sample":
            vocab = 50 + s["hidden"]
            # A grid of SAMPLE_GRID uniforms over one row sees any change of 1 / SAMPLE_GRID in a token's share (a
            # top-p boundary made exclusive); logits of few distinct values put ties at the argmax, at the k-th
            # highest and in the sorted order, where a kernel may break them the other way.
            grid = [(i + 0.5) / SAMPLE_GRID for i in range(SAMPLE_GRID)]
            tied = paddle.to_tensor(rng.integers(0, 6, (1, vocab)).astype("float32")).tile([SAMPLE_GRID, 1])
            for temperature, top_k, top_p in (
                (0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.95)
            ):
                yield (f"logits[4, {vocab}] temperature={temperature} top_k={top_k} top_p={top_p}",
                       (t(4, vocab, kind="float32") * 3, temperature, top_k, top_p, rng.random(4).tolist()))
                if temperature:
                    row = t(1, vocab, kind="float32").tile([SAMPLE_GRID, 1]) * 3
                    yield (f"one row of logits[{vocab}] at {SAMPLE_GRID} uniforms, temperature={temperature} "
                           f"top_k={top_k} top_p={top_p}", (row, temperature, top_k, top_p, grid))
                yield (f"tied logits[{vocab}] (6 distinct values) at {SAMPLE_GRID} uniforms, temperature="
                       f"{temperature} top_k={top_k} top_p={top_p}", (tied, temperature, top_k, top_p, grid))
        elif op == "accept_draft":
            yield from _draft_cases(50 + s["hidden"], rng)
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
    if large and op == "matmul":
        # One row against a weight of the size a real model's decode step multiplies by (4.2 M elements: 8 MiB in a
        # 16-bit dtype, 16 MiB in float32), odd sizes.
        yield f"x[1, 1, {LARGE}] @ w[{LARGE}, {4 * LARGE + ODD}]", (t(1, 1, LARGE), t(LARGE, 4 * LARGE + ODD), False)
        yield (f"x[1, 1, {4 * LARGE + ODD}] @ w[{4 * LARGE + ODD}, {LARGE}]",
               (t(1, 1, 4 * LARGE + ODD), t(4 * LARGE + ODD, LARGE), False))
        yield f"x[1, {LARGE}] @ w[{LARGE}, {4 * LARGE + ODD}]", (t(1, LARGE), t(LARGE, 4 * LARGE + ODD), False)
        yield f"x[1, {LARGE}] @ w[{4 * LARGE + ODD}, {LARGE}]^T", (t(1, LARGE), t(4 * LARGE + ODD, LARGE), True)
        # A decode step of several rows, and a prefill chunk's, against the same weights.
        yield f"x[8, 1, {LARGE}] @ w[{4 * LARGE + ODD}, {LARGE}]^T", (t(8, 1, LARGE), t(4 * LARGE + ODD, LARGE), True)
        yield f"x[2, 37, {LARGE}] @ w[{LARGE}, {4 * LARGE + ODD}]", (t(2, 37, LARGE), t(LARGE, 4 * LARGE + ODD), False)
        # An LM head's over a vocabulary of 17k (64 MiB in float32: a weight a kernel may read in place), 4 rows.
        yield (f"x[4, {LARGE}] @ w[{LARGE}, {16 * LARGE + ODD}]",
               (t(4, LARGE), t(LARGE, 16 * LARGE + ODD), False))
    if large and op == "add_rms_norm":
        # A published model's hidden size (ERNIE-4.5-0.3B's), a decode step's rows.
        yield f"x[2, 1, {LARGE}] + residual", (t(2, 1, LARGE), t(2, 1, LARGE), t(LARGE), 1e-5)
    if large and op == "gelu":
        # A vision tower's MLP at a published width (patches x 4 x 1024 + odd).
        for approximate in ("none", "tanh", "sigmoid"):
            yield (f"x[3, {4 * LARGE + ODD}] approximate={approximate!r}",
                   (t(3, 4 * LARGE + ODD) * 4, approximate))
    if large and op == "rms_norm":
        # A published model's hidden size (ERNIE-4.5-0.3B's), with rows near zero as above.
        for eps in (1e-6, 1e-5):
            small = (t(2, 1, LARGE, kind="float32") * eps ** 0.5).astype(dtype)
            yield f"x[2, 1, {LARGE}] of mean square ~ eps={eps:g}", (small, t(LARGE), eps)
    if op == "moe_experts":
        yield from _moe_cases(sizes, dtype, rng, large)
    if large and op == "quant_matmul":
        for width in bits:
            values, scales = quantize(t(4 * LARGE + ODD, LARGE, kind="float32"), width)
            yield (f"x[1, 1, {LARGE}] @ wint{width}[{4 * LARGE + ODD}, {LARGE}]^T",
                   (t(1, 1, LARGE), values, scales, width))
            if not grouped:
                continue
            # The scheme's default groups, a decode step of several rows.
            group = DEFAULT_GROUPS[f"wint{width}"]
            values, scales = quantize(t(4 * LARGE + ODD, LARGE, kind="float32"), width, group=group)
            yield (f"x[8, 1, {LARGE}] @ wint{width}[{4 * LARGE + ODD}, {LARGE}]^T in groups of {group}",
                   (t(8, 1, LARGE), values, scales, width))


def _draft_cases(vocab: int, rng: Any) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """accept_draft's cases: greedy rows whose proposals all, some, none or none at all equal the argmax (and one where
    the argmax ties, the lower id winning); sampled rows (temperature, top-k, top-p as sample's cases) proposing each
    position's likeliest token, a random one or one top-k excludes, with a certain proposer and with a draft's
    distribution; uniforms spread over [0, 1), so a threshold, a residual or a last draw off shows in some row."""
    import numpy as np
    import paddle

    positions = 4
    logits = rng.standard_normal((4, positions, vocab)).astype("float32") * 3
    best = logits.argmax(axis=-1)
    greedy = [best[0, :3].tolist(), [int(best[1, 0]), int((best[1, 1] + 1) % vocab), int(best[1, 2])],
              [int((best[2, 0] + 7) % vocab)], []]
    tied = logits.copy()
    low, high = sorted({int(best[0, 1]), int((best[0, 1] + 3) % vocab)})
    tied[0, 1, [low, high]] = tied[0, 1].max() + 1.0
    uniform = [[0.0] * (len(row) + 1) for row in greedy]
    yield f"logits[4, {positions}, {vocab}] greedy", (paddle.to_tensor(logits), greedy, 0.0, 0, 1.0, uniform, None)
    tie_rows = [[best[0, 0].item(), high, 5], [], [], []]
    yield (f"logits[4, {positions}, {vocab}] greedy, a tied argmax", (
        paddle.to_tensor(tied), [[int(t) for t in row] for row in tie_rows], 0.0, 0, 1.0,
        [[0.0] * (len(row) + 1) for row in tie_rows], None))
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.95)):
        for trial in range(3):
            # Proposals: the likeliest token (accepted unless the uniform is high), a random one (mostly rejected:
            # the residual draw), and, with top_k, the least likely (excluded: always rejected).
            proposals = []
            for b in range(4):
                row = []
                for i in range(positions - 1 - (b + trial) % 2):
                    kind = (b + i + trial) % 3
                    token = best[b, i] if kind == 0 else rng.integers(vocab) if kind == 1 else logits[b, i].argmin()
                    row.append(int(token))
                proposals.append(row)
            uniform = [rng.random(len(row) + 1).tolist() for row in proposals]
            yield (f"logits[4, {positions}, {vocab}] temperature={temperature} top_k={top_k} top_p={top_p} "
                   f"#{trial}", (paddle.to_tensor(logits), proposals, temperature, top_k, top_p, uniform, None))
    # Every proposal the likeliest, at small uniforms: rows accept all they propose and end with the last draw.
    for temperature in (0.5, 1.0):
        proposals = [best[b, : positions - 1 - b % 2].tolist() for b in range(4)]
        uniform = [(rng.random(len(row)) * 0.1).tolist() + [float(rng.random())] for row in proposals]
        yield (f"logits[4, {positions}, {vocab}] temperature={temperature}, every proposal accepted",
               (paddle.to_tensor(logits), proposals, temperature, 0, 1.0, uniform, None))
    # A draft model's distribution: proposals drawn from it, some likelier there than in the target.
    draft = np.exp(rng.standard_normal((4, positions - 1, vocab)) * 2)
    draft = (draft / draft.sum(axis=-1, keepdims=True)).astype("float32")
    proposals = [[int(rng.choice(vocab, p=draft[b, i] / draft[b, i].sum())) for i in range(positions - 1)]
                 for b in range(4)]
    uniform = [rng.random(positions).tolist() for _ in range(4)]
    yield (f"logits[4, {positions}, {vocab}] temperature=1.0 with a draft's probabilities",
           (paddle.to_tensor(logits), proposals, 1.0, 0, 1.0, uniform, paddle.to_tensor(draft)))
    # Greedy with a draft's probabilities: the argmax proposed everywhere, one the draft gave no mass (rejected).
    zeroed = draft.copy()
    greedy_rows = [best[b, : positions - 1].tolist() for b in range(4)]
    zeroed[0, 1, greedy_rows[0][1]] = 0.0
    yield (f"logits[4, {positions}, {vocab}] greedy with a draft's probabilities, one proposal of mass 0",
           (paddle.to_tensor(logits), greedy_rows, 0.0, 0, 1.0, [[0.0] * positions for _ in range(4)],
            paddle.to_tensor(zeroed)))


# The mixture of experts' cases: few experts of a small width (the op's cost is E x I x H; the shapes that matter are
# the hidden sizes, the token counts and the routing), real top-k counts.
MOE_EXPERTS, MOE_INTERMEDIATE = 8, 2 * ODD + 1


def _moe_cases(
    sizes: Sequence[Mapping[str, int]], dtype: str, rng: Any, large: bool
) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """moe_experts at each of the sizes' hidden size (and, `large`, a published model's): a decode step of one token, a
    few decode rows, a prefill of more tokens than the experts (each expert on its routed tokens), a prefill with some
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

    hiddens = sorted({s["hidden"] for s in sizes} | ({LARGE} if large else set()))
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


def as_numpy(value: Any) -> Any:
    """A tensor (or anything numpy takes) as float64 numpy."""
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


# How far a product may be off relative to the sum of its terms' magnitudes (|x| @ |w|), by dtype: a few float32
# roundings of a reordered sum; a dropped term, a wrong row or a wrong scale is off by a term's own size.
SUM_RTOL = {"float32": 1e-6}


def _abs_product(args: tuple[Any, ...]) -> Any:
    """|x| @ |w| (or |w|^T) in float64 for matmul's arguments (x, weight, transpose_weight)."""
    import numpy as np

    x, weight, transpose = args[0], args[1], bool(args[2]) if len(args) > 2 else False
    xs, ws = np.abs(as_numpy(x)), np.abs(as_numpy(weight))
    return np.matmul(xs, ws.T if transpose else ws)


def rounded_x_bound(x: Any, values: Any, scales: Any, bits: int) -> Any:
    """How far quant_matmul's result may be off when a kernel rounds x to int8 per block (fd_core.kernels.OPS'
    quant_matmul): sum over k of |w[n, k]| max|x| over k's widest allowed block / 254, as float64 [rows, N].

    The widest block is QUANT_X_BLOCK, or the largest power of two dividing the group size when smaller; every
    narrower block a kernel may use (a power of two, starting at a multiple of its size) lies inside one of them."""
    import numpy as np

    from fd_core.kernels import QUANT_X_BLOCK
    from fd_core.quantization import dequantize

    xs = np.abs(as_numpy(x))
    columns = xs.shape[-1]
    xs = xs.reshape(-1, columns)
    w = np.abs(as_numpy(dequantize(values, scales, bits, columns)))
    block = QUANT_X_BLOCK
    if len(scales.shape) > 1:
        group = columns // scales.shape[1]
        block = min(block, group & -group)  # the largest power of two dividing the group size
    blocks = -(-columns // block)
    padded_x = np.zeros((xs.shape[0], blocks * block))
    padded_x[:, :columns] = xs
    padded_w = np.zeros((w.shape[0], blocks * block))
    padded_w[:, :columns] = w
    peaks = padded_x.reshape(xs.shape[0], blocks, block).max(axis=2)
    sums = padded_w.reshape(w.shape[0], blocks, block).sum(axis=2)
    return peaks @ sums.T / 254


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
    if op == "accept_draft":
        got = [list(row) for row in got] if isinstance(got, (list, tuple)) else got
        if got == want:
            return None
        if not isinstance(got, list) or len(got) != len(want):
            return f"returned {_kind(got)}, the native op {len(want)} lists"
        logits, proposals, temperature, top_k, top_p, uniform, draft = args
        for b, (g, w) in enumerate(zip(got, want, strict=True)):
            if [int(t) for t in g] == w:
                continue
            # A uniform exactly at a threshold or a boundary of the cumulative distribution may fall either way.
            choices = [native.accept_draft(logits, proposals, temperature, top_k, top_p,
                                           [[min(max(u + e, 0.0), 1.0 - 1e-12) for u in row] for row in uniform],
                                           draft)[b] for e in (-1e-6, 1e-6)]
            if [int(t) for t in g] not in choices:
                return (f"row {b} (proposals {list(proposals[b])}) gave {[int(t) for t in g]}, the native op {w}: "
                        f"{len(w) - 1} accepted, then {w[-1]}")
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
    a, b = as_numpy(got), as_numpy(want)
    allowed = atol + rtol * np.abs(b)
    if op == "matmul":
        # A K-term sum ordered otherwise rounds by its terms' size, not its result's: where they cancel (a result of
        # 0.03 from terms summing to 2,600 in magnitude at K = 4,109) rounding alone passes atol.
        allowed = allowed + SUM_RTOL.get(dtype, 0.0) * _abs_product(args)
    if op == "quant_matmul":
        # x rounded to int8 per block, as the op allows (contract 1.6): half a step of each rounded x, times |w|.
        allowed = allowed + rounded_x_bound(*args).reshape(b.shape)
    with np.errstate(invalid="ignore"):  # inf - inf: equal infinities are compared by a == b
        bad = ~((np.abs(a - b) <= allowed) | (a == b)) | (np.isfinite(a) != np.isfinite(b))
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
CACHE_OPS = ("allocate_kv_cache", "write_kv_cache", "paged_attention", "paged_prefill_attention",
             "paged_packed_attention", "read_kv_cache")


@dataclass(frozen=True)
class CacheCase:
    """One paged-cache scenario: sequences of `lengths` positions in blocks of `block_size` (their tables drawn at
    random from a pool of `blocks`, rows `shared` sharing their first full blocks), then `new` tokens a row attending
    through them (1: a decode step; more: a prefill chunk after the cached prefix); `packed`, each row's own count of
    new tokens, all rows packed end to end through paged_packed_attention (a mixed prefill and decode step)."""

    name: str
    lengths: tuple[int, ...]
    new: int
    block_size: int
    blocks: int
    shared: int = 0
    packed: tuple[int, ...] = ()

    @property
    def news(self) -> tuple[int, ...]:
        """Each row's new tokens."""
        return self.packed or (self.new,) * len(self.lengths)

    @property
    def kind(self) -> str:
        """Which attention op the case reads through: decode, prefill or packed."""
        return "packed" if self.packed else "decode" if self.new == 1 else "prefill"


CACHE_CASES = (
    CacheCase("decode, rows of different lengths, a partial last block", (7, 1, 20), 1, 4, 24),
    CacheCase("decode, two rows sharing their first blocks", (12, 14), 1, 4, 16, shared=2),
    CacheCase("prefill chunk after a cached prefix, rows of different lengths", (9, 3, 16), 5, 4, 32),
    CacheCase("prefill from position 0 (no prefix), blocks of 16", (0, 0), 17, 16, 8),
    CacheCase("decode, one block a row at block size 64", (63, 1), 1, 64, 6),
    CacheCase("packed step, decode rows beside prefill chunks after prefixes", (7, 1, 20, 9, 0), 0, 4, 48,
              packed=(1, 5, 1, 3, 6)),
    CacheCase("packed step, hundreds of positions, rows sharing blocks", (300, 301, 1, 257), 0, 16, 80, shared=3,
              packed=(1, 1, 70, 9)),
    # As large as real runs, past what a kernel may special-case: 128-position partitions with a partial last one,
    # more rows than a capture size or a 4-row tile, a prefill chunk past a 64-query tile, and pools with no block to
    # spare (the pool's last block is in use: a cache one block short fails).
    CacheCase("decode, nine rows of 1 to 300 positions, the whole pool in use",
              (300, 129, 1, 257, 64, 128, 17, 200, 5), 1, 16, 77),
    CacheCase("prefill chunk of 100 after a prefix of 37, the whole pool in use", (37, 0), 100, 16, 17),
)


def cache_layout(case: CacheCase, seed: int) -> tuple[Any, Any, Any]:
    """(block tables [B, W] with the null block 0 as padding, each row's positions' slots, context lengths) for
    `case`: non-contiguous blocks drawn at random, a row's first `shared` full blocks the first row's."""
    import numpy as np

    rng = np.random.default_rng(seed)
    total = [n + new for n, new in zip(case.lengths, case.news, strict=True)]
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
    prefix = [int(n) - new for n, new in zip(total, case.news, strict=True)]
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
    if case.packed:
        q = t(sum(case.packed), heads, dim)
        lens = paddle.to_tensor(total)
        bounds = paddle.to_tensor(np.concatenate([[0], np.cumsum(case.packed)]).astype(np.int64))

        def step(q: Any, key: Any, value: Any, k: Any, v: Any, at: Any, table: Any, lens: Any) -> Any:
            ops.write_kv_cache(key, value, k, v, at)
            return ops.paged_packed_attention(q, k, v, table, bounds, lens)

        inputs = [q, new_keys, new_values, k_cache, v_cache, new_slots, table, lens]
    elif case.new == 1:
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
    return as_numpy(out)


def read_back_problem(
    ops: Any, dtype: str, kv_heads: int, dim: int, blocks: int, block_size: int, seed: int
) -> str | None:
    """What is wrong with reading the cache back through `ops` (read_kv_cache after write_kv_cache, the platform's
    layout), or None: random keys and values written at every slot of a pool in a random order (the pool's last block
    and partial blocks included) must come back bit for bit when read in another order, reading writes nothing, and
    writing a few slots again changes no other slot (stray_write_problem)."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(seed)
    k_cache, v_cache = ops.allocate_kv_cache(blocks, block_size, kv_heads, dim, dtype)
    # Every slot but the null block's, in a random order; the last few left unwritten (a partial block somewhere).
    slots = rng.permutation(np.arange(block_size, blocks * block_size))[: max(1, (blocks - 1) * block_size - 3)]
    keys = paddle.to_tensor(rng.standard_normal((len(slots), kv_heads, dim)).astype("float32")).astype(
        dtype)  # type: ignore[arg-type]
    values = paddle.to_tensor(rng.standard_normal((len(slots), kv_heads, dim)).astype("float32")).astype(
        dtype)  # type: ignore[arg-type]
    ops.write_kv_cache(keys, values, k_cache, v_cache, paddle.to_tensor(slots.astype(np.int64)))
    before = (as_numpy(k_cache), as_numpy(v_cache))
    order = rng.permutation(len(slots))
    got = ops.read_kv_cache(k_cache, v_cache, paddle.to_tensor(slots[order].astype(np.int64)))
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return f"returned {type(got).__name__}, not a (keys, values) pair"
    for name, read, written in (("keys", got[0], keys), ("values", got[1], values)):
        want = as_numpy(written)[order]
        have = as_numpy(read)
        if have.shape != want.shape:
            return f"{name} came back {list(have.shape)}, written {list(want.shape)}"
        if str(read.dtype).split(".")[-1] != dtype:
            return f"{name} came back in {read.dtype}, the cache's dtype is {dtype}"
        bad = np.argwhere(have != want)
        if len(bad):
            t = int(bad[0][0])
            first = tuple(bad[0])
            return (f"{name} differ from what was written at {len(np.unique(bad[:, 0]))} of {len(slots)} slots; "
                    f"first at slot {int(slots[order][t])}: {have[first]:.6g}, written {want[first]:.6g}")
    for name, cache, held in (("k_cache", k_cache, before[0]), ("v_cache", v_cache, before[1])):
        if not np.array_equal(as_numpy(cache), held, equal_nan=True):
            return f"reading changed {name}"
    return stray_write_problem(ops, dtype, k_cache, v_cache, slots, keys, values, blocks, block_size, rng)


# How stray_write_problem's finding starts: read_back_blame reads it.
STRAY_WRITE = "write_kv_cache given slots"


def read_back_blame(problem: str) -> str:
    """The op a read_back_problem names: write_kv_cache for a write that changed slots it was not given, else
    read_kv_cache."""
    return "write_kv_cache" if problem.startswith(STRAY_WRITE) else "read_kv_cache"


def stray_write_problem(ops: Any, dtype: str, k_cache: Any, v_cache: Any, slots: Any, keys: Any, values: Any,
                        blocks: int, block_size: int, rng: Any) -> str | None:
    """What a decode step's write did outside its own slots, or None: at least six slots of the full pool (the last
    slot of a block and the pool's last written slot among them) are written again, in calls of one, two and three or
    more tokens, and every other slot past the null block, written or not, must read back as it read before. A
    kernel that writes past a token (a tile rounded up, the next slot, the next block's first) would change another
    sequence's keys and values, which the attention checks cannot see until that sequence reads them."""
    import numpy as np
    import paddle

    positions = np.arange(block_size, blocks * block_size, dtype=np.int64)  # every slot but the null block's
    every = paddle.to_tensor(positions)
    before = [as_numpy(t) for t in ops.read_kv_cache(k_cache, v_cache, every)]
    ends = np.flatnonzero(slots % block_size == block_size - 1)
    chosen = {int(np.argmax(slots))}
    if len(ends):
        chosen.add(int(ends[0]))
    for i in rng.permutation(len(slots)):  # others at random, up to six in all (fewer only in a smaller pool)
        if len(chosen) >= 6:
            break
        chosen.add(int(i))
    again = np.asarray(sorted(chosen))
    shape = (len(again), *keys.shape[1:])
    new_keys = paddle.to_tensor(rng.standard_normal(shape).astype("float32")).astype(dtype)  # type: ignore[arg-type]
    new_values = paddle.to_tensor(rng.standard_normal(shape).astype("float32")).astype(dtype)  # type: ignore[arg-type]
    # As decode steps write them: one token, then two, then the rest in one call (a kernel may special-case few).
    for part in np.split(np.arange(len(again)), [1, 3]):
        if len(part):
            ops.write_kv_cache(new_keys[int(part[0]):int(part[-1]) + 1], new_values[int(part[0]):int(part[-1]) + 1],
                               k_cache, v_cache, paddle.to_tensor(slots[again[part]].astype(np.int64)))
    after = [as_numpy(t) for t in ops.read_kv_cache(k_cache, v_cache, every)]
    rewritten = {int(s) for s in slots[again]}
    for name, old, now, written in (("keys", before[0], after[0], new_keys), ("values", before[1], after[1],
                                                                             new_values)):
        moved = np.flatnonzero((old != now).reshape(len(positions), -1).any(axis=1))
        stray = [int(positions[m]) for m in moved if int(positions[m]) not in rewritten]
        if stray:
            given = ", ".join(str(int(s)) for s in slots[again])
            return f"{STRAY_WRITE} {given} changed the {name} of {len(stray)} other slot(s), first slot {stray[0]}"
        # positions start past the null block: slot s is row s - block_size of what was read.
        if not np.array_equal(now[slots[again] - block_size], as_numpy(written)):
            return f"the {name} written again at slots {sorted(rewritten)} did not all come back"
    return None


def first_line(exc: Exception) -> str:
    """An exception's message's first line (Paddle's add a multi-line hint), or its type's name."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def on_threads(threads: int, kernel: Any, args: tuple[Any, ...]) -> Any:
    """kernel(*args) with compute_threads() at `threads`, as the engine sets it for a phase."""
    held = compute_threads()
    set_compute_threads(threads)
    try:
        return kernel(*args)
    finally:
        set_compute_threads(held)


def copies(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments with every tensor cloned: what a reference is computed on, and what the inputs are checked
    against after a kernel ran."""
    return tuple(a.clone() if hasattr(a, "clone") else a for a in args)


def changed(args: tuple[Any, ...], before: tuple[Any, ...]) -> str | None:
    """Which input the kernel wrote into, if any (the ops are pure: inputs must come back as they were)."""
    import numpy as np

    for index, (now, then) in enumerate(zip(args, before, strict=True)):
        if hasattr(now, "numpy") and not np.array_equal(as_numpy(now), as_numpy(then), equal_nan=True):
            return f"the kernel wrote into its argument {index + 1}"
    return None


# -- the kernel canary: each rank, before its first request ---------------------------------------------------------

# The most elements of a weight a canary case multiplies by: a model's intermediate width is cut to it, so that a
# large model's check stays a fraction of a second (larger weights, and every thread count, are `fd check`'s).
CANARY_WEIGHT_ELEMENTS = 1 << 20
# Odd sizes beside the run's own: a kernel's tail loop (a size no vector unit divides) runs on them.
ODD_SIZES = {"hidden": ODD, "inter": 2 * ODD + 1, "head_dim": 6, "heads": 6, "kv": 2}
# The ops no decoder calls: the canary checks them when the built model holds their kernel (a vision tower's
# attention and GELU, a mixture's routed experts).
HELD_ONLY = ("attention", "gelu", "moe_experts")


def rank_sizes(config: ModelConfig, tp: int = 1) -> dict[str, int]:
    """One rank's sizes of `config`'s decoder: hidden, inter, head_dim, heads and kv heads (the inter width and the
    heads split over `tp`), the inter width cut to CANARY_WEIGHT_ELEMENTS // hidden."""
    hidden = config.hidden_size
    inter = max(1, config.intermediate_size // tp)
    return {"hidden": hidden, "inter": min(inter, max(ODD, CANARY_WEIGHT_ELEMENTS // hidden)),
            "head_dim": config.resolved_head_dim, "heads": max(1, config.num_attention_heads // tp),
            "kv": max(1, config.num_key_value_heads // tp)}


def canary_cache_cases(block_size: int) -> tuple[CacheCase, ...]:
    """The paged cache at the run's block size, across block boundaries: decode tokens at a block's last and first
    positions, a prefill chunk crossing a boundary after a prefix, and one of more than a block from position 0."""
    b = block_size

    def case(name: str, lengths: tuple[int, ...], new: int) -> CacheCase:
        # Every row's blocks drawn from a pool with a few to spare (tables not contiguous), plus the null block.
        return CacheCase(name, lengths, new, b, sum(-(-(n + new) // b) for n in lengths) + 3)

    return (
        case(f"decode at a block's last and first positions (blocks of {b})", (b - 1, 2 * b - 1, b, 1), 1),
        case(f"prefill of 3 across a block boundary after a prefix (blocks of {b})", (max(0, b - 2), 0, 2 * b - 1), 3),
        case(f"prefill of {b + 1} from position 0 (blocks of {b})", (0,), b + 1),
        CacheCase(f"packed step, decode rows beside a chunk across a block boundary (blocks of {b})",
                  (b - 1, max(0, b - 2), 1), 0, b, 3 * (-(-(b + 3) // b)) + 3, packed=(1, 3, 1)),
    )


def held_ops(model: Any, ops: Ops, names: Iterable[str]) -> set[str]:
    """Which of the ops `names` the built `model` holds the kernel of: as an attribute of one of its layers, or of a
    helper object a layer holds (a product, a mixture's experts), two objects down. A model that is not a Paddle layer
    (no `sublayers`) is taken to hold them all."""
    names = list(names)
    sublayers = getattr(model, "sublayers", None)
    if not callable(sublayers):
        return set(names)
    wanted: dict[int, str] = {}
    for name in names:
        wanted[id(getattr(ops, name))] = wanted[id(ops.prepared(name))] = name
    found: set[str] = set()
    seen: set[int] = set()
    todo = [(layer, 0) for layer in sublayers(include_self=True)]
    while todo:
        obj, depth = todo.pop()
        for value in vars(obj).values():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if id(item) in wanted:
                    found.add(wanted[id(item)])
                elif depth < 2 and id(item) not in seen and _helper(item):
                    seen.add(id(item))
                    todo.append((item, depth + 1))
    return found


def _helper(value: Any) -> bool:
    """A model package's own plain object (not a layer, which sublayers() gives, nor a tensor, function, class or
    fd's own objects: the Backend and its ops would lead everywhere)."""
    import types

    if isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return False
    root = (type(value).__module__ or "").split(".")[0]
    return hasattr(value, "__dict__") and root not in ("builtins", "paddle", "numpy", "fd_core") and not hasattr(
        value, "sublayers"
    )


def canary_ops(ops: Ops, config: ModelConfig, model: Any = None, speculative: bool = True) -> list[str]:
    """The ops a non-native kernel serves that the run calls, in fd's order: every one a decoder or the engine calls;
    quant_matmul when the run quantizes; accept_draft when it decodes speculatively; attention, gelu and moe_experts
    when the built model holds their kernel (every one of them without a model)."""
    ours = [op for op in OPS if not ops.native(op) and (op != "quant_matmul" or config.quantization)
            and (op != "accept_draft" or speculative)]
    optional = [op for op in ours if op in HELD_ONLY]
    held = held_ops(model, ops, optional) if model is not None else set(optional)
    return [op for op in ours if op not in HELD_ONLY or op in held]


def kernel_canary(
    ops: Ops, platform: str, config: ModelConfig, block_size: int, *, tp: int = 1, threads: int = 1,
    model: Any = None, speculative: bool = True,
) -> list[str]:
    """Every non-native kernel the run calls (canary_ops) once against the native op, on small cases at one rank's
    sizes of `config` and odd ones, in its dtype (its quantization's width), on `threads` compute threads, and the
    paged cache's ops at `block_size` across block boundaries. Returns the ops checked; the first that differs raises
    KernelMismatch naming its plugin, the op, the case and the error."""
    from fd_core import native_ops

    checked = canary_ops(ops, config, model, speculative)
    if not checked:
        return checked
    sizes = [rank_sizes(config, tp), ODD_SIZES]
    held = compute_threads()
    # The count the engine gives the kernels in every phase of this run: a kernel that splits its work divides it so.
    set_compute_threads(threads)
    try:
        for op in checked:
            if op not in CACHE_OPS:
                _canary_op(ops, op, sizes, config, platform, native_ops)
        if any(op in CACHE_OPS for op in checked):
            _canary_cache(ops, sizes[0], config.dtype, block_size, platform, native_ops)
        # The read-back (and its stray-write part) for a plugin's read or write: a write that spills into slots it
        # was not given is seen by nothing else here. A layout of a plugin's own with no read_kv_cache cannot be read.
        writes = "read_kv_cache" in checked or "write_kv_cache" in checked
        if writes and config.dtype in OPS["read_kv_cache"].tolerances:
            size = sizes[0]
            try:
                problem = read_back_problem(ops, config.dtype, size["kv"], size["head_dim"], 5, block_size, seed=0)
            except PluginError:
                problem = None
            if problem:
                op = read_back_blame(problem)
                raise _mismatch(op, [ops.providers[op]], f"{config.dtype}: {problem}", platform)
    finally:
        set_compute_threads(held)
    return checked


def _canary_op(
    ops: Ops, op: str, sizes: list[dict[str, int]], config: ModelConfig, platform: str, native: Any
) -> None:
    """`op`'s kernel in use (its weights prepared as the shared layers prepare them) against the native op."""
    if config.dtype in OPS[op].dtypes:
        dtype = config.dtype
    elif OPS[op].dtypes == ("float32",):
        dtype = "float32"  # sample and apply_penalties: float32 logits whatever the compute dtype
    else:
        return  # no tolerance in the run's dtype (float64): fd check does not compare it either
    # The run's widths: its scheme's, and the LM head's (HEAD_BITS at least) unless the head stays float.
    bits: tuple[int, ...] = (8, 4)
    if config.quantization:
        scheme = config.quantization
        bits = tuple(sorted({bits_of(scheme)} if config.float_embeddings else {bits_of(scheme), head_bits(scheme)}))
    grouped = ops.written_for(op, "1.6")
    for what, args in cases(op, sizes, dtype, large=False, bits=bits, grouped=grouped):
        try:
            want = getattr(native, op)(*copies(args))
        except Exception:  # noqa: BLE001 - fd's reference cannot run this case on this build: fd check says so
            continue
        before = copies(args)
        try:
            # A kernel with a prepare function is called through it, as a layer's loaded weights are.
            got = getattr(ops, op)(*args)
        except FdError:
            raise  # already one line naming the plugin (a prepare function's wrong answer)
        except Exception as exc:  # noqa: BLE001 - the kernel's own error, reported with its case
            problem: str | None = f"raised {type(exc).__name__}: {first_line(exc)}"
        else:
            problem = compare(op, got, want, dtype, args, native) or changed(args, before)
        if problem:
            raise _mismatch(op, [ops.providers[op]], f"{dtype} {what}: {problem}", platform)


def _canary_cache(ops: Ops, size: Mapping[str, int], dtype: str, block_size: int, platform: str, native: Any) -> None:
    """The platform's cache ops together (allocate, write, attend; their layout is the platform's) against the native
    ones, at one rank's heads and head size; which op is named depends on which kinds of case fail, as in fd check."""
    if dtype not in OPS["paged_attention"].dtypes:
        return
    reference = Ops(KernelTable(), native)
    kv, heads, dim = size["kv"], size["heads"], size["head_dim"]
    failures: list[tuple[CacheCase, str]] = []
    for index, case in enumerate(canary_cache_cases(block_size)):
        want = run_cache_case(reference, case, dtype, kv, heads, dim, seed=index)
        try:
            got = run_cache_case(ops, case, dtype, kv, heads, dim, seed=index)
        except FdError:
            raise
        except Exception as exc:  # noqa: BLE001 - the kernels' own error, reported with its case
            failures.append((case, f"raised {type(exc).__name__}: {first_line(exc)}"))
            continue
        problem = compare("paged_attention", got, want, dtype, (), native)
        if problem:
            failures.append((case, problem))
    if not failures:
        return
    kinds = {case.kind for case, _ in failures}
    suspects = cache_suspects(kinds)
    named = [op for op in suspects if not ops.native(op)] or [op for op in CACHE_OPS if not ops.native(op)]
    case, problem = failures[0]
    shown = f"{dtype} {case.name}, {heads} heads over {kv} kv heads of {dim}: {problem}"
    raise _mismatch(" or ".join(named), [ops.providers[op] for op in named], shown, platform)


def cache_suspects(kinds: set[str]) -> tuple[str, ...]:
    """The cache op to name when cases of these kinds (decode, prefill, packed) fail: decode cases read through
    paged_attention, prefill ones through paged_prefill_attention, packed ones through paged_packed_attention (or,
    without a kernel of its own, through the prefill attention: prefill and packed failing name that); decode failing
    with either points at what they share, the cache's writes or its layout."""
    if len(kinds) == 1:
        return (f"paged_{'' if kinds == {'decode'} else next(iter(kinds)) + '_'}attention",)
    if kinds == {"prefill", "packed"}:
        return ("paged_prefill_attention",)
    return ("write_kv_cache", "allocate_kv_cache")


def _mismatch(op: str, plugins: Sequence[str], detail: str, platform: str) -> KernelMismatch:
    """One line: the plugin(s), the op, the case and its error, and the fixes."""
    distinct = list(dict.fromkeys(plugins))
    who = ("plugin " if len(distinct) == 1 else "plugins ") + " and ".join(repr(p) for p in distinct)
    skip = in_terms("pass --no-kernel-canary", "pass LLM(kernel_canary=False)")
    return KernelMismatch(
        f"{who}: the {op} kernel differs from fd's native op in the kernel canary before the first request: {detail}; "
        f"run `fd check {platform}` to see every failing case and fix or uninstall {who.split(' ', 1)[1]}, or {skip} "
        f"to run without this check"
    )
