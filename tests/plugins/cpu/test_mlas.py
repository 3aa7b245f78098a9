"""The cpu platform's products through ONNX Runtime's MLAS (fd_plugins/cpu/mlas.py), run for real: float32 products
prepared once at load, the weight-only quantized ones, what each keeps of the weight, and where Paddle's stay."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_core import native_ops
from fd_core.graphs import capture_scope
from fd_core.quantization import quantize
from fd_core.runtime.kernel_checks import compare
from fd_plugins.cpu import mlas
from fd_plugins.cpu.products import matmul, prepare_matmul, prepare_quant, quant_matmul

RNG = np.random.default_rng(7)


def _tensor(*shape: int) -> paddle.Tensor:
    return paddle.to_tensor(RNG.standard_normal(shape).astype("float32"))


@pytest.mark.parametrize("transpose_weight", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_a_prepared_product_equals_numpys_and_reads_no_weight_it_was_handed(rows: int, transpose_weight: bool) -> None:
    """After preparing, the weight is overwritten and its storage released (as the shared layers release it): the
    product still gives x @ W, so ONNX Runtime multiplies by its own packed copy only (one copy is held, not two)."""
    weight = _tensor(3072, 1024) if transpose_weight else _tensor(1024, 3072)
    want_weight = weight.numpy().astype(np.float64)
    prepared = prepare_matmul(weight, transpose_weight)
    assert isinstance(prepared, mlas.MlasProduct)
    weight.fill_(1e30)
    weight._clear_data()
    x = _tensor(rows, 1, 1024)
    got = matmul(x, prepared, transpose_weight)
    want = x.numpy().astype(np.float64) @ (want_weight.T if transpose_weight else want_weight)
    assert list(got.shape) == [rows, 1, 3072]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


def test_a_head_sized_weight_is_packed_too_and_its_wide_products_stay_right() -> None:
    """An LM head's size (over 64 MiB) is packed like any weight: the tensor it came from is overwritten and the
    products of one and of several rows still give x @ W."""
    weight = _tensor(1024, 16400)
    want = weight.numpy().astype(np.float64)
    prepared = prepare_matmul(weight, False)
    assert isinstance(prepared, mlas.MlasProduct)
    weight.fill_(1e30)
    for rows in (1, 5):
        x = _tensor(rows, 1024)
        np.testing.assert_allclose(matmul(x, prepared, False).numpy(), x.numpy().astype(np.float64) @ want,
                                   rtol=1e-4, atol=1e-4)


def test_a_product_call_leaves_nothing_behind_in_pythons_heap() -> None:
    """2,000 calls of a prepared product grow Python's heap by less than a tenth of what building each result with
    paddle.to_tensor (Paddle 3.3.1 keeps about 100 bytes of every call's keyword names) would."""
    import gc
    import tracemalloc

    prepared = prepare_matmul(_tensor(1024, 512), False)
    x = _tensor(3, 1024)
    for _ in range(300):
        matmul(x, prepared, False)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(2000):
            matmul(x, prepared, False)
        gc.collect()
        grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 20_000, f"{grown} bytes kept by 2,000 products"


def test_what_stays_paddles_and_a_capture_is_refused() -> None:
    """Below 1 MiB and in 16 bits a weight stays Paddle's (the tiny models keep their static graphs); MLAS's product
    inside a capture is a one-line error naming the fix, not a wrong program."""
    small = _tensor(64, 128)
    assert prepare_matmul(small, False) is small
    half = _tensor(1024, 1024).astype("float16")
    assert prepare_matmul(half, False) is half
    prepared = prepare_matmul(_tensor(1024, 1024), False)
    with capture_scope(), pytest.raises(RuntimeError, match="cannot be captured .* run with --graph off"):
        matmul(_tensor(1, 1024), prepared, False)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [0, 32, 128])
