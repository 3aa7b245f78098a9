"""Bad text input to `fd run`: one error line, exit code 2, and no rank started.

A checkpoint without a tokenizer, a preset (which has none), a chat template that fails, a prompt
longer than the context, text and ids together, stop strings without text, an unreadable prompts file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kit
from conftest import assert_one_line_error, left_over, run_fd
from fd_models.presets import TINY_TEXT


def _checkpoint(directory: Path, tokenizer: bool = True, **overrides: object) -> Path:
    """An ERNIE config.json (placeholder weights: these runs fail before any is read),
    with a SentencePiece tokenizer."""
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**TINY_TEXT, **overrides, "architectures": ["ernie4_5"]}))
    save_file({"placeholder": np.zeros(1, dtype=np.float32)}, str(directory / "model.safetensors"))
    if tokenizer:
        kit.sentencepiece_tokenizer(directory)
    return directory


def _assert_nothing_started(run) -> None:
    assert run.paddle_imported is False, run.stderr
    assert left_over(run.marker, wait=0) == []


def test_no_tokenizer_names_the_files_and_prompt_ids(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "ckpt", tokenizer=False)
    run = run_fd(["run", "--checkpoint", str(path), "--prompt", "hello"], traced=True)
    assert_one_line_error(run, f"{path} has no tokenizer (looked for tokenizer.json and tokenizer.model); pass token ids with --prompt-ids, which needs none")
    _assert_nothing_started(run)


def test_a_preset_has_no_tokenizer() -> None:
    run = run_fd(["run", "--model", "qwen3_vl", "--prompt", "hello"], traced=True)
    assert_one_line_error(run, "the qwen3_vl preset has none", exact=False)
    assert "--prompt-ids" in run.error_lines[0]
    _assert_nothing_started(run)


def test_a_chat_template_that_fails_gives_its_error(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "ckpt")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('Conversations must start with a system message') }}{% endif %}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    run = run_fd(["run", "--checkpoint", str(path), "--chat", "--prompt", "hello"], traced=True)
    assert_one_line_error(run, f"the chat template in {path}/tokenizer_config.json failed to render: Conversations must start with a system message")
    _assert_nothing_started(run)


def test_a_prompt_longer_than_the_context_gives_both_numbers(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "ckpt", max_position_embeddings=24)
    text = "The quick brown fox jumps over the lazy dog. " * 3
    tokens = len(__import__("fd_core.runtime", fromlist=["load_tokenizer"]).load_tokenizer(path).encode(text))
    run = run_fd(["run", "--checkpoint", str(path), "--prompt", "hi", "--prompt", text, "--max-new-tokens", "4"],
                 traced=True)
    assert_one_line_error(
        run, f"prompt 2 has {tokens} tokens and 4 new tokens are asked for: {tokens + 4} exceed the model's context of 24 "
        "(max_position_embeddings of ernie4_5); shorten the prompt or ask for fewer tokens",
    )
    _assert_nothing_started(run)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--prompt", "hi", "--prompt-ids", "1,2"], "pass text prompts (--prompt, --prompts) or token ids (--prompt-ids), not both"),
        (["--prompt-ids", "1,2", "--stop", "x"], "--stop strings are matched in the text, and without a tokenizer there is none; drop --stop"),
        (["--chat", "--prompt-ids", "1,2"], "--chat applies the chat template to text; pass the message with --prompt"),
        (["--prompts", "/nonexistent/prompts.txt"], "--prompts /nonexistent/prompts.txt cannot be read (No such file or directory)"),
        (["--prompt-ids", "1,2", "--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
        (["--prompt-ids", "1,2", "--presence-penalty", "3"], "presence_penalty must be in [-2, 2] (0: none), got 3.0"),
        (["--prompt-ids", "1,2", "--logit-bias", "999999=1"], "logit_bias names token id 999999, outside the vocabulary"),
        (["--prompt-ids", "1,2", "--min-tokens", "40"], "min_tokens must be in 0..max_new_tokens (16), got 40"),
    ],
)
def test_contradictory_text_options(args: list[str], expected: str) -> None:
    run = run_fd(["run", "--tp", "1", *args], traced=True)
    assert_one_line_error(run, expected, exact=False)
    _assert_nothing_started(run)
