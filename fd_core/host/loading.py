"""load_plugins: discover, validate, select the platform, register with pluggy, and fill the registries (a
PluginSet)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Mapping

import pluggy

from fd_core import hookspecs
from fd_core.contract import contract_mismatch, contract_problem, contract_warning, declared_contract
from fd_core.detection import Detection
from fd_core.errors import PluginError
from fd_core.host.discovery import clashes, discover
from fd_core.host.kernel_table import KernelTable
from fd_core.host.model_registry import ModelRegistry
from fd_core.host.records import Kind, PluginRecord
from fd_core.host.registration import register_commands, register_kernels, register_models, register_transports
from fd_core.host.selection import detect, hook_timeout, select_platform
from fd_core.host.validation import validate_module
from fd_core.markers import PROJECT

# The contract warnings (a newer minor, another major skipped) already printed by this process.
_warned: set[str] = set()
# How a skipped plugin is named in its warning (an extension and a model package may share a name).
_KIND_NAMES: dict[Kind, str] = {"platform": "platform", "model": "model package", "extension": "extension"}


@dataclass
class PluginSet:
    """Everything loaded, the selected platform, the hook manager and the architecture registry."""

    records: list[PluginRecord]
    platform: str
    selection: str
    pm: pluggy.PluginManager
    registry: ModelRegistry = field(default_factory=ModelRegistry)
    # Subcommands plugins add to `fd`: name -> (help, run, plugin).
    commands: dict[str, tuple[str, Callable[[list[str]], int], str]] = field(default_factory=dict)
    # What makes this set unusable for a run (a plugin that failed validation or registration, a
    # platform name claimed twice); `fd plugins` lists them, everything else raises the first.
    problems: list[str] = field(default_factory=list)
    # The kernels the active platform and the extensions registered for fd's named ops.
    kernels: KernelTable = field(default_factory=KernelTable)
    # The KV transports plugins provide (contract 1.9): name -> (factory(listen, rank), plugin).
    transports: dict[str, tuple[Any, str]] = field(default_factory=dict)

    def require_usable(self) -> None:
        """Raise the first problem as a PluginError (a run must not start with a broken plugin)."""
        if self.problems:
            more = f" (and {len(self.problems) - 1} more problem(s); see fd plugins)" if len(self.problems) > 1 else ""
            raise PluginError(self.problems[0] + more)

    @property
    def detection(self) -> Detection:
        record = self.record(self.platform)
        if record.detection is not None:
            return record.detection
        return Detection(detected=False, reason=record.detect_error or "not detected")

    def record(self, name: str, kind: Kind = "platform") -> PluginRecord:
        """The plugin of that kind and name; when two distributions claim the name, the one in use."""
        matches = [r for r in self.records if r.name == name and r.kind == kind]
        if not matches:
            raise KeyError(name)
        return next((r for r in matches if r.active), next((r for r in matches if r.error is None), matches[0]))


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _register(pm: pluggy.PluginManager, name: str, module: object) -> None:
    try:
        pm.register(module, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        # validate_module has already checked what fd can name precisely; this is pluggy's own verdict.
        raise PluginError(f"plugin {name!r}: pluggy refused it: {' '.join(str(exc).split())}") from None


def _incompatible_selection(records: list[PluginRecord], platform: str, forced: bool) -> str | None:
    """The one-line refusal when the platform selected (forced or detected) is written for another contract major."""
    chosen = next((r for r in records if r.kind == "platform" and r.name == platform and r.allowed
                   and r.error is None and r.module is not None), None)
    if chosen is None or chosen.incompatible is None:
        return None
    if forced:
        return f"platform {platform!r} is selected (FD_PLATFORM={platform}), but {chosen.incompatible}"
    return (f"platform {platform!r} detected its hardware and is selected, but {chosen.incompatible}, or set "
            f"FD_PLATFORM to another platform")


def load_plugins(
    env: Mapping[str, str] | None = None, extra: Iterable[tuple[Kind, str, object]] = (), *, strict: bool = True,
    planned: str | None = None, reserved_commands: Collection[str] = (),
) -> PluginSet:
    """Discover, validate and register plugins, select the platform, and fill the architecture registry.

    With `strict` (every caller but `fd plugins`), a plugin that fails validation or registration,
    or a name two distributions claim, raises a PluginError naming it; without, it is recorded on
    its record and in `problems`, left out, and the listing goes on. A plugin written for another
    contract major is skipped with a warning (never validated or registered) and is an error only
    as the platform selected (forced or detected). `planned` (a rank's call) is the
    platform the planning process selected: only its detection runs again, so that a detection that
    hangs costs its time limit once, in the planning process, not again in every rank.
    `reserved_commands` are the host program's own command names, which a plugin's command may not take.
    """
    env = os.environ if env is None else env
    timeout = hook_timeout(env)
    records = discover(env, extra)
    problems = clashes(records)
    for record in records:
        if record.module is None:
            continue
        # The contract it was written for, before anything else: not a version is a broken plugin; another major
        # makes it incompatible (skipped: its hooks are another contract's); a newer minor is warned about.
        record.contract, record.contract_declared = declared_contract(record.module)
        problem = contract_problem(record.name, record.contract) if record.error is None else None
        if problem is not None:
            record.error = problem
            problems.append(problem)
            continue
        record.incompatible = contract_mismatch(record.name, record.contract) if record.error is None else None
        if record.incompatible is not None:
            continue
        warning = contract_warning(record.name, record.contract)
        if warning is not None and warning not in _warned:  # once a process, however often plugins load
            _warned.add(warning)
            print(f"fd: warning: {warning}", file=sys.stderr)
        if record.error is None:
            try:
                validate_module(record.name, record.module)
            except PluginError as exc:
                record.error = str(exc)
                problems.append(record.error)
    if strict and problems:
        raise PluginError(problems[0])
    for record in records:
        if record.kind == "platform" and record.module is not None and record.error is None:
            if planned is not None and record.name != planned:
                record.detect_error = f"not asked: the run was planned on {planned!r}"
                continue
            # An incompatible platform is asked too (quietly): detected at the top, it is what the user's hardware
            # needs, and the run must say so rather than fall back to another platform.
            detect(record, timeout, quiet=record.incompatible is not None)
    platform, why = select_platform(records, env)
    refusal = _incompatible_selection(records, platform, bool(env.get("FD_PLATFORM", "").strip()))
    if refusal is not None:
        if strict:
            raise PluginError(refusal)
        problems.append(refusal)
    pm = new_plugin_manager()
    for record in records:
        if record.module is None:
            continue
        if record.error is not None:
            record.status = f"failed: {record.error}"
            continue
        if record.incompatible is not None:
            record.status = f"incompatible: {record.incompatible}"
            skipped = f"{_KIND_NAMES[record.kind]} {record.name!r} is skipped: {record.incompatible}"
            # Once a process, however often plugins load; not again in a rank (its planning process warned), nor for
            # the selected platform (refused above instead).
            if planned is None and skipped not in _warned and (record.kind, record.name) != ("platform", platform):
                _warned.add(skipped)
                print(f"fd: warning: {skipped}", file=sys.stderr)
            continue
        if record.kind == "platform":
            record.active = record.name == platform
            if record.active:
                record.status = f"active: {why}"
            elif record.detect_error:
                record.status = f"not active: {record.detect_error}"
            elif record.detection and record.detection.detected:
                record.status = f"not active: detected, but {platform!r} was chosen ({why})"
            else:
                record.status = f"not active: not detected: {record.detection.reason if record.detection else ''}"
            if not record.active:
                continue
        else:
            record.active = True
            record.status = "active"
        _register(pm, record.name, record.module)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(" ".join(str(exc).split())) from None
    registry = ModelRegistry(skipped={r.name: r.incompatible for r in records
                                      if r.kind == "model" and r.incompatible is not None})
    problems += register_models(pm, registry, records)
    commands, command_problems = register_commands(pm, records, reserved_commands)
    problems += command_problems
    kernels, kernel_problems = register_kernels(pm, records)
    problems += kernel_problems
    transports, transport_problems = register_transports(pm, records)
    problems += transport_problems
    for record in records:
        if record.error is not None and record.active:
            record.active, record.status = False, f"failed: {record.error}"
    plugins = PluginSet(records=records, platform=platform, selection=why, pm=pm, registry=registry, problems=problems,
                        commands=commands, kernels=kernels, transports=transports)
    if strict:
        plugins.require_usable()
    return plugins
