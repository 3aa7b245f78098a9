"""Parameters that carry their checkpoint spec, and loading / releasing them by checkpoint name."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import paddle
from paddle import nn

from fd_core.weights import WeightSpec

# (internal prefix, checkpoint prefix) pairs; the first matching pair renames a parameter.
Renames = Sequence[tuple[str, str]]


def new_param(
    layer: nn.Layer, spec: WeightSpec, tp_size: int, *, attr: str = "weight"
) -> paddle.Tensor:
    """Create this rank's shard of `spec` on `layer` as `attr`, zero-filled (load_weights fills it)."""
    # Zeros, not a random init: the runner always loads weights after build, so a random draw is waste.
    param = layer.create_parameter(
        list(spec.shard_shape(tp_size)), dtype=spec.dtype, default_initializer=nn.initializer.Constant(0.0)
    )
    param.stop_gradient = True  # inference only: no autograd bookkeeping, even outside no_grad
    param.fd_spec = spec
    setattr(layer, attr, param)
    return param


def _rename(name: str, renames: Renames) -> str:
    for internal, external in renames:
        if name.startswith(internal):
            return external + name[len(internal) :]
    return name


def named_params(layer: nn.Layer, renames: Renames = ()) -> dict[str, paddle.Tensor]:
    """Every spec-carrying parameter of `layer` under its checkpoint name (shared ones once)."""
    return {_rename(name, renames): p for name, p in layer.named_parameters() if hasattr(p, "fd_spec")}


def weight_specs(layer: nn.Layer, renames: Renames = ()) -> dict[str, WeightSpec]:
    """The checkpoint specs (full shapes, split axes) of `layer`'s parameters."""
    return {name: p.fd_spec for name, p in named_params(layer, renames).items()}


def load_weights(layer: nn.Layer, shards: Mapping[str, Any], renames: Renames = ()) -> None:
    """Assign this rank's shards (numpy arrays or paddle tensors) to the parameters; every parameter must be present.

    Each shard is fetched, converted to its parameter's dtype and assigned in turn, so a lazy
    mapping (a checkpoint read on access) holds one tensor at a time.
    """
    params = named_params(layer, renames)
    missing = sorted(set(params) - set(shards))
    if missing:
        raise KeyError(f"load_weights: no shard for {missing[0]!r} ({len(missing)} missing)")
    for name, param in params.items():
        value = shards[name]
        if not isinstance(value, paddle.Tensor):
            value = paddle.to_tensor(np.ascontiguousarray(value))
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"load_weights: {name!r} has shape {list(value.shape)}, expected {list(param.shape)}")
        if value.dtype != param.dtype:
            value = value.astype(param.dtype)
        # assign (unlike set_value from a tensor) also re-creates storage that release_weights cleared.
        paddle.assign(value, output=param)


def release_weights(layer: nn.Layer) -> None:
    """Free every parameter's storage (before an in-place update); load_weights restores it."""
    for param in layer.parameters():
        param._clear_data()
