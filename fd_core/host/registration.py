"""The registering hooks called plugin by plugin (models, commands, kernels): a plugin that fails is undone and
blamed, never fatal here."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Collection

import pluggy

from fd_core.contract import FIRST_VERSION
from fd_core.errors import PluginError
from fd_core.host.kernel_table import KernelTable, check_kernel
from fd_core.host.model_registry import ModelRegistry
from fd_core.host.records import PluginRecord, impl_function
from fd_core.models import Architecture
from fd_core.transfer import TransportFactory


def caller_for(pm: pluggy.PluginManager, hook: str, plugin_name: str) -> Any:
    """A hook caller that runs `plugin_name`'s implementation of `hook` with every wrapper around it (pluggy's own
    API)."""
    others = [i.plugin for i in getattr(pm.hook, hook).get_hookimpls()
              if i.plugin_name != plugin_name and not (i.wrapper or i.hookwrapper)]
    return pm.subset_hook_caller(hook, remove_plugins=others)


def call_each(
    pm: pluggy.PluginManager,
    hook: str,
    records: list[PluginRecord],
    register_for: Callable[[str], Callable[..., None]],
    undo: Callable[[str], None],
    builtins_first: bool = False,
) -> list[str]:
    """Call `hook` plugin by plugin, through pluggy with every wrapper around each, passing
    `register=register_for(plugin)`. A plugin that fails is undone (`undo(plugin)`) and marked on its
    record, and its message returned: a failure is that plugin's, never fatal here."""
    by_name = {r.name: r for r in records if r.module is not None}
    impls = [i for i in reversed(getattr(pm.hook, hook).get_hookimpls()) if not (i.wrapper or i.hookwrapper)]
    if builtins_first:  # so that a name clash blames the newcomer
        impls.sort(key=lambda i: not (i.plugin_name in by_name and by_name[i.plugin_name].builtin))
    problems = []
    for impl in impls:
        owner = impl.plugin_name
        try:
            caller_for(pm, hook, owner)(register=register_for(owner))
        except PluginError as exc:
            message = str(exc)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the plugin's own error (sys.exit included)
            message = f"plugin {owner!r}: {hook} raised {type(exc).__name__}: {exc}"
        else:
            continue
        problems.append(message)
        undo(owner)
        if owner in by_name:
            by_name[owner].error = message
    return problems


def register_models(pm: pluggy.PluginManager, registry: ModelRegistry, records: list[PluginRecord]) -> list[str]:
    """Each model package's fd_register_models; a package that fails is marked and its architectures removed."""
    builtin = {r.name for r in records if r.module is not None and r.builtin}

    def register_for(owner: str) -> Callable[[Architecture], None]:
        has_clear = impl_function(pm.get_plugin(owner), "fd_clear_graphs") is not None

        def register(arch: Architecture) -> None:
            if not isinstance(arch, Architecture):
                raise PluginError(
                    f"plugin {owner!r}: fd_register_models passed {type(arch).__name__} to register(); "
                    "pass fd_core.Architecture"
                )
            registry.add(replace(arch, package=owner), has_clear_hook=has_clear, builtin=owner in builtin)

        return register

    return call_each(pm, "fd_register_models", records, register_for, registry.remove_package, builtins_first=True)


def register_commands(
    pm: pluggy.PluginManager, records: list[PluginRecord], reserved: Collection[str] = ()
) -> tuple[dict[str, Any], list[str]]:
    """Each plugin's fd_register_commands; a clash with a `reserved` name (the host program's own commands) or another
    plugin's command is that plugin's error."""
    commands: dict[str, tuple[str, Callable[[list[str]], int], str]] = {}

    def register_for(owner: str) -> Callable[..., None]:
        def register(name: str, help: str, run: Callable[[list[str]], int]) -> None:  # noqa: A002 - argparse's word
            if not (isinstance(name, str) and name.replace("-", "").isalnum() and callable(run)):
                raise PluginError(
                    f"plugin {owner!r}: fd_register_commands passed name={name!r}, run={run!r}; "
                    "pass a word and a callable"
                )
            taken = "fd itself" if name in reserved else commands[name][2] if name in commands else None
            if taken is not None:
                raise PluginError(
                    f"plugin {owner!r} adds command {name!r}, which {taken!r} already provides; rename it in {owner!r}"
                )
            commands[name] = (str(help), run, owner)

        return register

    def undo(owner: str) -> None:
        for name in [n for n, c in commands.items() if c[2] == owner]:
            del commands[name]

    return commands, call_each(pm, "fd_register_commands", records, register_for, undo)


def register_kernels(pm: pluggy.PluginManager, records: list[PluginRecord]) -> tuple[KernelTable, list[str]]:
    """The active platform's and each extension's fd_register_kernels; a model package may not provide kernels."""
    table = KernelTable()
    kinds = {r.name: r.kind for r in records if r.module is not None and r.active}
    contracts = {r.name: r.contract for r in records if r.module is not None and r.active}

    def register_for(owner: str) -> Callable[..., None]:
        kind = kinds.get(owner, "extension")

        def register(
            op: str, fn: Callable[..., Any], capturable: bool = True, prepare: Callable[..., Any] | None = None,
        ) -> None:
            if kind == "model":
                raise PluginError(
                    f"plugin {owner!r}: a model package may not register kernels; "
                    "put them in a platform or an fd.plugins extension"
                )
            kernel = replace(check_kernel(owner, op, fn, capturable, prepare),
                                         contract=contracts.get(owner) or FIRST_VERSION)
            table.add(kernel, from_platform=kind == "platform")

        return register

    return table, call_each(pm, "fd_register_kernels", records, register_for, table.remove_plugin)


def register_transports(
    pm: pluggy.PluginManager, records: list[PluginRecord]
) -> tuple[dict[str, tuple[TransportFactory, str]], list[str]]:
    """Each plugin's fd_kv_transports (contract 1.9): name -> (factory, plugin); a name taken twice is the later
    plugin's error."""
    transports: dict[str, tuple[TransportFactory, str]] = {}

    def register_for(owner: str) -> Callable[..., None]:
        def register(name: str, factory: TransportFactory) -> None:
            if not (isinstance(name, str) and name.replace("-", "").isalnum() and callable(factory)):
                raise PluginError(f"plugin {owner!r}: fd_kv_transports passed name={name!r}, factory={factory!r}; "
                                  "pass a word and a callable factory(listen, rank)")
            if name in transports:
                raise PluginError(f"plugin {owner!r} adds KV transport {name!r}, which {transports[name][1]!r} "
                                  f"already provides; rename it in {owner!r}")
            transports[name] = (factory, owner)

        return register

    def undo(owner: str) -> None:
        for name in [n for n, t in transports.items() if t[1] == owner]:
            del transports[name]

    return transports, call_each(pm, "fd_kv_transports", records, register_for, undo, builtins_first=True)
