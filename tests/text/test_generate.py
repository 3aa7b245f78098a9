"""Text in, text out through the Python API on tiny checkpoints with tokenizers: batches equal single
prompts, stops end at the right place, sampling is seeded, tp=2 equals tp=1, and pictures take their tokens."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from fd_core.errors import ConfigError, RankError
from fd_core.runtime import LLM, SamplingParams
from kit import text_checkpoint

PROMPTS = ["Hello world", "The quick brown fox jumps over", "Привет", "Café crème brûlée, naïve résumé — déjà vu. Numbers 12345"]
MODELS = ["ernie4_5", "qwen3_vl"]
GREEDY = SamplingParams(max_new_tokens=8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text-checkpoints")
    return {model: text_checkpoint(root / model, model) for model in MODELS}


@pytest.fixture(scope="module")
def sessions(checkpoints: dict[str, Path]):  # noqa: ANN201
    opened = {model: LLM(path, progress=True) for model, path in checkpoints.items()}
    yield opened
    for session in opened.values():
        session.close()


@pytest.mark.parametrize("model", MODELS)
def test_a_batch_gives_each_prompt_what_it_gives_alone(
    sessions: dict[str, LLM], model: str, capfd: pytest.CaptureFixture[str],
) -> None:
    llm = sessions[model]
    together = llm.generate(PROMPTS, GREEDY)
    assert f"capturing the decode step for batch size {len(PROMPTS)}" in capfd.readouterr().err
    alone = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.text for c in together] == [c.text for c in alone]
    # Prompts of unequal lengths, so the batch was padded; and outputs that differ, so equality means something.
    assert (len({len(c.prompt_ids) for c in together}) == len(PROMPTS)
            and len({tuple(c.token_ids) for c in together}) > 1)
    assert all(c.text == llm.tokenizer.decode(c.token_ids) and c.finish_reason == "length" for c in together)


@pytest.mark.parametrize("model", MODELS)
def test_a_stop_string_ends_the_text_before_it(sessions: dict[str, LLM], model: str) -> None:
    llm = sessions[model]
    full = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=24))[0]
    text = full.text or ""
    # A stop string from the middle of the text (random weights write stray bytes too: avoid those).
    start = next(i for i in range(2, len(text) - 1) if text[i] != "\ufffd" and text.find(text[i]) == i)
    stop = text[start]
    cut = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=24, stop=(stop, "never appears")))[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)
    pieces = list(llm.stream(PROMPTS[1], SamplingParams(max_new_tokens=24, stop=(stop,))))
    assert "".join(pieces) == cut.text


@pytest.mark.parametrize("model", MODELS)
def test_streamed_pieces_make_the_text(sessions: dict[str, LLM], model: str) -> None:
    llm = sessions[model]
    pieces = list(llm.stream(PROMPTS[3], GREEDY))
    assert len(pieces) > 1 and "".join(pieces) == llm.generate(PROMPTS[3], GREEDY)[0].text


def test_sampling_is_reproducible_and_differs_across_seeds(sessions: dict[str, LLM]) -> None:
    llm = sessions["qwen3_vl"]

    def sample(seed: int) -> list[list[int]]:
        return [
            c.token_ids
            for c in llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=10, temperature=1.5, seed=seed))
        ]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    assert sample(1) != [c.token_ids for c in llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=10))]


def test_end_of_sequence_ids_from_generation_config_end_a_prompt(tmp_path: Path) -> None:
    path = text_checkpoint(tmp_path, "ernie4_5")
    with LLM(path) as llm:
        first = llm.generate(PROMPTS[0], GREEDY)[0].token_ids
    eos = next(t for t in first[2:] if t not in first[:2])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos], "do_sample": False}))
    with LLM(path) as llm:
        ended = llm.generate(PROMPTS[0], GREEDY)[0]
        assert ended.finish_reason == "eos" and ended.token_ids == first[: first.index(eos) + 1]
        assert llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids == first


def test_chat_with_a_picture_expands_its_placeholder(sessions: dict[str, LLM]) -> None:
    transformers = pytest.importorskip("transformers", reason="the reference image processor comes with the test extra")
    from PIL import Image

    from fd_models.presets import TINY_QWEN3_VL_PREPROCESSOR

    llm = sessions["qwen3_vl"]
    pixels = np.random.default_rng(0).integers(0, 256, (40, 72, 3), dtype=np.uint8)
    picture = pixels.transpose(2, 0, 1).astype(np.float32) / 255
    request = llm._request("What is this?", GREEDY, True, [picture])
    # As many placeholders as the reference processor expands one into for this picture.
    processor = transformers.Qwen2VLImageProcessorPil(
        **{k: v for k, v in TINY_QWEN3_VL_PREPROCESSOR.items() if k != "image_processor_type"}
    )
    grid = processor(images=[Image.fromarray(pixels)], return_tensors="np")["image_grid_thw"][0]
    pad = llm.tokenizer.token_to_id("<|image_pad|>")
    assert request.prompts[0].count(pad) == int(np.prod(grid)) // processor.merge_size**2 > 1
    assert len(llm.generate("What is this?", GREEDY, chat=True, images=[picture])[0].token_ids) == 8
    with pytest.raises(ConfigError, match="placeholder"):
        llm.generate("no placeholder for the picture", GREEDY, images=[picture])


def test_the_graph_decision_and_timings_are_reported(sessions: dict[str, LLM]) -> None:
    llm = sessions["ernie4_5"]
    assert llm.platform == "cpu" and llm.model == "ernie4_5" and llm.graph.allowed
    assert {"load", "capture", "prefill", "decode"} <= set(llm.timings)


def test_tp2_from_python_equals_tp1_and_stops_its_ranks(checkpoints: dict[str, Path], sessions: dict[str, LLM]) -> None:
    want = [c.token_ids for c in sessions["qwen3_vl"].generate(PROMPTS, GREEDY)]
    sampled = sessions["qwen3_vl"].generate(PROMPTS[:2], SamplingParams(max_new_tokens=6, temperature=1.0, seed=4))
    with LLM(checkpoints["qwen3_vl"], tp=2) as llm:
        pids = list(llm._session.pids)
        assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == want
        # Every rank draws the same token (the pool checks the ranks agree), and the same as tp=1.
        assert llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6, temperature=1.0, seed=4)) == sampled
        assert "".join(llm.stream(PROMPTS[0], GREEDY)) == sessions["qwen3_vl"].generate(PROMPTS[0], GREEDY)[0].text
    assert not [pid for pid in pids if _alive(pid)]


def test_a_rank_that_dies_is_named_and_the_others_stop(checkpoints: dict[str, Path]) -> None:
    llm = LLM(checkpoints["ernie4_5"], tp=2)
    pids = list(llm._session.pids)
    running = llm.submit(PROMPTS[1], SamplingParams(max_new_tokens=200, ignore_eos=True))
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RankError, match="rank 1 failed: killed by SIGKILL"):
        llm.generate(PROMPTS[0], GREEDY)
    # What was running fails with it, and the LLM says why it can no longer generate.
    with pytest.raises(RankError, match="rank 1 failed: killed by SIGKILL"):
        running.result(30)
    assert isinstance(llm.error, RankError)
    with pytest.raises(RankError, match="failed earlier"):
        llm.generate(PROMPTS[0], GREEDY)
    llm.close()
    assert not [pid for pid in pids if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
