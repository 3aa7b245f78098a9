"""Parameters that carry their checkpoint spec, and loading / releasing them by checkpoint name.

A parameter maps to one checkpoint tensor (`new_param`), or stacks several of the same shape along
a new first axis (`new_stacked_param`: a mixture of experts keeps its experts' weights in one
tensor so that a step can gather the chosen ones, while checkpoints store one tensor per expert),
or holds one or more [out, in] checkpoint tensors transposed and side by side as [in, sum of out]
(`new_columns_param`: one matrix-vector product for q, k and v, or for the gate and up projections,
and the o and down projections stored transposed, in the layout Paddle's CPU product reads fastest).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import paddle
from paddle import nn

from fd_core import WeightSpec
from fd_models.layers.products import PREPARED

# (internal prefix, checkpoint prefix) pairs; the first matching pair renames a parameter.
Renames = Sequence[tuple[str, str]]


def _create(layer: nn.Layer, shape: Sequence[int], dtype: str, attr: str) -> paddle.Tensor:
    # paddle's stubs take a dtype name only as a Literal; ours is a str (ModelConfig.dtype, which
    # ModelConfig.check keeps to COMPUTE_DTYPES).
    param = layer.create_parameter(list(shape), dtype=dtype,  # type: ignore[arg-type]
                                   default_initializer=nn.initializer.Constant(0.0))
    # No storage until load_weights fills it (the runner always loads after build): a model whose weights are
    # quantized or prepared as they load never holds all of its float weights at once.
    param._clear_data()
    param.stop_gradient = True  # inference only: no autograd bookkeeping, even outside no_grad
    setattr(layer, attr, param)
    return param


def new_param(layer: nn.Layer, spec: WeightSpec, tp_size: int, *, attr: str = "weight") -> paddle.Tensor:
    """Create this rank's shard of `spec` on `layer` as `attr`, without storage (load_weights fills it)."""
    param = _create(layer, spec.shard_shape(tp_size), spec.dtype, attr)
    param.fd_spec = spec
    return param


def new_stacked_param(
    layer: nn.Layer, parts: Sequence[tuple[str, WeightSpec]], tp_size: int, *, attr: str,
) -> paddle.Tensor:
    """This rank's shards of several same-shaped checkpoint tensors stacked on a new first axis, as `attr` of `layer`.

    `parts` are (checkpoint name relative to `layer`, spec) in stacking order.
    """
    shapes = {spec.shard_shape(tp_size) for _, spec in parts}
    assert len(shapes) == 1, f"stacked parts of {attr} differ in shape: {shapes}"
    param = _create(layer, [len(parts), *shapes.pop()], parts[0][1].dtype, attr)
    param.fd_parts = list(parts)
    return param


def new_columns_param(
    layer: nn.Layer, parts: Sequence[tuple[str, WeightSpec]], tp_size: int, *, attr: str = "weight",
) -> paddle.Tensor:
    """This rank's shards of [out_i, in] checkpoint tensors, transposed and side by side:
    [in, sum of out_i], as `attr` of `layer`.

    `parts` are (checkpoint name relative to `layer`, spec) in column order; x @ param gives their outputs concatenated.
    """
    shapes = [spec.shard_shape(tp_size) for _, spec in parts]
    inner = {shape[1] for shape in shapes}
    assert all(len(shape) == 2 for shape in shapes) and len(inner) == 1, (
        f"columns of {attr} differ in their input size: {shapes}")
    param = _create(layer, [inner.pop(), sum(shape[0] for shape in shapes)], parts[0][1].dtype, attr)
    param.fd_columns = list(parts)
    param.fd_tp = tp_size
    return param


def _rename(name: str, renames: Renames) -> str:
    for internal, external in renames:
        if name.startswith(internal):
            return external + name[len(internal) :]
    return name


def _entries(layer: nn.Layer, renames: Renames) -> Iterator[tuple[paddle.Tensor, list[tuple[str, WeightSpec]]]]:
    """(parameter, [(checkpoint name, spec), ...]) for every spec-carrying parameter (shared ones once)."""
    for name, param in layer.named_parameters():
        if hasattr(param, "fd_spec"):
            yield param, [(_rename(name, renames), param.fd_spec)]
        elif hasattr(param, "fd_parts") or hasattr(param, "fd_columns"):
            prefix = name.rsplit(".", 1)[0] + "." if "." in name else ""
            parts = param.fd_parts if hasattr(param, "fd_parts") else param.fd_columns
            yield param, [(_rename(prefix + part, renames), spec) for part, spec in parts]


def weight_specs(layer: nn.Layer, renames: Renames = ()) -> dict[str, WeightSpec]:
    """The checkpoint specs (full shapes, split axes) of `layer`'s parameters."""
    return {name: spec for _, parts in _entries(layer, renames) for name, spec in parts}


