"""Chat templates: the checkpoint's Jinja template rendered as transformers renders it, and the image
placeholders it emits expanded to one token per merged block of each picture."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

from fd_core.errors import CheckpointError, ConfigError
from fd_core.runtime.tokenizer import JsonReader, read_json


def load_chat_template(directory: str | Path, read: JsonReader = read_json) -> str | None:
    """The chat template of a checkpoint: chat_template.jinja, chat_template.json, or tokenizer_config.json's."""
    path = Path(directory)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        template = read(path / name).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if isinstance(template, str):
            return template
        if template is not None:
            raise CheckpointError(f"{path / name}: chat_template must be a string or a list of named templates")
    return None


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def user_message(text: str, images: int = 0) -> dict[str, Any]:
    """A user turn: plain text, or (with pictures) one image part per picture followed by the text, as VL templates expect."""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": text}]}


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], special_tokens: Mapping[str, str], add_generation_prompt: bool = True) -> str:
    """The conversation as the model's prompt text; a template that fails is a one-line ConfigError with its error."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # The environment transformers renders chat templates in.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, tools=None, documents=None, **special_tokens
        )
    except TemplateError as exc:
        raise ConfigError(f"the chat template failed to render: {exc}".replace("\n", " ")) from None


def expand_placeholders(ids: Sequence[int], token_id: int, counts: Sequence[int]) -> list[int]:
    """Each lone image placeholder replaced by `counts[k]` copies for the k-th picture, as the reference processors do.

    A prompt whose placeholders do not number one per picture (already expanded, say) is returned as it
    is: the model's prompt check then says what is wrong.
    """
    ids = list(ids)
    if sum(1 for t in ids if t == token_id) != len(counts):
        return ids
    out: list[int] = []
    pictures = iter(counts)
    for token in ids:
        out += [token] * (next(pictures) if token == token_id else 1)
    return out
