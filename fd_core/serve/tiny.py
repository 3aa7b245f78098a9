"""The tiny preset with a tokenizer: seeded random weights and a small byte-level BPE tokenizer trained here,
with a chat template, so that `fd serve` works offline on a fresh machine (the text it writes is noise)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from fd_core.errors import ConfigError

# The ids the tiny text presets give their special tokens (pad_token_id 0, bos 1, eos 2) come first.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
# One role marker per turn, then its text; the assistant's marker opens the reply. Offered tools come first, in a
# system turn that teaches the <tool_call> JSON format fd parses (an assistant turn's calls are written back in it).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nYou may call these functions; write each call as <tool_call>\n"
    "{\"name\": ..., \"arguments\": {...}}\n</tool_call>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "{% endif %}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}{% set arguments = call['function']['arguments'] %}<tool_call>\n"
    "{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ arguments if arguments is string else arguments | tojson }}}\n</tool_call>{% endfor %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Text the merges are learnt from: plain English, so that common words become single tokens.
CORPUS = """\
A language model reads a prompt and writes a continuation, one token at a time. The server keeps the model
loaded on its ranks and answers requests as they arrive: each request joins the running batch at the next step
and leaves it when it stops, at an end of sequence, a stop string or its token limit. Clients send prompts,
messages and settings such as the temperature, the nucleus probability and the seed; the same seed gives the
same tokens. The weights of this tiny model are random numbers drawn from a seed, so what it writes is noise,
but every part of the path is real: the tokenizer, the chat template, the plan, the ranks and the engine.
Hello, world! How are you today? The quick brown fox jumps over the lazy dog. Once upon a time there was a
small model that lived on two processor cores and talked to anyone who opened a connection to its port.
Numbers like 1, 2, 3, 10, 42 and 2026 appear too, with symbols such as #, %, & and (brackets).
"""


def picture_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """{config key: token text} of the picture tokens a vision-language config names (its top-level `*_token_id`
    integers naming an image, a video or vision: `image_token_id`, the start and end markers, the video ones), in
    the order of their ids. The text tokens (bos, eos, pad) are the tokenizer's own and keep their ids."""
    keys = [k for k, v in config.items() if k.endswith("_token_id") and isinstance(v, int) and not isinstance(v, bool)
            and any(part in k for part in ("image", "video", "vision"))]
    return {k: f"<|{k.removesuffix('_token_id')}|>" for k in sorted(keys, key=lambda k: config[k])}


def vl_chat_template(pictures: Mapping[str, str]) -> str:
    """CHAT_TEMPLATE for a model that takes pictures: a message's content may be a list of parts, and each image part
    is the start marker, `image_token_id`'s placeholder (which fd expands to the picture's tokens) and the end marker,
    as the published VL templates write it."""
    image = [k for k in pictures if not k.startswith("video")]
    marker = "".join(pictures[k] for k in sorted(image, key=lambda k: (0 if "start" in k else 2 if "end" in k else 1)))
    content = ("{% if message['content'] is string or message['content'] is none %}{{ message['content'] or '' }}"
               "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}" + marker
               + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}")
    return CHAT_TEMPLATE.replace("{{ message['content'] or '' }}", content)


def _save_tokenizer(tokenizer: Any, directory: Path, pictures: Mapping[str, str]) -> None:
    """tokenizer.json and tokenizer_config.json, with the chat template (the picture tokens' for a model that takes
    `pictures`: {config key: token text}), into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    added = {str(tokenizer.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                             "normalized": False, "single_word": False}
             for t in [*SPECIAL_TOKENS, *pictures.values()]}
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                              "pad_token": "<pad>", "clean_up_tokenization_spaces": False,
                              "chat_template": vl_chat_template(pictures) if pictures else CHAT_TEMPLATE,
                              "added_tokens_decoder": added}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _trained(vocab_size: int, pictures: Mapping[str, str]) -> Any:
    """A byte-level BPE tokenizer of at most `vocab_size` ids learnt from CORPUS, the special and picture tokens
    first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*SPECIAL_TOKENS, *pictures.values()],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([line for line in CORPUS.splitlines() if line] * 8, trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ConfigError(
            f"the tiny tokenizer has {tokenizer.get_vocab_size()} ids, more than the model's vocabulary of {vocab_size}"
        )
    return tokenizer


def write_tiny_checkpoint(
    directory: str | Path, model: str = "ernie4_5", seed: int = 0, config_path: str | None = None,
    dtype: str = "float32",
) -> Path:
    """Seeded random weights of `model`'s tiny preset (or of the config at `config_path`) as a checkpoint directory
    with a tokenizer and a chat template. For a model that takes pictures the tokenizer holds its picture tokens, and
    the checkpoint's config names their ids (the preset's own ids are replaced by the tokenizer's)."""
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.save_random import random_config, save_random_checkpoint
    from fd_core.runtime.weights import check_new_directory

    check_new_directory(Path(directory))  # before a tokenizer is trained
    arch, data, _ = random_config(load_plugins(), model, config_path)
    vocab_size = arch.config_from(data, source=config_path or f"preset of {arch.name}").vocab_size
    pictures = picture_tokens(data) if arch.multimodal else {}
    tokenizer = _trained(vocab_size, pictures)
    ids = {key: tokenizer.token_to_id(text) for key, text in pictures.items()}
    path = save_random_checkpoint(arch.name, str(directory), seed=seed, config_path=config_path, dtype=dtype,
                                  overrides=ids)
    _save_tokenizer(tokenizer, path, pictures)
    return path
