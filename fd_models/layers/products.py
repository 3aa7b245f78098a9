"""The products of the linear layers (and of the routed experts): each weight the matmul op (or moe_experts)
consumes, prepared once when it loads.

A `Product` holds one parameter (the tensor a checkpoint loads into) and calls the kernel in use on what that
kernel asked to receive: after each load (and so after each reload) the parameter is quantized when the run asks
for weight-only quantization (`ModelConfig.quantization`: fd's quantized form, then the `quant_matmul` kernel's
preparation), or else handed to the `matmul` kernel's preparation, if it has one. What a preparation returns is
held as buffers of the layer, written in place on a reload, so a captured graph reads the new values and a replay
runs no preparation; the parameter's own storage is then released (load_weights re-creates it for the next load).
With the native kernels and no quantization nothing is prepared, copied or released.
"""

from __future__ import annotations

from typing import Any, Callable

import paddle
from paddle import nn

from fd_core.quantization import bits_of, quantize

# What a prepared weight's buffer is named after its parameter: `{attr}_prepared_{i}` (params.release_weights frees
# them with the parameters).
PREPARED = "_prepared_"


class Product:
    """x times one weight of `layer` (its parameter `attr`, [N, K] used transposed, or [K, N] as is)."""

    def __init__(
        self, layer: nn.Layer, attr: str, transpose_weight: bool, ctx: Any, quantizable: bool = True,
        release: bool = True, on_quantized: Callable[[paddle.Tensor, paddle.Tensor, int], None] | None = None,
        least_bits: int = 0,
    ) -> None:
        self.layer, self.attr, self.transpose_weight = layer, attr, transpose_weight
        self.ops = ctx.ops
        # Vision towers, projectors and routers are never quantized (--quantization's scope), nor the LM head under
        # --float-embeddings.
        self.quantizable = quantizable
        # Quantized to this many bits at least whatever the scheme (the LM head: fd_core.quantization.HEAD_BITS).
        self.least_bits = least_bits
        # Whether the parameter's storage is released once prepared: not when another layer reads it too (a tied LM
        # head's weight is the embedding's table).
        self.release = release
        # Given fd's quantized form of the weight once made (values, scales, bits), before the kernel's preparation:
        # the layer that shares the weight (a tied embedding) keeps its own use of it, and the weight is released.
        self.on_quantized = on_quantized
        param = getattr(layer, attr)
        # How the loader finds this product after filling the parameter (params.load_weights' `after`).
        param.fd_product = self
        self.kernel = self.ops.matmul
        # The kernel's arguments after x: a tensor of the layer by its attribute name (looked up at each call, so that
        # a graph capture traces the layer's own parameter or buffer), or a value passed as is.
        self.args: tuple[tuple[str | None, Any], ...] = ((attr, None), (None, transpose_weight))

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.kernel(x, *_resolved(self.layer, self.args))

    def prepare(self, quantization: str | None, group: int = 0) -> None:
        """After the parameter is loaded: quantize (in groups of `group` inputs, 0 per output channel) and / or prepare
        it for the kernel in use, once."""
        param = getattr(self.layer, self.attr)
        if quantization is not None and self.quantizable:
            bits = max(bits_of(quantization), self.least_bits)
            values, scales = quantize(param, bits, self.transpose_weight, self.ops.quant_group(group))
            shared = self.on_quantized is not None
            if shared:
                self.on_quantized(values, scales, bits)  # type: ignore[misc]
            args = self.ops.prepare("quant_matmul", values, scales, bits)
            kernel = self.ops.prepared("quant_matmul")
        elif self.ops.prepares("matmul"):
            shared = False
            args = self.ops.prepare("matmul", param, self.transpose_weight)
            kernel = self.ops.prepared("matmul")
        else:
            return
        self.kernel, self.args = kernel, self._hold(args)
        if (self.release or shared) and all(name != self.attr and not getattr(value, "reads_weight", False)
                                for name, value in self.args):
            param._clear_data()  # the kernel reads only what was prepared from it

    def _hold(self, values: tuple[Any, ...]) -> tuple[tuple[str | None, Any], ...]:
        return tuple(hold(self.layer, self.attr, i, value) for i, value in enumerate(values))

    def loaded(self, param: paddle.Tensor, quantization: str | None, group: int = 0) -> None:
        self.prepare(quantization, group)