def test_a_quantized_product_is_within_the_ops_bound_and_a_swapped_nibble_is_not(bits: int, group: int) -> None:
    """MLAS's weight-only product (x rounded to int8 per block) against the native op, at the bound the op allows
    for that rounding (fd_core.runtime.kernel_checks.compare); fd's form is released after preparing. The same
    weight with its 4-bit values' nibbles swapped, or with a wrong row, fails the same comparison."""
    values, scales = quantize(_tensor(1024, 1024), bits, group=group)
    x = _tensor(4, 1024)
    want = native_ops.quant_matmul(x, values, scales, bits)
    prepared, folded = prepare_quant(values.clone(), scales.clone(), bits)
    assert isinstance(prepared, mlas.MlasQuantProduct) and folded is None
    got = quant_matmul(x, prepared, folded, bits)
    assert compare("quant_matmul", got, want, "float32", (x, values, scales, bits), native_ops) is None
    shifted = paddle.concat([values[1:], values[:1]])  # every row's values given to the row before
    wrong = [shifted]
    if bits == 4:
        four = paddle.to_tensor(4, dtype="int8")
        low = paddle.bitwise_right_shift(paddle.bitwise_left_shift(values, four), four)
        high = paddle.bitwise_right_shift(values, four)
        wrong.append(paddle.bitwise_or(paddle.bitwise_and(high, paddle.to_tensor(15, dtype="int8")),
                                       paddle.bitwise_left_shift(low, four)))
    for bad in wrong:
        product, _ = prepare_quant(bad, scales.clone(), bits)
        problem = compare("quant_matmul", quant_matmul(x, product, None, bits), want, "float32",
                          (x, values, scales, bits), native_ops)
        assert problem is not None and "largest error" in problem


def test_a_group_mlas_has_no_kernel_for_is_served_by_paddle() -> None:
    """Groups of 24 (no MLAS block): fd's form is kept and dequantized by the native product."""
    values, scales = quantize(_tensor(1024, 960), 8, group=24)
    prepared, kept = prepare_quant(values, scales, 8)
    assert prepared is values and kept is scales
    x = _tensor(2, 960)
    np.testing.assert_allclose(quant_matmul(x, prepared, kept, 8).numpy(),
                               native_ops.quant_matmul(x, values, scales, 8).numpy(), rtol=1e-5, atol=1e-5)


def test_leading_dimensions_an_odd_k_and_a_strided_x_are_bound_as_rows() -> None:
    """The product binds x's memory by address with its leading dimensions taken as rows: a [2, 3, K] x, a strided
    view of a wider tensor (copied to contiguous first) and a 4-bit weight of odd K (x given a zero column) all give
    the native op's result in x's leading shape. A binding that read the view's parent, or dropped the padding, would
    not."""
    values, scales = quantize(_tensor(1024, 1025), 4)
    prepared, folded = prepare_quant(values.clone(), scales.clone(), 4)
    assert isinstance(prepared, mlas.MlasQuantProduct) and prepared.k == 1026
    wide = _tensor(2, 3, 2050)
    x = wide[:, :, ::2]
    assert not x.is_contiguous()
    got = quant_matmul(x, prepared, folded, 4)
    assert list(got.shape) == [2, 3, 1024]
    want = native_ops.quant_matmul(x.contiguous(), values, scales, 4)
    assert compare("quant_matmul", got, want, "float32", (x.contiguous(), values, scales, 4), native_ops) is None


def test_an_x_of_the_wrong_width_is_refused_not_read_past() -> None:
    """Bound by address, an x of another width than the weight's K would be read as if it had K columns: refused in
    one line instead (a float product, and a quantized one but for its odd-K column)."""
    prepared = prepare_matmul(_tensor(1024, 1024), False)
    values, scales = quantize(_tensor(1024, 1024), 8)
    quantized, folded = prepare_quant(values, scales, 8)
    for width in (1000, 1100):
        with pytest.raises(ValueError, match=f"x has {width} columns, the weight takes 1024"):
            matmul(_tensor(2, width), prepared, False)
        with pytest.raises(ValueError, match=f"x has {width} columns, the weight takes 1024"):
            quant_matmul(_tensor(2, width), quantized, folded, 8)
