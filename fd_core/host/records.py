"""What fd knows of each discovered plugin (PluginRecord), the entry-point groups, and pluggy's reading of a hook
implementation."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, Mapping

import pluggy

from fd_core import hookspecs
from fd_core.detection import Detection
from fd_core.markers import PROJECT

Kind = Literal["platform", "model", "extension"]
GROUPS: dict[str, Kind] = {"fd.platforms": "platform", "fd.models": "model", "fd.plugins": "extension"}
DISTRIBUTION = "fd-backends"
HOOK_NAMES: tuple[str, ...] = tuple(n for n in vars(hookspecs) if n.startswith(f"{PROJECT}_"))


@dataclass
class PluginRecord:
    """One discovered plugin: where it came from, whether it loaded, what it implements, what it said."""

    name: str
    kind: Kind
    value: str
    distribution: str | None = None
    version: str | None = None
    module: ModuleType | None = None
    allowed: bool = True
    load_error: str | None = None
    detection: Detection | None = None
    detect_error: str | None = None
    # Validation or registration failed: the plugin is listed, never registered, and `fd run` refuses to start.
    error: str | None = None
    # Written for another contract major ("it was written for ...; install ..."): listed, never registered, and
    # refused only as the platform a run selects.
    incompatible: str | None = None
    active: bool = False
    status: str = ""
    # The contract version the plugin was written for (its FD_CONTRACT), and whether it said so.
    contract: str = ""
    contract_declared: bool = False

    @property
    def builtin(self) -> bool:
        return normalise(self.distribution) == DISTRIBUTION

    @property
    def hooks(self) -> list[str]:
        if self.module is None:
            return []
        return sorted(n for n in HOOK_NAMES if impl_function(self.module, n) is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "module": self.value,
            "distribution": self.distribution,
            "version": self.version,
            "builtin": self.builtin,
            "allowed": self.allowed,
            "hooks": self.hooks,
            "detection": self.detection.to_dict() if self.detection else None,
            "error": self.load_error or self.incompatible or self.error or self.detect_error,
            "incompatible": self.incompatible is not None,
            "active": self.active,
            "status": self.status,
            "contract": self.contract or None,
            "contract_declared": self.contract_declared,
        }


def normalise(name: str | None) -> str | None:
    return None if name is None else name.lower().replace("_", "-")


_PARSER = pluggy.PluginManager(PROJECT)


def hookimpl_opts(module: object, name: str) -> Mapping[str, Any] | None:
    """pluggy's reading of `module.name` as a hook implementation (its options), None when it is not marked."""
    return _PARSER.parse_hookimpl_opts(module, name)


def impl_function(module: object, hook: str) -> Any:
    """`module`'s implementation of `hook` if it is marked with @hookimpl (pluggy's own parsing), else None."""
    fn = getattr(module, hook, None)
    return fn if callable(fn) and _PARSER.parse_hookimpl_opts(module, hook) is not None else None
