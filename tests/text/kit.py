"""Tiny tokenizers trained here (no download) and saved into checkpoint directories,
as the published models lay them out.

Not a conftest.py: tests/failures imports its own `conftest` by name. Test modules import the fixtures from here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

# Non-ASCII on purpose: accents, CJK, Cyrillic and an emoji, whose UTF-8 bytes byte-level pieces split.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! How are you today?",
    "Tokenizers turn text into numbers and back again.",
    "Café crème brûlée, naïve résumé — déjà vu.",
    "日本語のテキストを少し書きます。東京と大阪。",
    "Привет, мир! Как дела?",
    "Numbers 12345 and symbols #@%& appear too 🙂🚀.",
    "A model reads a prompt and writes a continuation.",
]
# Texts the tests encode: some seen in training, some not (unknown characters fall back to bytes).
SAMPLES = ["Hello world", "Café crème, naïve", "日本語とテキスト", "Привет мир 🙂", "unseen Ωmega ∑ text ✓",
           "  leading and trailing  "]

# A Qwen-style chat template with image parts (what Qwen3-VL's chat_template.json does for a user turn).
QWEN_CHAT = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# An ERNIE-style template: the BOS token from the special-token variables, then alternating turns.
ERNIE_CHAT = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def bpe_tokenizer(directory: Path, vocab_size: int = 400) -> dict[str, int]:
    """A byte-level BPE tokenizer.json (Qwen style) with its tokenizer_config.json; returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.add_special_tokens(QWEN_SPECIALS)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in QWEN_SPECIALS}
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "unk_token": None, "clean_up_tokenization_spaces": False, "chat_template": QWEN_CHAT,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                     "single_word": False} for t, i in ids.items()
        },
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return ids


def sentencepiece_tokenizer(directory: Path, vocab_size: int = 420, add_bos: bool = False) -> dict[str, int]:
    """A SentencePiece tokenizer.model (ERNIE style: <unk> <s> </s>, byte fallback) with its JSON
    files; returns special ids."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        user_defined_symbols=["<|begin_of_sentence|>", "<mask:0>"],
        minloglevel=2,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "cls_token": "<|begin_of_sentence|>"}
    config = {**specials, "add_bos_token": add_bos, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "chat_template": ERNIE_CHAT, "tokenizer_class": "ErnieTokenizer"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "special_tokens_map.json").write_text(json.dumps(specials))
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    return {"<s>": 1, "</s>": 2, "<|begin_of_sentence|>": processor.PieceToId("<|begin_of_sentence|>")}


def checkpoint(directory: Path, model: str, seed: int = 3, overrides: dict[str, Any] | None = None) -> Path:
    """A seeded random checkpoint of `model`'s tiny preset (config overridden), in the published layout."""
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.save_random import save_random_checkpoint

    arch = load_plugins().registry.get(model)
    config = json.loads(json.dumps(dict(arch.preset)))
    config.update(overrides or {})
    source = directory.parent / f"{directory.name}-config.json"
    source.write_text(json.dumps(config))
    path = save_random_checkpoint(model, str(directory), seed=seed, config_path=str(source))
    for name, data in arch.preset_files.items():
        (path / name).write_text(json.dumps(data))
    return path


def copy_tokenizer(source: Path, target: Path) -> None:
    """Put a tokenizer's files beside a checkpoint's weights."""
    for file in source.iterdir():
        shutil.copy(file, target / file.name)


def text_checkpoint(directory: Path, model: str) -> Path:
    """A random checkpoint with a tokenizer beside it: ERNIE-4.5 with SentencePiece, Qwen3-VL with byte-level BPE."""
    directory.mkdir(parents=True, exist_ok=True)
    if model == "ernie4_5":
        sentencepiece_tokenizer(directory / "tok")
        path = checkpoint(directory / "ckpt", model, seed=5)
    else:
        ids = bpe_tokenizer(directory / "tok")
        path = checkpoint(directory / "ckpt", model, seed=5, overrides={
            "image_token_id": ids["<|image_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"], "eos_token_id": ids["<|im_end|>"],
        })
    copy_tokenizer(directory / "tok", path)
    return path


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"bpe": a Qwen-style tokenizer.json directory, "sp": an ERNIE-style tokenizer.model directory}."""
    root = tmp_path_factory.mktemp("tokenizers")
    bpe_tokenizer(root / "bpe")
    sentencepiece_tokenizer(root / "sp")
    return {"bpe": root / "bpe", "sp": root / "sp"}


@pytest.fixture(scope="session")
def transformers_tokenizer():  # noqa: ANN201 - returns a loader of transformers' tokenizers
    """AutoTokenizer.from_pretrained, the independent oracle; the tests using it skip without the test extra."""
    transformers = pytest.importorskip("transformers", reason="the reference tokenizer comes with the test extra (pip install -e '.[test]')")
    return lambda path: transformers.AutoTokenizer.from_pretrained(str(path))
