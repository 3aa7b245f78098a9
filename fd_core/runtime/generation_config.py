"""`generation_config.json`: end-of-sequence ids and default sampling settings of a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


@dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint says about generation: its end-of-sequence ids, pad id, and sampling defaults."""

    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, data: Mapping[str, Any], model_config: Mapping[str, Any] | None = None) -> "GenerationDefaults":
        """The defaults in generation_config.json's `data`, with config.json's eos/pad ids as transformers falls back to."""
        model: dict[str, Any] = dict(model_config or {})
        nested = model.get("text_config")
        text: Mapping[str, Any] = nested if isinstance(nested, Mapping) else {}
        eos: list[int] = []
        for source in (data, model, text):
            eos += [i for i in _ids(source.get("eos_token_id")) if i not in eos]
        pads = _ids(data.get("pad_token_id")) or _ids(model.get("pad_token_id")) or _ids(text.get("pad_token_id"))
        sampling: dict[str, Any] = {k: data[k] for k in ("do_sample", "temperature", "top_p", "top_k") if k in data}
        return cls(tuple(eos), pads[0] if pads else None, sampling)
