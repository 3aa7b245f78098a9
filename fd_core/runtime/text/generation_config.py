"""`generation_config.json`: end-of-sequence ids and default sampling settings of a checkpoint, checked by type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from fd_core.errors import CheckpointError

# The sampling settings a checkpoint may give defaults for, and the JSON types each must have.
SAMPLING_TYPES: dict[str, tuple[type, ...]] = {
    "do_sample": (bool,), "temperature": (int, float), "top_p": (int, float), "top_k": (int,)
}


def _ids(value: Any, key: str, where: str) -> tuple[int, ...]:
    """A token id or a list of them (null: none); anything else is refused, not dropped (a lost end-of-sequence id
    runs to the limit)."""
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise CheckpointError(
        f"{where}: {key} must be a token id or a list of token ids, got {type(value).__name__} {value!r:.40}; "
        f"fix the file"
    )


def _sampling(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The sampling defaults of `data`, each of its JSON type: the string "0.7" or "false" is refused, not misread."""
    sampling: dict[str, Any] = {}
    for key, types in SAMPLING_TYPES.items():
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted = "true or false" if bool in types else "an integer" if types == (int,) else "a number"
            raise CheckpointError(
                f"{where}: {key} must be {wanted}, got {type(value).__name__} {value!r:.40}; fix the file"
            )
        sampling[key] = value
    return sampling


@dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint says about generation: its end-of-sequence ids, pad id, and sampling defaults."""

    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls, data: Mapping[str, Any], model_config: Mapping[str, Any] | None = None, *,
        source: str = "generation_config.json", model_source: str = "config.json",
    ) -> "GenerationDefaults":
        """The defaults in generation_config.json's `data`, with config.json's eos/pad ids as transformers falls back
        to.

        `source` and `model_source` name the two files in the message when a value has the wrong type."""
        model: dict[str, Any] = dict(model_config or {})
        nested = model.get("text_config")
        text: Mapping[str, Any] = nested if isinstance(nested, Mapping) else {}
        sources = ((data, source), (model, model_source), (text, f"{model_source} (text_config)"))
        eos: list[int] = []
        for values, where in sources:
            eos += [i for i in _ids(values.get("eos_token_id"), "eos_token_id", where) if i not in eos]
        pads = next(
            (found for values, where in sources if (found := _ids(values.get("pad_token_id"), "pad_token_id", where))),
            (),
        )
        return cls(tuple(eos), pads[0] if pads else None, _sampling(data, source))
