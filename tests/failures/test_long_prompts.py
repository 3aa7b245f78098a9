"""A text prompt too long for the context is refused before the tokenizer sees it (issue 38): a token covers at most
its tokenizer's longest token, so more bytes than the context times that cannot fit, whatever the tokenization.
Tokenizing 30 MB took 36 s holding the GIL (every other request of `fd serve` waited) and 4.5 GB, to say no."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import kit
from conftest import assert_one_line_error, left_over, run_fd
from fd_core.errors import ConfigError
from fd_core.runtime import load_tokenizer
from fd_core.runtime.checkpoint import Checkpoint
from fd_core.runtime.request import check_prompts, messages_prompt, text_bound, text_prompts
from fd_core.runtime.text.tokenizer import Tokenizer
from fd_models.presets import TINY_TEXT

ARCH = SimpleNamespace(name="ernie4_5", image_tokens=None, multimodal=False, check_prompt=None)


def config(context: int) -> Any:
    return SimpleNamespace(max_position_embeddings=context, vocab_size=512, extra={})


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A byte-level BPE tokenizer (keeps every byte: the tiny preset's and Qwen's kind) and a SentencePiece one (its
    nmt_nfkc normalization drops control characters and collapses whitespace: ERNIE's kind), with chat templates."""
    root = tmp_path_factory.mktemp("long-prompts")
    kit.bpe_tokenizer(root / "bpe")
    kit.sentencepiece_tokenizer(root / "sp")
    return {"bpe": root / "bpe", "sp": root / "sp"}


