"""`fd plugins`: every discovered plugin, its hooks, kernels and detection answer, and the architectures."""

from __future__ import annotations

import argparse
from typing import Any

from fd_core.cli.common import CORE_COMMANDS, print_json, stdout, wrapped
from fd_core.contract import CONTRACT_VERSION


def add_parser(sub: Any) -> None:
    """The command and its options."""
    p = sub.add_parser("plugins", help="list every discovered plugin, its hooks and its detection answer")
    p.add_argument("--json", action="store_true", help="print JSON instead of the listing")
    p.set_defaults(func=cmd_plugins)


def cmd_plugins(args: argparse.Namespace) -> int:
    from fd_core.host.loading import load_plugins

    # Not strict: a plugin that fails validation or registration is listed with its error, not fatal.
    plugins = load_plugins(strict=False, reserved_commands=CORE_COMMANDS)
    rows = [{**r.to_dict(), "kernels": plugins.kernels.by_plugin(r.name) if r.active else [],
             "kv_transports": [n for n, (_, owner) in plugins.transports.items() if owner == r.name and r.active]}
            for r in plugins.records]
    if args.json:
        architectures = [a.to_dict() for a in plugins.registry]
        print_json({"contract_version": CONTRACT_VERSION, "platform": plugins.platform, "selection": plugins.selection,
                     "plugins": rows, "architectures": architectures, "problems": plugins.problems})
    else:
        print("\n".join(plugin_listing(plugins)), file=stdout())
    if plugins.problems:
        # The listing is printed; the exit code and the last line say the set is not usable for a run.
        plugins.require_usable()
    return 0



def plugin_listing(plugins: Any) -> list[str]:
    """`fd plugins` as text: each plugin's name and origin, then its status, error and hooks beneath it."""
    lines = wrapped(f"platform: {plugins.platform} ({plugins.selection})", 0, 2)
    # Capped: one long third-party name must not push every status towards the right margin.
    width = min(max((len(r.name) for r in plugins.records), default=0), 20) + 2
    for kind in ("platform", "model", "extension"):
        group = [r for r in plugins.records if r.kind == kind]
        if not group:
            continue
        lines += ["", f"{kind} plugins:"]
        for r in group:
            origin = f"{r.distribution} {r.version}" if r.distribution else "(not installed: passed in)"
            if r.contract:
                origin += f", contract {r.contract}" + ("" if r.contract_declared else " (not declared)")
            lines.append(f"  {r.name:<{width - 1}} {origin}")
            lines += wrapped(r.status, 2 + width, 2)
            if r.load_error:
                lines += wrapped(f"error: {r.load_error}", 2 + width, 7)
            if r.hooks:
                lines += wrapped(f"hooks: {', '.join(r.hooks)}", 2 + width, 7)
            kernels = plugins.kernels.by_plugin(r.name) if r.active else []
            if kernels:
                lines += wrapped(f"kernels: {', '.join(kernels)}", 2 + width, 9)
            transports = [name for name, (_, owner) in plugins.transports.items() if owner == r.name and r.active]
            if transports:
                lines += wrapped(f"kv transports: {', '.join(transports)}", 2 + width, 15)
    if plugins.registry:
        # The name fd takes (--model), the names checkpoints' config.json use for it, and the plugin it came from.
        lines += ["", "architectures:"]
        width = max(len(a.name) for a in plugins.registry) + 2
        for a in plugins.registry:
            aliases = f"aliases: {', '.join(a.aliases)}; " if a.aliases else ""
            lines += wrapped(f"{a.name:<{width}}{aliases}from plugin {a.package}", 2, width)
            if a.description:
                lines += wrapped(a.description, 2 + width)
    # Last, beside the contract each plugin declares above: what this fd implements.
    return [*lines, "", f"fd's plugin contract: {CONTRACT_VERSION}"]
