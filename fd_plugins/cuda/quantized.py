"""Weight-only quantized products on NVIDIA GPUs: Paddle's weight_quantize repacks fd's quantized form once, when a
weight loads, into the layout weight_only_linear reads on this device's architecture; each product is then one
weight_only_linear call. Its activations and result are float16 or bfloat16: a float32 run's are cast to float16
for it, so its products are float16-close, not float32-close (not verified on a GPU here; docs/quantization.md).
A 4-bit weight of odd K carries fd's zero padding column, and the activations get a zero column to match. Weights in
groups of 64 or 128 (contract 1.6) keep their groups (weight_quantize's and weight_only_linear's group_size); other
group sizes (32, wint4's default) stay in fd's form, served by the native product."""

from __future__ import annotations

import functools
from typing import Any, Literal

# The architectures (compute capability x 10) Paddle's weight-only kernels are built for.
ARCHS = (70, 75, 80, 86, 89, 90, 100)
ALGOS: dict[int, Literal["weight_only_int8", "weight_only_int4"]] = {8: "weight_only_int8", 4: "weight_only_int4"}
WEIGHT_DTYPES = {8: "int8", 4: "int4"}
# weight_quantize's layouts tile the [K, N] weight: N a multiple of 16 and K of 64 on every architecture above.
N_MULTIPLE, K_MULTIPLE = 16, 64
# The group sizes weight_quantize and weight_only_linear take (besides -1, per output channel).
GROUP_SIZES = (64, 128)


@functools.cache
def device_arch() -> int:
    """Compute capability of device 0 as Paddle's weight-only kernels name it (8.0 -> 80)."""
    import paddle

    major, minor = paddle.device.cuda.get_device_capability()
    return int(major) * 10 + int(minor)


def prepare(weight: Any, scales: Any, bits: int) -> tuple[Any, Any]:
    """fd's quantized form -> (weight_quantize's packed int8 weight, its float16 scales); returned as given when the
    device or the weight's shape is one the weight-only kernels do not take (the product then dequantizes)."""
    import paddle

    from fd_core.quantization import dequantize

    rows, columns = weight.shape[0], weight.shape[1] * (2 if bits == 4 else 1)
    group = -1 if len(scales.shape) == 1 else columns // scales.shape[1]
    if device_arch() not in ARCHS or rows % N_MULTIPLE or columns % K_MULTIPLE or group not in (-1, *GROUP_SIZES):
        return weight, scales
    full = dequantize(weight, scales, bits, columns).astype("float16").transpose([1, 0])  # [K, N]
    # Requantized in fd's groups (the same largest value per group, so the same scales to float16's precision).
    packed, packed_scales = paddle.nn.quant.weight_quantize(full, algo=ALGOS[bits], arch=device_arch(),
                                                            group_size=group)  # type: ignore[arg-type]
    return packed, packed_scales


def quant_matmul(x: Any, weight: Any, scales: Any, bits: int) -> Any:
    """weight_only_linear on a prepared weight (float16 scales); fd's own form (float32 scales) dequantized."""
    import paddle

    if scales.dtype == paddle.float32:  # not repacked by prepare: the native op's way
        from fd_core.native_ops import quant_matmul as native

        return native(x, weight, scales, bits)
    half = x if x.dtype in (paddle.float16, paddle.bfloat16) else x.astype("float16")
    if bits == 4 and half.shape[-1] % 2:  # the weight's K is padded to even (fd's 4-bit form): pad x to match
        half = paddle.concat([half, paddle.zeros([*half.shape[:-1], 1], dtype=half.dtype)], axis=-1)
    # weight_quantize's grouped scales are [K / group, N]; per output channel [N].
    group = -1 if len(scales.shape) == 1 else half.shape[-1] // scales.shape[0]
    out = paddle.nn.quant.weight_only_linear(
        half, weight, weight_scale=scales.astype(half.dtype), weight_dtype=WEIGHT_DTYPES[bits],  # type: ignore[arg-type]
        arch=device_arch(), group_size=group,  # type: ignore[arg-type]
    )
    return out if out.dtype == x.dtype else out.astype(x.dtype)