class Counted:
    """A tokenizer's encode() calls counted."""

    def __init__(self, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = tokenizer.encode

        def encode(text: str, add_special_tokens: bool = True) -> list[int]:
            self.calls += 1
            return real(text, add_special_tokens)

        monkeypatch.setattr(tokenizer, "encode", encode)


def test_a_prompt_past_context_times_the_longest_token_is_refused_untokenized(
    directories: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokenizer = load_tokenizer(directories["bpe"])
    longest, normalizes = text_bound(tokenizer, 512)
    assert not normalizes and longest == max(len(tokenizer.token_bytes(i) or b"") for i in range(512))
    counted = Counted(tokenizer, monkeypatch)
    context = 64
    limit = context * longest
    with pytest.raises(ConfigError) as refused:
        text_prompts(["x" * (limit + 1)], tokenizer, None, False, ARCH, config(context))
    assert str(refused.value) == (
        f"the prompt is {limit + 1} bytes: at least {context + 1} tokens at {longest} bytes a token (its tokenizer's "
        f"longest), more than the model's context of {context} (max_position_embeddings of ernie4_5); shorten the prompt"
    )
    assert counted.calls == 0
    # Bytes, not characters: 3-byte characters reach the bound sooner. One prompt of several is named.
    with pytest.raises(ConfigError, match=f"^prompt 2 is {3 * (limit // 3 + 1)} bytes: "):
        text_prompts(["hi", "日" * (limit // 3 + 1)], tokenizer, None, False, ARCH, config(context))
    assert counted.calls == 0
    # At the bound it may still fit: tokenized, then checked by its tokens as before.
    ids = text_prompts(["x" * limit], tokenizer, None, False, ARCH, config(context))
    assert counted.calls == 1
    with pytest.raises(ConfigError, match=f"has {len(ids[0])} tokens and 1 new tokens are asked for"):
        check_prompts(ids, 1, ARCH, config(context))


def test_the_longest_token_is_computed_once_per_tokenizer(
    directories: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokenizer = load_tokenizer(directories["bpe"])
    first = text_bound(tokenizer, 512)
    monkeypatch.setattr(tokenizer, "token_bytes", lambda token_id: pytest.fail("the vocabulary was read again"))
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("the probes were tokenized again"))
    assert text_bound(tokenizer, 512) == first
    with pytest.raises(ConfigError):
        text_prompts(["x" * 100_000], tokenizer, None, False, ARCH, config(64))


def test_a_normalizing_tokenizer_counts_only_what_it_cannot_drop(
    directories: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SentencePiece's normalization collapses whitespace and drops control characters: a long prompt of them can be a
    few tokens, and is not refused untokenized; letters and digits are counted, at 3 times the longest token (a
    composition can turn 3 bytes into 1)."""
    tokenizer = load_tokenizer(directories["sp"])
    longest, normalizes = text_bound(tokenizer, 512)
    assert normalizes
    context = 16
    limit = context * longest * 3
    padded = "Hello" + " " * limit + "\n\x01" * limit + "world"
    ids = text_prompts([padded], tokenizer, None, False, ARCH, config(context))
    assert len(ids[0]) <= context, "the padding should collapse to a few tokens"
    counted = Counted(tokenizer, monkeypatch)
    words = "Hello, world! " * (limit // 10 + 1)  # 10 bytes of letters in every 14
    with pytest.raises(ConfigError, match=f"^the prompt holds {(len(words) // 14) * 10} bytes of letters and digits: "
                                          f"at least .* tokens at {longest * 3} bytes a token \\(3 times its tokenizer's "
                                          f"longest token, as the tokenizer normalizes text\\), more than the model's "
                                          f"context of {context} "):
        text_prompts([words], tokenizer, None, False, ARCH, config(context))
    assert counted.calls == 0


@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_chat_is_checked_once_rendered_before_it_is_tokenized(
    directories: dict[str, Path], monkeypatch: pytest.MonkeyPatch, kind: str,
) -> None:
    """The path of `fd run --chat`, and of LLM.submit(messages) (fd serve's chat): the template's text counts too."""
    checkpoint = Checkpoint(str(directories[kind]), {}, {}, None)
    tokenizer = checkpoint.tokenizer()
    text_bound(tokenizer, 512)  # computed once, tokenizing a few probes
    counted = Counted(tokenizer, monkeypatch)
    long = "word " * 20_000
    with pytest.raises(ConfigError, match="^the prompt with its chat template (is|holds) "):
        text_prompts([long], tokenizer, checkpoint, True, ARCH, config(64))
    with pytest.raises(ConfigError, match="^the conversation with its chat template (is|holds) "):
        messages_prompt([{"role": "user", "content": long}], checkpoint, ARCH, config(64))
    assert counted.calls == 0
    assert messages_prompt([{"role": "user", "content": "Hello"}], checkpoint, ARCH, config(64))
    assert counted.calls == 1


def test_fd_run_refuses_a_prompt_too_long_for_the_context_before_tokenizing(tmp_path: Path) -> None:
    """`fd run` gets the check (through build_request, as LLM does): one line, nothing started."""
    import numpy as np
    from safetensors.numpy import save_file

    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps({**TINY_TEXT, "max_position_embeddings": 24, "architectures": ["ernie4_5"]})
    )
    save_file({"placeholder": np.zeros(1, dtype=np.float32)}, str(directory / "model.safetensors"))
    kit.sentencepiece_tokenizer(directory)
    longest, _ = text_bound(load_tokenizer(directory), int(TINY_TEXT["vocab_size"]))
    prompts = tmp_path / "prompts.txt"
    letters = 24 * longest * 3 + 1
    prompts.write_text("hi\n" + "x" * letters + "\n")
    run = run_fd(["run", "--checkpoint", str(directory), "--prompts", str(prompts)], traced=True)
    assert_one_line_error(
        run, f"prompt 2 holds {letters} bytes of letters and digits: at least 25 tokens at {longest * 3} bytes a token "
        f"(3 times its tokenizer's longest token, as the tokenizer normalizes text), more than the model's context of "
        f"24 (max_position_embeddings of ernie4_5); shorten the prompt",
    )
    assert run.paddle_imported is False, run.stderr
    assert left_over(run.marker, wait=0) == []
