"""`fd save-random --tokenizer`: a random checkpoint with a tokenizer and chat template that fd reads back (text in,
text out), for a text model and for each model that takes pictures (its picture tokens in the tokenizer, their ids
in the checkpoint's config)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def _fd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fd_core.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_a_text_checkpoint_with_a_tokenizer_runs_chat(tmp_path: Path) -> None:
    made = _fd("save-random", "--model", "ernie4_5", "--tokenizer", "tiny", cwd=tmp_path)
    assert made.returncode == 0 and "with a tokenizer and a chat template" in made.stdout, made.stderr
    ran = _fd("run", "--tp", "1", "--checkpoint", "tiny", "--chat", "--prompt", "Hello", "--max-new-tokens", "3",
              "--json", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    output = json.loads(ran.stdout)["outputs"][0]
    assert isinstance(output["text"], str) and len(output["ids"]) >= 1


@pytest.mark.parametrize(("model", "start", "end"), [("qwen3_vl", "vision_start_token_id", "vision_end_token_id"),
                                                     ("ernie4_5_vl", "image_start_token_id", "image_end_token_id")])
def test_a_model_that_takes_pictures_gets_its_picture_tokens(tmp_path: Path, model: str, start: str, end: str) -> None:
    """The config's picture token ids are the tokenizer's own tokens; a chat turn with a picture renders the start
    marker, the placeholder fd expands to the picture's tokens, and the end marker; and the model answers it."""
    from fd_core.runtime import LLM, SamplingParams, load_tokenizer

    made = _fd("save-random", "--model", model, "--tokenizer", "vl", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    config = json.loads((tmp_path / "vl" / "config.json").read_text())
    tokenizer = load_tokenizer(tmp_path / "vl")
    assert tokenizer is not None
    keys = [k for k in config if k.endswith("_token_id")]
    assert {"image_token_id", start, end} <= set(keys)
    for key in keys:
        assert tokenizer.token_to_id(f"<|{key.removesuffix('_token_id')}|>") == config[key], key
    picture = np.random.default_rng(0).random((3, 64, 64), dtype=np.float32)
    with LLM(str(tmp_path / "vl"), graph="off") as llm:
        done = llm.generate("Describe the picture.", SamplingParams(max_new_tokens=3), chat=True, images=[picture])[0]
    ids = done.prompt_ids
    placeholders = [i for i, t in enumerate(ids) if t == config["image_token_id"]]
    assert len(placeholders) > 1 and placeholders == list(range(placeholders[0], placeholders[-1] + 1))
    assert ids[placeholders[0] - 1] == config[start] and ids[placeholders[-1] + 1] == config[end]
    assert len(done.token_ids) == 3


def test_only_picture_keys_become_picture_tokens() -> None:
    """A VL config.json may carry bos, eos and pad ids at its top level too: they are text tokens, never pictures."""
    from fd_core.serve.tiny import picture_tokens, vl_chat_template

    config = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "image_token_id": 500,
              "image_start_token_id": 501, "image_end_token_id": 502, "video_token_id": 503, "vocab_size": 512}
    pictures = picture_tokens(config)
    assert list(pictures) == ["image_token_id", "image_start_token_id", "image_end_token_id", "video_token_id"]
    assert "<|image_start|><|image|><|image_end|>{% elif" in vl_chat_template(pictures)
