"""Helpers for the model packages' plugin modules; no paddle import (`fd plugins` must stay light)."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_build(module: str) -> Callable[[Any, Any], Any]:
    """A `build(config, ctx)` that imports `module` (and so paddle) only when a model is built."""

    def build(config: Any, ctx: Any) -> Any:
        return importlib.import_module(module).build(config, ctx)

    build.__doc__ = f"Build the model with {module}.build (imported on first use)."
    return build


def is_instance(model: Any, module: str, class_name: str) -> bool:
    """isinstance(model, module.class_name) without importing `module`: unloaded means not ours."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(model, getattr(loaded, class_name))


def clear_graphs(model: Any, module: str, class_name: str, *, via: str | None = None) -> bool | None:
    """An fd_clear_graphs body: clear `model`'s graphs (or those of its `via` sub-model) if it is ours, else None."""
    if not is_instance(model, module, class_name):
        return None
    owner = getattr(model, via) if via is not None else model
    owner.clear_graph_opt_backend()
    return True
