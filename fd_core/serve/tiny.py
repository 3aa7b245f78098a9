"""The tiny preset with a tokenizer: seeded random weights and a small byte-level BPE tokenizer trained here,
with a chat template, so that `fd serve` works offline on a fresh machine (the text it writes is noise)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def train_tokenizer(directory: Path, vocab_size: int) -> None:
    """tokenizer.json (byte-level BPE of exactly `vocab_size` ids) and tokenizer_config.json with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([line for line in CORPUS.splitlines() if line] * 8, trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ConfigError(
            f"the tiny tokenizer has {tokenizer.get_vocab_size()} ids, more than the model's vocabulary of {vocab_size}"
        )
    tokenizer.save(str(directory / "tokenizer.json"))
    added = {str(tokenizer.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                             "normalized": False, "single_word": False} for t in SPECIAL_TOKENS}
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                              "pad_token": "<pad>", "clean_up_tokenization_spaces": False,
                              "chat_template": CHAT_TEMPLATE, "added_tokens_decoder": added}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def write_tiny_checkpoint(directory: str | Path, model: str = "ernie4_5", seed: int = 0) -> Path:
    """`model`'s tiny preset as a checkpoint directory (seeded random weights) with a tokenizer and a chat template."""
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.save_random import save_random_checkpoint

    arch = load_plugins().registry.get(model)  # an unknown name raises, listing the registered architectures
    if arch.multimodal:
        raise ConfigError(
            f"the tiny tokenizer serves text models, and {arch.name} takes pictures; "
            "pass --checkpoint DIR, or --model ernie4_5"
        )
    path = save_random_checkpoint(arch.name, str(directory), seed=seed)
    train_tokenizer(path, int(arch.preset["vocab_size"]))
    return path
