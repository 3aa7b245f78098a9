"""Tensor-parallel embedding, linear layers and the vocab-parallel LM head.

`ctx` is what an architecture's `build` receives (the Backend): `ctx.parallel` (tp_size, tp_rank),
`ctx.all_reduce(tensor) -> tensor`, whose return value is used (it may not reduce in place), and
`ctx.ops`, fd's named ops (fd_core.kernels) resolved to the kernels in use.
"""

from __future__ import annotations

from typing import Any

import paddle
import paddle.nn.functional as F
from paddle import nn

from fd_core import WeightSpec
from fd_core.quantization import HEAD_BITS, dequantize
from fd_models.layers.params import new_columns_param, new_param
from fd_models.layers.products import Product, hold


class _Linear(nn.Layer):
    """y = x W^T (+ b) with W [out, in] as PyTorch and published checkpoints store it, sharded on `split_axis`."""

    split_axis: int | None = None
    # Whether --quantization quantizes this layer's weight (products.Product).
    quantizable = True

    def __init__(
        self, in_features: int, out_features: int, ctx: Any, bias: bool = False, dtype: str = "float32",
    ) -> None:
        super().__init__()
        self.ctx = ctx
        tp = ctx.parallel.tp_size if self.split_axis is not None else 1
        new_param(self, WeightSpec((out_features, in_features), self.split_axis, dtype), tp)
        # A column-parallel bias is split with the outputs; a row-parallel one is whole, added once after the sum.
        bias_axis = 0 if self.split_axis == 0 else None
        self.bias = (new_param(self, WeightSpec((out_features,), bias_axis, dtype, init="zeros"), tp, attr="bias")
                     if bias else None)
        self.product = Product(self, "weight", True, ctx, self.quantizable)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = self.product(x)
        return out if self.bias is None else out + self.bias


class ReplicatedLinear(_Linear):
    """A linear layer every rank holds whole (vision towers, projectors: never quantized)."""

    quantizable = False


class ColumnParallelLinear(_Linear):
    """Output features (rows of W) split across ranks; each rank returns its slice of the outputs, no communication."""

    split_axis = 0


class RowParallelLinear(_Linear):
    """Input features (columns of W) split across ranks; partial products are all-reduced, then the bias is added."""

    split_axis = 1

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = self.ctx.all_reduce(self.product(x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Layer):
    """Vocabulary rows split across ranks: a rank embeds the ids it owns, zeros elsewhere, then all-reduce.

    The table is held transposed, [hidden, vocab / tp] (the checkpoint's `embed_tokens.weight` [vocab,
    hidden] is transposed into place at loading), because a tied LM head multiplies by it every step and
    Paddle's CPU one-row product reads x @ W faster than x @ W^T on one thread (measured on one rank's
    half of ERNIE-4.5-0.3B's vocabulary; docs/benchmarks.md has the figures). Looking up tokens' columns
    is slower than looking up rows would be, but it is paid once per prompt, not every step.
    """

    def __init__(self, vocab_size: int, hidden_size: int, ctx: Any, dtype: str = "float32") -> None:
        super().__init__()
        self.ctx = ctx
        tp, rank = ctx.parallel.tp_size, ctx.parallel.tp_rank
        self.local_vocab = vocab_size // tp
        self.start = rank * self.local_vocab
        self.hidden_size, self.dtype_name = hidden_size, dtype
        new_columns_param(self, [("weight", WeightSpec((vocab_size, hidden_size), 0, dtype))], tp)
        # Once a tied LM head's quantization hands the table over (hold_quantized): the names of its buffers (values,
        # scales) and the bits; None while the table is float.
        self.quantized: tuple[str, str, int] | None = None

    def hold_quantized(self, values: paddle.Tensor, scales: paddle.Tensor, bits: int) -> None:
        """The table in fd's quantized form, as the tied LM head's quantization made it ([vocab / tp, hidden] values,
        one token's row each, and their scales): tokens are looked up by row and dequantized, and the float table is
        released. Held as buffers (written in place on a reload), so a captured step reads them."""
        held = [hold(self, "quantized_table", index, value)[0] for index, value in enumerate((values, scales))]
        self.quantized = (str(held[0]), str(held[1]), bits)

    def _lookup(self, ids: paddle.Tensor) -> paddle.Tensor:
        """ids [...] (each a column of this rank's table) -> their vectors [..., hidden]."""
        if self.quantized is not None:
            values, scales, bits = self.quantized
            flat = ids.reshape([-1])
            rows = dequantize(paddle.gather(getattr(self, values), flat, axis=0),
                              paddle.gather(getattr(self, scales), flat, axis=0), bits, self.hidden_size)
            return rows.astype(self.dtype_name).reshape([*ids.shape, self.hidden_size])
        columns = paddle.gather(self.weight, ids.reshape([-1]), axis=1)  # [hidden, n]
        return columns.transpose([1, 0]).reshape([*ids.shape, self.weight.shape[0]])

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        if self.ctx.parallel.tp_size == 1:
            return self._lookup(ids)
        local = ids - self.start
        owned = paddle.logical_and(local >= 0, local < self.local_vocab)
        # Clip so foreign ids index a valid column; the mask zeroes their contribution before the sum.
        rows = self._lookup(paddle.clip(local, 0, self.local_vocab - 1))
        return self.ctx.all_reduce(rows * owned.astype(rows.dtype).unsqueeze(-1))


class ParallelLMHead(nn.Layer):
    """Vocab-parallel logits, tied to the embedding or its own `lm_head.weight` [vocab, hidden] split by vocab rows
    (held transposed, [hidden, vocab / tp], as the embedding's table is).

    Full-vocab logits come from an all-reduce, not an all-gather (the contract has only all-reduce):
    each rank writes its shard at its vocab offset into zeros, and the sum assembles the whole row.
    """

    def __init__(
        self, hidden_size: int, vocab_size: int, ctx: Any, tied: VocabParallelEmbedding | None, dtype: str = "float32",
        quantizable: bool = False,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        if tied is None:
            # Held [hidden, vocab / tp] as the embedding is (see VocabParallelEmbedding): x @ W, the faster product.
            new_columns_param(self, [("weight", WeightSpec((vocab_size, hidden_size), 0, dtype))], ctx.parallel.tp_size)
        # Quantized with the linear layers when `quantizable` (a run's --quantization, unless --float-embeddings), to
        # HEAD_BITS at least (its rows are the logits): a tied table's quantized form then serves the embedding too
        # (hold_quantized), which releases its float table; else it stays for the embedding. (A Product is no layer:
        # the tied embedding is not registered, and named, a second time here.)
        self.product = (Product(self, "weight", False, ctx, quantizable=quantizable, least_bits=HEAD_BITS)
                        if tied is None
                        else Product(tied, "weight", False, ctx, quantizable=quantizable, release=False,
                                     on_quantized=tied.hold_quantized, least_bits=HEAD_BITS))

    def forward(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """hidden [B, H] -> float32 logits [B, vocab] on every rank."""
        local = self.product(hidden).astype("float32")
        tp = self.ctx.parallel.tp_size
        if tp == 1:
            return local
        width = self.vocab_size // tp
        start = self.ctx.parallel.tp_rank * width
        # pad on a 2-D tensor takes [dim0 before, dim0 after, dim1 before, dim1 after].
        padded = F.pad(local, [0, 0, start, self.vocab_size - start - width], mode="constant", value=0.0)
        return self.ctx.all_reduce(padded)
