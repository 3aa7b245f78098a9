"""A plugin module checked before pluggy registers it: every marked hook matches a spec, every argument is one the
spec passes."""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from fd_core import hookspecs
from fd_core.errors import PluginError
from fd_core.host.records import HOOK_NAMES, hookimpl_opts
from fd_core.host.suggest import nearest
from fd_core.markers import PROJECT


def _hookspec_args(hook: str) -> tuple[str, ...]:
    return tuple(inspect.signature(getattr(hookspecs, hook)).parameters)


def arg_names(fn: Any) -> tuple[str, ...]:
    """The arguments pluggy passes to an implementation: positional ones without a default."""
    params = inspect.signature(fn).parameters.values()
    return tuple(
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    )


def validate_module(name: str, module: object) -> None:
    """Fail loudly on a hook that matches no spec, an unknown argument, or a missing @hookimpl."""
    for attr, value in vars(module).items() if hasattr(module, "__dict__") else ():
        if not callable(value):
            continue
        marked = hasattr(value, f"{PROJECT}_impl")
        if marked and attr not in HOOK_NAMES:
            raise PluginError(f"plugin {name!r}: hook {attr!r} matches no hookspec; {nearest(attr, HOOK_NAMES)}")
        if (
            not marked
            and attr in HOOK_NAMES
            and getattr(value, "__module__", None) == getattr(module, "__name__", None)
        ):
            raise PluginError(
                f"plugin {name!r}: function {attr!r} is named like a hook but lacks @hookimpl; "
                f"decorate it with fd_core.hookimpl"
            )
        if marked:
            opts: Mapping[str, Any] = hookimpl_opts(module, attr) or {}
            if (opts.get("wrapper") or opts.get("hookwrapper")) and not inspect.isgeneratorfunction(value):
                raise PluginError(
                    f"plugin {name!r}: hook {attr!r}: declared as wrapper=True or hookwrapper=True but function is "
                    f"not a generator function; make it a generator that yields exactly once"
                )
            spec_args = _hookspec_args(attr)
            impl_args = arg_names(value)
            for arg in impl_args:
                if arg not in spec_args:
                    raise PluginError(
                        f"plugin {name!r}: hook {attr!r} takes argument {arg!r}, which the hookspec "
                        f"{attr}({', '.join(spec_args)}) does not provide; {nearest(arg, spec_args)}"
                    )
