"""Weights this package prepares once, when they load (contract 1.1): the kernels below read them only in the layout
their preparation made, so each product is one `x @ W` with nothing done to the weight per call.

- `matmul`: every weight held [K, N] (a weight the layers use transposed, [N, K], is transposed once at load).
- `quant_matmul`: fd's quantized form ([N, K] int8, or two 4-bit values a byte) unpacked and transposed once to int8
  [K, N]; a product widens it to float32, multiplies, then applies the per-output scales. A weight quantized in
  groups (contract 1.6) is dequantized once at load instead.

FD_EXAMPLE_KERNELS_BREAK=prepare makes the matmul preparation remember its result by the weight tensor's id(), the
shortcut a kernel-side cache takes: the same tensor refilled by a weight reload gives the old weight's products, and
`fd check` fails. FD_EXAMPLE_KERNELS_BREAK=quant_matmul swaps the two 4-bit values of a byte when unpacking.
"""

from __future__ import annotations

import os
from typing import Any

_by_id: dict[int, Any] = {}


def _broken(what: str) -> bool:
    return os.environ.get("FD_EXAMPLE_KERNELS_BREAK") == what


def prepare_matmul(weight: Any, transpose_weight: bool) -> Any:
    """The weight as `matmul` reads it: [K, N]."""
    if _broken("prepare") and id(weight) in _by_id:
        return _by_id[id(weight)]
    prepared = weight.transpose([1, 0]).contiguous() if transpose_weight else weight
    if _broken("prepare"):
        _by_id[id(weight)] = prepared
    return prepared


def matmul(x: Any, weight: Any, transpose_weight: bool) -> Any:
    """x [..., K] @ a prepared weight [K, N] (transpose_weight was applied by prepare_matmul)."""
    import paddle

    return paddle.matmul(x, weight)


def prepare_quant(weight: Any, scales: Any, bits: int) -> tuple[Any, Any]:
    """fd's quantized form -> (int8 [K, N], the float32 scales [N]); a weight in groups (scales [N, groups], contract
    1.6) -> (its float32 [K, N], dequantized once, and no scales)."""
    import paddle

    if bits == 4:
        four = paddle.to_tensor(4, dtype="int8")
        low = paddle.bitwise_right_shift(paddle.bitwise_left_shift(weight, four), four)
        high = paddle.bitwise_right_shift(weight, four)
        pair = [high, low] if _broken("quant_matmul") else [low, high]
        weight = paddle.stack(pair, axis=-1).reshape([weight.shape[0], -1])
    if len(scales.shape) == 2:
        rows, groups = scales.shape
        # A 4-bit weight of odd K was padded by a zero column: the groups cover the first K = groups x size columns.
        size = weight.shape[1] // groups
        grouped = weight[:, : groups * size].astype("float32").reshape([rows, groups, size])
        full = (grouped * scales.astype("float32").unsqueeze(2)).reshape([rows, groups * size])
        return full.transpose([1, 0]).contiguous(), None
    return weight.transpose([1, 0]).contiguous(), scales.astype("float32")


def quant_matmul(x: Any, weight: Any, scales: Any, bits: int) -> Any:
    """x [..., K] @ a prepared int8 [K', N] (K' is K, or K + 1 when a 4-bit K was odd and padded), then the scales;
    or @ a prepared float32 [K, N] (no scales: a weight in groups)."""
    import paddle

    values = weight[: x.shape[-1]] if weight.shape[0] != x.shape[-1] else weight
    out = paddle.matmul(x.astype("float32"), values.astype("float32"))
    return (out if scales is None else out * scales).astype(x.dtype)
