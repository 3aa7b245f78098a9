"""The architectures model packages registered (graph-clear enforced for graph-capable ones), by name and alias."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from fd_core.errors import ConfigError, PluginError
from fd_core.models import Architecture


@dataclass
class ModelRegistry:
    """Architectures by name (and alias), filled through the `fd_register_models` hook."""

    _by_name: dict[str, Architecture] = field(default_factory=dict)
    _aliases: dict[str, str] = field(default_factory=dict)
    _builtin: dict[str, bool] = field(default_factory=dict)
    # Model packages written for another contract major (name -> "it was written for ...; install ..."): never
    # registered, so a lookup that fails says why their architectures are missing.
    skipped: dict[str, str] = field(default_factory=dict)

    def add(self, arch: Architecture, *, has_clear_hook: bool, builtin: bool = False) -> None:
        """Register `arch`; a clash blames `arch`'s package, so register built-ins first."""
        if arch.graph_capable and not has_clear_hook:
            raise PluginError(
                f"plugin {arch.package!r} registers graph-capable architecture {arch.name!r} "
                f"without a graph-clear hook: implement fd_clear_graphs(model) in {arch.package!r} "
                f"or register it with graph_capable=False"
            )
        for key in (arch.name, *arch.aliases):
            owner = self._aliases.get(key)
            if owner is None:
                continue
            holder = self._by_name[owner]
            provider = f"the built-in {holder.package!r}" if self._builtin.get(owner, False) else repr(holder.package)
            raise PluginError(
                f"plugin {arch.package!r} registers architecture {key!r}, already registered by {provider}; "
                f"rename it in {arch.package!r}"
            )
        self._by_name[arch.name] = arch
        self._builtin[arch.name] = builtin
        for key in (arch.name, *arch.aliases):
            self._aliases[key] = arch.name

    def remove_package(self, package: str) -> None:
        """Drop every architecture `package` registered (its registration failed part way)."""
        for name in [n for n, a in self._by_name.items() if a.package == package]:
            del self._by_name[name]
            self._builtin.pop(name, None)
            for key in [k for k, v in self._aliases.items() if v == name]:
                del self._aliases[key]

    def builtin(self, name: str) -> bool:
        """Whether architecture `name` comes with fd-backends itself (not a third party's model package)."""
        return self._builtin.get(self.get(name).name, False)

    def get(self, name: str) -> Architecture:
        key = self._aliases.get(name)
        if key is None:
            raise ConfigError(f"unknown architecture {name!r}; {self.listing()}")
        return self._by_name[key]

    def listing(self) -> str:
        """'registered: name (aliases), ...' for error messages, and each model package skipped as incompatible."""
        skipped = "".join(f"; model package {name!r} is not loaded: {why}" for name, why in self.skipped.items())
        if not self._by_name:
            return f"registered: none (no model package is installed){skipped}"
        names = [f"{a.name} ({', '.join(a.aliases)})" if a.aliases else a.name for a in self]
        return "registered: " + ", ".join(names) + skipped

    def __contains__(self, name: object) -> bool:
        return name in self._aliases

    def __iter__(self) -> Iterator[Architecture]:
        return iter(sorted(self._by_name.values(), key=lambda a: a.name))

    def __len__(self) -> int:
        return len(self._by_name)
