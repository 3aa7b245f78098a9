"""The architecture registry and the model protocol the runner drives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol

from fd_core.errors import ConfigError, PluginError
from fd_core.graphs import GraphBackend

if TYPE_CHECKING:
    import numpy as np

    from fd_core.config import ModelConfig
    from fd_core.weights import WeightSpec


class CausalModel(Protocol):
    """What an architecture's `build` returns; the runner calls only these."""

    config: "ModelConfig"

    def weight_specs(self) -> "dict[str, WeightSpec]":
        """Every checkpoint tensor with its full shape and tp split axis."""

    def load_weights(self, shards: "Mapping[str, np.ndarray]") -> None:
        """Assign this rank's shards (already checked against weight_specs) to the parameters."""

    def release_weights(self) -> None:
        """Free parameter storage; load_weights must work afterwards."""

    def allocate_cache(self, batch_size: int, max_len: int) -> None:
        """Preallocate the KV cache with fixed shapes, so decode replays a captured graph."""

    def prefill(self, input_ids: Any, image: Any = None) -> Any:
        """Run the prompt [B, S] (and image, for VL models); return last-position logits [B, vocab]."""

    def prefill_length(self, input_ids: Any, image: Any = None) -> int:
        """The first decode position after prefilling this prompt (image tokens included)."""

    def decode_step(self, token_ids: Any, position: int) -> Any:
        """One token per sequence [B, 1] at `position`; return logits [B, vocab] (full vocab)."""

    def capture(self, graph_backend: GraphBackend, batch_size: int) -> None:
        """Capture the decode step for `batch_size` through `graph_backend`; later steps replay it."""


@dataclass(frozen=True)
class Architecture:
    """A registered architecture: how to build it, its tiny preset, and its graph-clear hook's owner."""

    name: str
    build: Callable[["ModelConfig", Any], CausalModel]
    preset: Mapping[str, Any]
    package: str = ""
    graph_capable: bool = True
    multimodal: bool = False
    aliases: tuple[str, ...] = ()
    description: str = ""

    def preset_config(self) -> "ModelConfig":
        """The tiny preset as a ModelConfig."""
        from fd_core.config import ModelConfig

        return ModelConfig.from_dict(self.name, dict(self.preset))


@dataclass
class ModelRegistry:
    """Architectures by name (and alias), filled through the `fd_register_models` hook."""

    _by_name: dict[str, Architecture] = field(default_factory=dict)
    _aliases: dict[str, str] = field(default_factory=dict)

    def add(self, arch: Architecture, *, has_clear_hook: bool) -> None:
        if arch.graph_capable and not has_clear_hook:
            raise PluginError(
                f"plugin {arch.package!r} registers graph-capable architecture {arch.name!r} "
                f"without a graph-clear hook: implement fd_clear_graphs(model) in {arch.package!r} "
                f"or register it with graph_capable=False"
            )
        for key in (arch.name, *arch.aliases):
            owner = self._aliases.get(key)
            if owner is not None:
                raise PluginError(
                    f"plugin {arch.package!r} registers architecture {key!r}, already registered by "
                    f"{self._by_name[owner].package!r}; rename one of them"
                )
        self._by_name[arch.name] = arch
        for key in (arch.name, *arch.aliases):
            self._aliases[key] = arch.name

    def get(self, name: str) -> Architecture:
        key = self._aliases.get(name)
        if key is None:
            known = ", ".join(sorted(self._by_name)) or "none (no model package is installed)"
            raise ConfigError(f"unknown architecture {name!r}; registered: {known}")
        return self._by_name[key]

    def __contains__(self, name: object) -> bool:
        return name in self._aliases

    def __iter__(self) -> Iterator[Architecture]:
        return iter(sorted(self._by_name.values(), key=lambda a: a.name))

    def __len__(self) -> int:
        return len(self._by_name)