class ExpertProducts:
    """One modality's routed experts through the `moe_experts` op: their stacked gate, up and down weights
    (parameters `attrs` of `layer`) handed to the kernel's preparation together, once all three have loaded (and
    again after each reload), when the kernel in use prepares them (contract 1.4). Never quantized."""

    def __init__(self, layer: nn.Layer, attrs: tuple[str, str, str], ctx: Any) -> None:
        self.layer, self.attrs, self.ops = layer, attrs, ctx.ops
        self.kernel = self.ops.moe_experts
        # What the kernel gets as gate, up and down: a tensor of the layer by name (looked up at each call, so that a
        # capture traces the layer's own), or a value as is.
        self.args: tuple[tuple[str | None, Any], ...] = tuple((attr, None) for attr in attrs)
        self.filled: set[str] = set()  # which of the three this load has filled so far
        for attr in attrs:
            getattr(layer, attr).fd_product = self

    def __call__(self, x: paddle.Tensor, chosen: paddle.Tensor, weights: paddle.Tensor) -> paddle.Tensor:
        return self.kernel(x, *_resolved(self.layer, self.args), chosen, weights)

    def loaded(self, param: paddle.Tensor, quantization: str | None, group: int = 0) -> None:
        self.filled.update(attr for attr in self.attrs if getattr(self.layer, attr) is param)
        if len(self.filled) < len(self.attrs):
            return
        self.filled.clear()
        if not self.ops.prepares("moe_experts"):
            return
        weights = [getattr(self.layer, attr) for attr in self.attrs]
        # The routing is per call: the preparation takes the weights only (Op.prepare_args).
        values = self.ops.prepare("moe_experts", *weights, None, None)[:3]
        self.kernel = self.ops.prepared("moe_experts")
        self.args = tuple(hold(self.layer, attr, 0, value) for attr, value in zip(self.attrs, values, strict=True))
        kept = {name for name, _ in self.args}
        for attr, param in zip(self.attrs, weights, strict=True):
            if attr not in kept:
                param._clear_data()  # the kernel reads only what was prepared from it


def _resolved(layer: nn.Layer, args: tuple[tuple[str | None, Any], ...]) -> list[Any]:
    """A product's kernel arguments: each a tensor of the layer by name (looked up at each call, so that a capture
    traces the layer's own parameter or buffer), or a value as is."""
    return [value if name is None else getattr(layer, name) for name, value in args]


def hold(layer: nn.Layer, attr: str, index: int, value: Any) -> tuple[str | None, Any]:
    """A prepared value as the kernel gets it: (the layer's tensor name, None), or (None, a non-tensor as is). A
    tensor is held as a buffer of the layer named after its parameter: the same object load after load (a traced
    program holds it), its storage replaced."""
    if value is getattr(layer, attr, None):
        return attr, None
    if not isinstance(value, paddle.Tensor):
        return None, value
    name = f"{attr}{PREPARED}{index}"
    old = getattr(layer, name, None)
    if old is not None and old is not value and old.shape == value.shape and old.dtype == value.dtype:
        value._share_buffer_to(old)
    elif old is not value:
        layer.register_buffer(name, value, persistable=False)
    return name, None


def prepare_after_load(quantization: str | None, group: int = 0) -> Any:
    """The `after` function params.load_weights calls with each parameter it filled: prepares its product, if any."""

    def after(param: paddle.Tensor) -> None:
        product = getattr(param, "fd_product", None)
        if product is not None:
            product.loaded(param, quantization, group)

    return after

