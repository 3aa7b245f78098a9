"""Pictures through `fd serve`: a chat message with a PNG as a data URL (and as a file under --image-root) reaches
a VL model (the tiny Qwen3-VL with a trained tokenizer) and answers what the Python API answers for the same picture."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from fd_core.runtime.engine.sampling import SamplingParams
from kit import text_checkpoint  # the tokenizers tests/text trains
from serving import Served, finish, start_server

openai = pytest.importorskip("openai", reason="the serve tests use the official openai client (pip install -e '.[cpu,test]')")


@pytest.fixture(scope="module")
def picture(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """A 64x64 PNG (four merged blocks for Qwen3-VL) and its pixels as [C, H, W] in [0, 1]."""
    from PIL import Image

    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    path = tmp_path_factory.mktemp("pictures") / "noise.png"
    Image.fromarray(pixels).save(path)
    return path, pixels.transpose(2, 0, 1).astype("float32") / np.float32(255.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_checkpoint(tmp_path_factory.mktemp("vl"), "qwen3_vl")


@pytest.fixture(scope="module")
def server(checkpoint: Path, picture: tuple[Path, np.ndarray]) -> Iterator[Served]:
    served = start_server(
        ["--checkpoint", str(checkpoint), "--tp", "1", "--name", "vl", "--image-root", str(picture[0].parent)]
    )
    yield served
    finish(served)


def test_a_picture_in_a_chat_message_answers_as_the_engine_alone(
    server: Served, checkpoint: Path, picture: tuple[Path, np.ndarray],
) -> None:
    from fd_core.runtime import LLM

    path, pixels = picture
    question = "What is in the picture?"
    # What the engine answers alone: the message in the shape VL chat templates take, the decoded pixels.
    with LLM(checkpoint, tp=1) as llm:
        want = llm.submit([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                          SamplingParams(max_new_tokens=8), images=[pixels]).result()
    assert len(want.prompt_ids) > 4 + 8  # the placeholder expanded to the picture's four tokens
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    data_url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    for url in (data_url, str(path)):
        got = client.chat.completions.create(model="vl", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]}])  # type: ignore[list-item]
        assert got.choices[0].message.content == want.text, url
        assert got.usage.prompt_tokens == len(want.prompt_ids)
    # A file outside --image-root is refused, naming the directories the server may read.
    with pytest.raises(openai.BadRequestError, match="outside the directories the server may read"):
        client.chat.completions.create(model="vl", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(checkpoint / "config.json")}}, {"type": "text", "text": question}]}])  # type: ignore[list-item]