def _tensor(value: Any, dtype: Any) -> paddle.Tensor:
    if not isinstance(value, paddle.Tensor):
        value = paddle.to_tensor(np.ascontiguousarray(value))
    return value if value.dtype == dtype else value.astype(dtype)


def _load_in_pieces(param: paddle.Tensor, name: str, pieces: Iterator[tuple[int, Any]]) -> None:
    """Fill `param` from (first row, piece) pairs in place, re-creating storage that release_weights cleared."""
    if not param._is_initialized():
        # Storage of the parameter's own size, shared rather than copied (assign would stage a second one).
        paddle.empty(param.shape, dtype=param.dtype)._share_buffer_to(param)
    filled = 0
    for start, piece in pieces:
        value = _tensor(piece, param.dtype)
        if tuple(value.shape[1:]) != tuple(param.shape[1:]) or start + value.shape[0] > param.shape[0]:
            raise ValueError(f"load_weights: {name!r} piece at row {start} has shape {list(value.shape)}, "
                             f"expected rows of {list(param.shape)}")
        param[start : start + value.shape[0]] = value
        filled += value.shape[0]
        del piece, value  # before the next piece is read (see CheckpointShards.chunks)
    if filled != param.shape[0]:
        raise ValueError(f"load_weights: {name!r} has {filled} rows, expected {param.shape[0]}")


def _load_columns(
    param: paddle.Tensor, parts: Sequence[tuple[str, WeightSpec]], shards: Mapping[str, Any], tp_size: int,
) -> None:
    """Fill a columns parameter: each part's rows (pieces of them, for a checkpoint) transposed
    into its columns, in place."""
    if not param._is_initialized():
        paddle.empty(param.shape, dtype=param.dtype)._share_buffer_to(param)
    chunks = getattr(shards, "chunks", None)
    column = 0
    for name, spec in parts:
        rows = spec.shard_shape(tp_size)[0]
        pieces = chunks(name) if chunks is not None else iter([(0, shards[name])])
        filled = 0
        for start, piece in pieces:
            value = _tensor(piece, param.dtype)
            if len(value.shape) != 2 or value.shape[1] != param.shape[0] or start + value.shape[0] > rows:
                raise ValueError(f"load_weights: {name!r} piece at row {start} has shape {list(value.shape)}, "
                                 f"expected rows of [{rows}, {param.shape[0]}]")
            param[:, column + start : column + start + value.shape[0]] = value.transpose([1, 0])
            filled += value.shape[0]
            del piece, value
        if filled != rows:
            raise ValueError(f"load_weights: {name!r} has {filled} rows, expected {rows}")
        column += rows


def load_weights(
    layer: nn.Layer, shards: Mapping[str, Any], renames: Renames = (),
    after: Callable[[paddle.Tensor], None] | None = None,
) -> None:
    """Assign this rank's shards (numpy arrays or paddle tensors) to the parameters; every parameter must be present.

    `after(param)` runs as each parameter is filled (products.prepare_after_load: a weight prepared or quantized
    before the next is read, so the float weights are never all held at once).

    Each shard is fetched, converted to its parameter's dtype and assigned in turn, so a lazy
    mapping (a checkpoint read on access) holds one parameter's tensors at a time; a mapping with
    `chunks(name)` (a checkpoint) is copied piece by piece into a large parameter, so not even one
    whole tensor is staged beside it.
    """
    entries = list(_entries(layer, renames))
    missing = sorted({name for _, parts in entries for name, _ in parts} - set(shards))
    if missing:
        raise KeyError(f"load_weights: no shard for {missing[0]!r} ({len(missing)} missing)")
    chunks = getattr(shards, "chunks", None)
    for param, parts in entries:
        _load_one(param, parts, shards, chunks)
        if after is not None:
            after(param)


def _load_one(
    param: paddle.Tensor, parts: list[tuple[str, WeightSpec]], shards: Mapping[str, Any], chunks: Any,
) -> None:
    if hasattr(param, "fd_columns"):
        _load_columns(param, parts, shards, param.fd_tp)
    elif chunks is not None and hasattr(param, "fd_spec") and len(param.shape) > 0:
        _load_in_pieces(param, parts[0][0], chunks(parts[0][0]))
    else:
        values = [_tensor(shards[name], param.dtype) for name, _ in parts]
        value = values[0] if hasattr(param, "fd_spec") else paddle.stack(values)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"load_weights: {parts[0][0]!r} has shape {list(value.shape)}, expected {list(param.shape)}"
            )
        # assign (unlike set_value from a tensor) also re-creates storage that release_weights cleared.
        paddle.assign(value, output=param)


def release_weights(layer: nn.Layer) -> None:
    """Free every parameter's storage and every weight prepared from one (before an in-place update); load_weights
    restores them."""
    for param in layer.parameters():
        param._clear_data()
    for name, buffer in layer.named_buffers():
        if PREPARED in name.rsplit(".", 1)[-1]:
            buffer._clear_data()
