"""Weight-only quantization (contract 1.1): the schemes `--quantization` names and fd's quantized form of a weight,
which the `quant_matmul` op takes and a platform's preparation may repack into its own.

A weight [N, K] (N outputs, K inputs) is quantized per output channel, symmetrically: scales[n] is the largest
|w[n, k]| over k divided by the scheme's largest level (127 for wint8, 7 for wint4), and each value is
round(w / scales[n]) as an int8. wint4 packs two values a byte along K (column 2j in the low four bits of byte j,
2j + 1 in the high four; an odd K is padded with a zero), so it holds half of wint8's bytes. An all-zero row gets
scale 1 (its values are zero either way).
"""

from __future__ import annotations

from typing import Any

# --quantization NAME -> bits a weight value holds.
SCHEMES = {"wint8": 8, "wint4": 4}
# The largest level of each width: symmetric, so -127..127 and -7..7 (-128 and -8 are never produced).
LEVELS = {8: 127, 4: 7}


def bits_of(scheme: str) -> int:
    """The bits of a scheme name (a KeyError for one fd does not have)."""
    return SCHEMES[scheme]


def quantized_bytes(rows: int, columns: int, bits: int) -> int:
    """Bytes of an [rows, columns] weight in fd's quantized form: the values and the float32 scales."""
    return rows * (columns if bits == 8 else (columns + 1) // 2) + 4 * rows


def quantize(weight: Any, bits: int, transpose_weight: bool = True) -> tuple[Any, Any]:
    """(values int8, scales float32 [N]) of a float weight: [N, K] when `transpose_weight` (as `x @ weight^T` uses
    it), else [K, N] (as `x @ weight` does); the values are [N, K] (bits 8) or [N, ceil(K / 2)] (bits 4) either way."""
    import paddle

    if bits not in LEVELS:
        raise ValueError(f"quantize: bits must be 8 or 4, got {bits!r}")
    w = weight.astype("float32")
    if not transpose_weight:
        w = w.transpose([1, 0])
    peak = paddle.max(paddle.abs(w), axis=1)
    scales = paddle.where(peak > 0, peak / LEVELS[bits], paddle.ones_like(peak))
    levels = paddle.clip(paddle.round(w / scales.unsqueeze(1)), -LEVELS[bits], LEVELS[bits])
    values = levels.astype("int8")
    return (values if bits == 8 else pack_int4(values)), scales


def pack_int4(values: Any) -> Any:
    """int8 values in [-8, 7], [N, K] -> [N, ceil(K / 2)] bytes, two a byte (low four bits: the even column)."""
    import paddle

    if values.shape[1] % 2:
        values = paddle.concat([values, paddle.zeros([values.shape[0], 1], dtype="int8")], axis=1)
    low, high = values[:, 0::2], values[:, 1::2]
    return paddle.bitwise_or(paddle.bitwise_and(low, _int8(15)), paddle.bitwise_left_shift(high, _int8(4)))


def unpack_int4(packed: Any, columns: int) -> Any:
    """[N, ceil(K / 2)] bytes -> int8 values [N, K] (`columns` = K), sign-extended from four bits."""
    import paddle

    low = paddle.bitwise_right_shift(paddle.bitwise_left_shift(packed, _int8(4)), _int8(4))
    high = paddle.bitwise_right_shift(packed, _int8(4))
    return paddle.stack([low, high], axis=-1).reshape([packed.shape[0], -1])[:, :columns]


def dequantize(values: Any, scales: Any, bits: int, columns: int | None = None) -> Any:
    """The float32 weight [N, K] fd's quantized form stands for; `columns` (K) is needed for bits 4 with an odd K
    (by default twice the bytes a row)."""
    if bits == 4:
        values = unpack_int4(values, 2 * values.shape[1] if columns is None else columns)
    return values.astype("float32") * scales.astype("float32").unsqueeze(1)


def _int8(value: int) -> Any:
    import paddle

    return paddle.to_tensor(value, dtype="int8")
