"""Plugins found through their entry points and imported, with the FD_PLUGINS allow-list applied and name clashes
found."""

from __future__ import annotations

import os
import sys
from importlib.metadata import EntryPoint, entry_points
from typing import Iterable, Mapping

from fd_core.errors import PluginError
from fd_core.host.paddle_logs import quiet_paddle_logs
from fd_core.host.records import GROUPS, Kind, PluginRecord, normalise


def _allow_list(env: Mapping[str, str]) -> set[str] | None:
    raw = env.get("FD_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def _allowed(record: PluginRecord, allow: set[str] | None) -> bool:
    if allow is None or record.builtin:
        return True
    return record.name in allow or normalise(record.distribution) in {normalise(a) for a in allow}


def _entry_points() -> list[tuple[Kind, EntryPoint]]:
    found: list[tuple[Kind, EntryPoint]] = []
    seen: set[tuple[str | None, str, str]] = set()
    for group, kind in GROUPS.items():
        for ep in entry_points(group=group):
            # One distribution visible twice on sys.path yields its entry points twice: keep one. Two
            # distributions declaring the same name are both kept, and the clash is reported.
            key = (normalise(ep.dist.name) if ep.dist else None, group, ep.name)
            if key in seen:
                continue
            seen.add(key)
            found.append((kind, ep))
    return found


def clashes(records: list[PluginRecord]) -> list[str]:
    """A message per plugin name that a second distribution also claims in the same group, blaming the newcomer."""
    problems = []
    by_name: dict[tuple[Kind, str], list[PluginRecord]] = {}
    for record in records:
        if record.allowed:
            by_name.setdefault((record.kind, record.name), []).append(record)
    for (kind, name), claimants in by_name.items():
        if len(claimants) < 2:
            continue
        # The built-in (or else the first found) keeps the name; every other claimant is the newcomer.
        keeper = next((r for r in claimants if r.builtin), claimants[0])
        for newcomer in claimants:
            if newcomer is keeper:
                continue
            newcomer.error = (
                f"distribution {newcomer.distribution!r} declares {kind} plugin {name!r}, which "
                f"{keeper.distribution or 'another plugin'} already provides; uninstall it, or leave it out with "
                f"FD_PLUGINS"
            )
            problems.append(newcomer.error)
    return problems


def discover(
    env: Mapping[str, str] | None = None, extra: Iterable[tuple[Kind, str, object]] = ()
) -> list[PluginRecord]:
    """Find and import every plugin; a plugin that fails to import is recorded and warned about, not skipped."""
    env = os.environ if env is None else env
    allow = _allow_list(env)
    quiet_paddle_logs()  # a plugin may import paddle when imported
    records: list[PluginRecord] = []
    for kind, ep in _entry_points():
        dist = ep.dist
        record = PluginRecord(
            name=ep.name,
            kind=kind,
            value=ep.value,
            distribution=dist.name if dist else None,
            version=dist.version if dist else None,
        )
        if not _allowed(record, allow):
            record.allowed = False
            record.status = f"left out: not in FD_PLUGINS (add {record.name} to it to load this plugin)"
            records.append(record)
            continue
        try:
            record.module = ep.load()
        # Any import failure is the plugin's (sys.exit too), reported below.
        except (Exception, SystemExit) as exc:  # noqa: BLE001
            record.load_error = f"import failed: {type(exc).__name__}: {exc}"
            record.status = "not loaded"
            print(f"fd: warning: plugin {record.name!r} ({record.value}) failed to import: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
        records.append(record)
    for kind, name, module in extra:
        records.append(PluginRecord(name=name, kind=kind, value=getattr(module, "__name__", repr(module)),
                                    module=module))  # type: ignore[arg-type]
    if allow:
        known = {r.name for r in records} | {normalise(r.distribution) for r in records if r.distribution}
        missing = sorted(a for a in allow if a not in known and normalise(a) not in known)
        if missing:
            installed = ", ".join(sorted(r.name for r in records if not r.builtin)) or "none"
            raise PluginError(
                f"FD_PLUGINS names {', '.join(missing)}, which is not installed; "
                f"installed third-party plugins: {installed}"
            )
    return records
