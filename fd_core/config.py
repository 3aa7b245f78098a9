"""Model, parallel and graph configuration: plain data, no paddle import."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from fd_core.errors import ConfigError

GraphMode = Literal["auto", "off"]


@dataclass(frozen=True)
class ModelConfig:
    """The fields the core reasons about; everything else of `config.json` stays in `extra`."""

    architecture: str
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, architecture: str, data: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face style `config.json` mapping; unknown keys go to `extra`."""
        known = {f.name for f in fields(cls)} - {"architecture", "extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known and k != "architecture"}
        try:
            return cls(architecture=architecture, extra=extra, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"config for {architecture!r} is malformed: {exc}") from None

    @classmethod
    def from_json(cls, architecture: str, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file; a checkpoint directory needs a config.json") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc}); fix or regenerate config.json") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object of model settings")
        return cls.from_dict(architecture, data)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("extra", "architecture")}
        data.update(self.extra)
        data["architecture"] = self.architecture
        return data

    def with_overrides(self, **changes: Any) -> "ModelConfig":
        return replace(self, **changes)

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ConfigError unless every sharded dimension divides by `tp`."""
        if tp < 1:
            raise ConfigError(f"--tp must be a positive integer, got {tp}")
        dims = {
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
        }
        bad = [f"{name}={value}" for name, value in dims.items() if value % tp]
        if bad:
            raise ConfigError(
                f"tp={tp} does not divide {', '.join(bad)} of {self.architecture}; "
                f"choose a tp that divides each of them"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Where this process sits in the tensor-parallel job."""

    tp_size: int = 1
    tp_rank: int = 0
    # The process group handed to all-reduce; None means the default (world) group.
    group: Any = None

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"tensor-parallel size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")


@dataclass(frozen=True)
class GraphConfig:
    """Whether to capture graphs and for which batch sizes (one capture each)."""

    mode: GraphMode = "auto"
    batch_sizes: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "off"):
            raise ConfigError(f"graph mode must be 'auto' or 'off', got {self.mode!r}")
