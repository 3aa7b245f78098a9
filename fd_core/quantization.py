"""Weight-only quantization (contract 1.1; groups 1.6): the schemes `--quantization` names and fd's quantized form of
a weight, which the `quant_matmul` op takes and a platform's preparation may repack into its own.

A weight [N, K] (N outputs, K inputs) is quantized symmetrically, per group of G consecutive inputs of each output
(contract 1.6) or per output channel (G = K: the 1.1 form): a group's scale is its largest |w[n, k]| divided by the
scheme's largest level (127 for wint8, 7 for wint4), and each value is round(w / scale) as an int8. The scales are
float32 [N, K / G] (group g of row n covers columns [gG, (g + 1)G)), or [N] per output channel. A weight whose K is
not a multiple of G is quantized per output channel. wint4 packs two values a byte along K (column 2j in the low four
bits of byte j, 2j + 1 in the high four; an odd K is padded with a zero), so it holds half of wint8's bytes. An
all-zero group gets scale 1 (its values are zero either way).

Each scheme has a default group size (DEFAULT_GROUPS, `--quantization-group` chooses another, 0 per output channel):
4 bits per channel lose too much (none of 32 greedy tokens of ERNIE-4.5-0.3B equal float32's), and groups of 32 are
llama.cpp's q4_0 and q8_0 blocks.

The LM head is quantized to HEAD_BITS at least (`head_bits`): every logit is one of its rows, so its error reaches
the output undamped; under wint4 it holds 8 bits (llama.cpp likewise keeps its output tensor at 6 bits under q4_0).
"""

from __future__ import annotations

from typing import Any

# --quantization NAME -> bits a weight value holds.
SCHEMES = {"wint8": 8, "wint4": 4}
# The largest level of each width: symmetric, so -127..127 and -7..7 (-128 and -8 are never produced).
LEVELS = {8: 127, 4: 7}
# --quantization NAME -> the group size used unless --quantization-group says otherwise (0: per output channel).
DEFAULT_GROUPS = {"wint8": 128, "wint4": 32}


# The fewest bits the LM head is quantized to, whatever the scheme (see the module's docstring).
HEAD_BITS = 8


def head_bits(scheme: str) -> int:
    """The bits of the LM head under `scheme`."""
    return max(SCHEMES[scheme], HEAD_BITS)


def group_for(columns: int, group: int) -> int:
    """The group a weight of `columns` inputs is quantized in: `group`, or `columns` (per output channel) when `group`
    is 0 or does not divide it."""
    return group if group > 0 and columns % group == 0 else columns


def bits_of(scheme: str) -> int:
    """The bits of a scheme name (a KeyError for one fd does not have)."""
    return SCHEMES[scheme]


def quantized_bytes(rows: int, columns: int, bits: int, group: int = 0) -> int:
    """Bytes of an [rows, columns] weight in fd's quantized form: the values and the float32 scales (one per group of
    `group` columns; 0: one a row)."""
    groups = columns // group_for(columns, group)
    return rows * (columns if bits == 8 else (columns + 1) // 2) + 4 * rows * groups


def quantize(weight: Any, bits: int, transpose_weight: bool = True, group: int = 0) -> tuple[Any, Any]:
    """(values int8, scales float32) of a float weight: [N, K] when `transpose_weight` (as `x @ weight^T` uses it),
    else [K, N] (as `x @ weight` does); the values are [N, K] (bits 8) or [N, ceil(K / 2)] (bits 4) either way, the
    scales [N, K / G] in groups of G = group_for(K, group) inputs, or [N] per output channel (G = K)."""
    import paddle

    if bits not in LEVELS:
        raise ValueError(f"quantize: bits must be 8 or 4, got {bits!r}")
    rows = weight.shape[0] if transpose_weight else weight.shape[1]
    # A block of output rows at a time: the float temporaries of an LM head (a vocabulary of rows) stay small.
    step = max(1, QUANTIZE_ELEMENTS // max(1, weight.shape[1] if transpose_weight else weight.shape[0]))
    parts = [_quantized_rows(weight[a:a + step] if transpose_weight else weight[:, a:a + step].transpose([1, 0]),
                             bits, group) for a in range(0, rows, step)]
    if len(parts) == 1:
        return parts[0]
    return paddle.concat([p[0] for p in parts]), paddle.concat([p[1] for p in parts])


# Elements of a weight quantize() turns into fd's form at once.
QUANTIZE_ELEMENTS = 1 << 22


def _quantized_rows(w: Any, bits: int, group: int) -> tuple[Any, Any]:
    """fd's form of rows [n, K] of a weight (quantize)."""
    import paddle

    w = w.astype("float32")
    rows, columns = w.shape
    size = group_for(columns, group)
    blocks = w.reshape([rows, columns // size, size])
    peak = paddle.max(paddle.abs(blocks), axis=2)
    scales = paddle.where(peak > 0, peak / LEVELS[bits], paddle.ones_like(peak))
    levels = paddle.clip(paddle.round(blocks / scales.unsqueeze(2)), -LEVELS[bits], LEVELS[bits])
    values = levels.astype("int8").reshape([rows, columns])
    if size == columns:
        scales = scales.reshape([rows])
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
    wide = values.astype("float32")
    scales = scales.astype("float32")
    if len(scales.shape) == 1:
        return wide * scales.unsqueeze(1)
    rows, width = wide.shape
    groups = scales.shape[1]
    return (wide.reshape([rows, groups, width // groups]) * scales.unsqueeze(2)).reshape([rows, width])


def _int8(value: int) -> Any:
    import paddle

    return paddle.to_tensor(value, dtype="int8")
