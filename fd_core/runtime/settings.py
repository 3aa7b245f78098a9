"""What a run uses where the user said nothing: the option's value, else the platform's default (its Detection), else
fd's; each with where it came from (`fd explain` shows both; `--json` as "settings")."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fd_core.detection import DEFAULT_KV_BLOCK_SIZE
from fd_core.errors import ConfigError, setting
from fd_core.runtime.memory import DEFAULT_MAX_PREFILL_TOKENS

if TYPE_CHECKING:
    from fd_core.detection import Detection

DEFAULT_MAX_BATCH = 8
# fd's own default of each setting a platform may set (None: no limit).
FD_DEFAULTS: dict[str, int | None] = {
    "max_batch": DEFAULT_MAX_BATCH,
    "max_prefill_tokens": DEFAULT_MAX_PREFILL_TOKENS,
    "max_prefill_prompts": None,
    "kv_block_size": DEFAULT_KV_BLOCK_SIZE,
}
# How each reads in `fd explain`.
LABELS = {"max_batch": "max batch", "max_prefill_tokens": "prefill token budget a step",
          "max_prefill_prompts": "prompts prefilled a step", "kv_block_size": "KV-cache block size",
          "dtype": "compute dtype"}


@dataclass(frozen=True)
class Settings:
    """The run's resolved settings (plain data: it travels in the Plan) and the source of each: the option that set
    it, "platform NAME", or "fd's default"."""

    max_batch: int
    max_prefill_tokens: int
    max_prefill_prompts: int | None
    kv_block_size: int
    dtype: str
    sources: tuple[tuple[str, str], ...] = ()

    def source(self, name: str) -> str:
        return dict(self.sources)[name]

    def to_dict(self) -> dict[str, Any]:
        return {name: {"value": getattr(self, name), "from": self.source(name)} for name, _ in self.sources}

    def lines(self) -> list[str]:
        """ "max batch: 16 (platform mychip)", one a setting."""
        return [f"{LABELS[name]}: {'no limit' if getattr(self, name) is None else getattr(self, name)} ({source})"
                for name, source in self.sources]


def _positive(value: Any, name: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(f"{where} must be a positive integer, got {value!r:.40}")
    return int(value)


def resolve_settings(requested: dict[str, int | None], detection: Detection, platform: str, dtype: str,
                     dtype_requested: bool) -> Settings:
    """Each of FD_DEFAULTS: `requested[name]` (the user's), else the platform's `Detection` field of that name, else
    fd's default; `dtype` as the plan chose it (the user's, else the platform's preferred)."""
    values: dict[str, int | None] = {}
    sources: list[tuple[str, str]] = []
    for name, default in FD_DEFAULTS.items():
        mine = _positive(requested.get(name), name, setting(name))
        theirs = getattr(detection, name, None)
        if mine is not None:
            values[name], source = mine, setting(name)
        elif theirs is not None:
            values[name], source = theirs, f"platform {platform}"
        else:
            values[name], source = default, "fd's default"
        sources.append((name, source))
    sources.append(("dtype", setting("dtype") if dtype_requested else f"platform {platform} (its preferred)"))
    max_batch, tokens, block = values["max_batch"], values["max_prefill_tokens"], values["kv_block_size"]
    assert max_batch is not None and tokens is not None and block is not None
    return Settings(max_batch, tokens, values["max_prefill_prompts"], block, dtype, tuple(sources))
