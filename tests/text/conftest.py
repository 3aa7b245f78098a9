"""Fixtures: tiny tokenizers saved into directories, and transformers' tokenizer on the same files where installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import kit  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"bpe": a Qwen-style tokenizer.json directory, "sp": an ERNIE-style tokenizer.model directory}."""
    root = tmp_path_factory.mktemp("tokenizers")
    kit.bpe_tokenizer(root / "bpe")
    kit.sentencepiece_tokenizer(root / "sp")
    return {"bpe": root / "bpe", "sp": root / "sp"}


@pytest.fixture(scope="session")
def transformers_tokenizer():  # noqa: ANN201 - returns a loader of transformers' tokenizers
    """AutoTokenizer.from_pretrained, the independent oracle; the tests using it skip without the test extra."""
    transformers = pytest.importorskip("transformers", reason="the reference tokenizer comes with the test extra (pip install -e '.[test]')")
    return lambda path: transformers.AutoTokenizer.from_pretrained(str(path))
