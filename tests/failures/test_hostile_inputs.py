"""Hostile inputs: checkpoint files, prompts and pictures a user or a download hands fd.

Each ends as one line naming the file, field or option and the fix (a ConfigError-family error; exit 2
from `fd`), in bounded time, before any rank starts; what used to give silently wrong output gives the
right output or a refusal. The CLI is run in a subprocess where the case is the command line itself
(argv bytes, a closed stdout, a FIFO given as --prompts, a template that loops); the rest call the
functions `fd run` and the Python API both go through, in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import kit
from conftest import assert_one_line_error, fd_env, left_over, new_marker, run_fd
from fd_core.errors import CheckpointError, ConfigError
from fd_models.presets import TINY_QWEN3_VL, TINY_TEXT


def _placeholder_weights(directory: Path) -> None:
    """A safetensors file: these runs stop before any tensor is read."""
    from safetensors.numpy import save_file

    save_file({"placeholder": np.zeros(1, dtype=np.float32)}, str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def ernie(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ERNIE-4.5 checkpoint directory with a SentencePiece tokenizer and placeholder weights."""
    directory = tmp_path_factory.mktemp("inputs") / "ernie"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**TINY_TEXT, "architectures": ["ernie4_5"]}))
    _placeholder_weights(directory)
    kit.sentencepiece_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-VL checkpoint directory with a byte-level BPE tokenizer, its chat template and placeholder weights."""
    directory = tmp_path_factory.mktemp("inputs") / "qwen"
    ids = kit.bpe_tokenizer(directory)
    config = {**json.loads(json.dumps(TINY_QWEN3_VL)), "image_token_id": ids["<|image_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"],
              "vision_end_token_id": ids["<|vision_end|>"], "eos_token_id": ids["<|im_end|>"]}
    (directory / "config.json").write_text(json.dumps(config))
    _placeholder_weights(directory)
    return directory


def _copy(source: Path, target: Path, **tokenizer_config: Any) -> Path:
    """A copy of a checkpoint directory with tokenizer_config.json's keys set (None removes one)."""
    shutil.copytree(source, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    for key, value in tokenizer_config.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def _plan(checkpoint: Path | None = None, **run: Any) -> Any:
    """plan_run as `fd run` and LLM call it: every check before a rank starts (tp=1)."""
    from fd_core.runtime.plan import RunConfig, plan_run

    return plan_run(RunConfig(model="" if checkpoint else run.pop("model", "qwen3_vl"), tp=1,
                              checkpoint=str(checkpoint) if checkpoint else None,
                              **run))


def _one_line(exc: BaseException, *parts: str) -> None:
    text = str(exc)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, text


# -- the command line -----------------------------------------------------------------------


def test_a_prompt_that_is_not_utf8_is_one_line(ernie: Path) -> None:
    # The shell hands Python bytes; what is not UTF-8 arrives as lone surrogates (the tokenizers library raised
    # TypeError).
    run = run_fd(["run", "--tp", "1", "--checkpoint", str(ernie), "--prompt", "\udcff\udcfehello"], traced=True)
    assert_one_line_error(run, "the prompt is not valid UTF-8 text (the byte 0xff at character 0); pass the text encoded as UTF-8")
    assert run.paddle_imported is False


def test_fd_run_with_stdout_closed_is_one_line(ernie: Path) -> None:
    # fd 1 closed before Python starts: sys.stdout is None (fd raised AttributeError on isatty).
    marker = new_marker()
    done = subprocess.run([sys.executable, "-m", "fd_core.cli", "run", "--tp", "1", "--checkpoint", str(ernie),
                           "--prompt", "hi"],
                          env=fd_env(marker), stderr=subprocess.PIPE, text=True, timeout=120,
                          preexec_fn=lambda: os.close(1))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "fd: error: stdout is closed, and fd run writes its output there; redirect it (> out.txt, or > /dev/null to discard)")
    assert left_over(marker, wait=0) == []


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_prompts_file_that_is_not_a_regular_file_is_refused_without_reading(
    ernie: Path, tmp_path: Path, kind: str,
) -> None:
    # A FIFO blocked in open() with nobody writing; /dev/zero read one endless line until MemoryError.
    path = "/dev/zero"
    if kind == "fifo":
        path = str(tmp_path / "prompts")
        os.mkfifo(path)
    run = run_fd(["run", "--tp", "1", "--checkpoint", str(ernie), "--prompts", path], timeout=60, traced=True)
    assert_one_line_error(run, f"--prompts {path} is not a regular file; pass a text file, one prompt per line")
    assert run.paddle_imported is False and run.seconds < 30


def test_a_chat_template_that_loops_is_stopped_within_its_bound(ernie: Path, tmp_path: Path) -> None:
    # Ten billion empty iterations: the render is interrupted after RENDER_SECONDS (it used to run for hours).
    looping = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    path = _copy(ernie, tmp_path / "ckpt", chat_template=looping)
    run = run_fd(["run", "--tp", "1", "--checkpoint", str(path), "--chat", "--prompt", "hi"], timeout=90, traced=True)
    assert_one_line_error(
        run, f"the chat template in {path}/tokenizer_config.json did not finish rendering within 5 s (a loop without end?); fix the template")
    assert run.paddle_imported is False and run.seconds < 60


# -- chat templates -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "detail"),
    [
        ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
        ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "it recurses without end"),
        ("{% for i in range(10**9) %}x{% endfor %}", "it asks for a size of 1000000000 (fd allows 8388608)"),
        ("{{ 'a' * 10**10 }}", "it makes a string of 10000000000 characters by repetition (fd allows 8388608)"),
        ("{{ 'a'|center(10**10) }}", "it asks for a size of 10000000000 (fd allows 8388608)"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
         "it makes a string of 16777216 characters (fd allows 8388608)"),
        ("{% for i in range(20000) %}{{ 'a' * 1000 }}{% endfor %}", "its output passes 8388608 characters"),
    ],
    ids=["divide-by-zero", "recursion", "huge-range", "huge-string", "huge-filter-size", "doubling-concat",
         "huge-output"],
)
def test_a_chat_template_that_fails_or_grows_is_one_line_naming_its_file(
    ernie: Path, tmp_path: Path, template: str, detail: str,
) -> None:
    from fd_core.runtime.checkpoint import Checkpoint
    from fd_core.runtime.request import chat_prompt

    path = _copy(ernie, tmp_path / "ckpt", chat_template=template)
    checkpoint = Checkpoint.open(path)
    start = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        chat_prompt(checkpoint.tokenizer(), checkpoint, "hi")
    assert str(caught.value) == f"the chat template in {path}/tokenizer_config.json failed to render: {detail}; fix the template"
    assert time.monotonic() - start < 5


def test_a_chat_template_file_that_is_not_utf8_names_it(ernie: Path, tmp_path: Path) -> None:
    from fd_core.runtime.checkpoint import Checkpoint

    path = _copy(ernie, tmp_path / "ckpt")
    (path / "chat_template.jinja").write_bytes(b"{{ messages[0]['content'] }}\xff\xfe")
    with pytest.raises(CheckpointError) as caught:
        Checkpoint.open(path).chat_template()
    assert str(caught.value) == f"{path}/chat_template.jinja is not UTF-8 text (byte 0xff at offset 28); save it as UTF-8"


def test_a_template_that_renders_well_is_unchanged_by_the_bounds() -> None:
    from fd_core.runtime.text.chat import render_chat, user_message

    text = render_chat(kit.QWEN_CHAT, [user_message("x" * 100000, images=2)], {})
    assert text == ("<|im_start|>user\n" + "<|vision_start|><|image_pad|><|vision_end|>" * 2 + "x" * 100000
                    + "<|im_end|>\n<|im_start|>assistant\n")


# -- tokenizer files ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sentencepiece", "tokenizer.json"])
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"additional_special_tokens": 5}, 'additional_special_tokens must be a list of token strings (or {"content": ...} objects), got int 5'),
        # A str is a sequence of letters: each letter became special and "Hello there" decoded as "H ll th r".
        ({"additional_special_tokens": "aeo"}, 'additional_special_tokens must be a list of token strings (or {"content": ...} objects), got str "aeo"'),
        ({"added_tokens_decoder": [{"content": "<x>"}]}, 'added_tokens_decoder must be an object of token id -> token, got list [{"content": "<x>"}]'),
        # An empty added token matched between every two characters.
        ({"added_tokens_decoder": {"1000": {"content": "", "special": False}}},
         "added_tokens_decoder entry '1000' is an empty token, which would match between every character; remove it"),
        # The string "false" read as true.
        ({"clean_up_tokenization_spaces": "false"}, 'clean_up_tokenization_spaces must be true or false, got str "false"'),
        ({"added_tokens_decoder": {"1000": {"content": "<x>", "special": "false"}}},
         "added_tokens_decoder entry '1000': special must be true or false, got str \"false\""),
    ],
    ids=["list-as-int", "list-as-str", "decoder-as-list", "empty-token", "false-string", "false-string-in-entry"],
)
def test_a_malformed_tokenizer_config_is_one_line_naming_the_field(
    ernie: Path, qwen: Path, tmp_path: Path, backend: str, settings: dict[str, Any], message: str,
) -> None:
    from fd_core.runtime.text.tokenizer import load_tokenizer

    source = ernie if backend == "sentencepiece" else qwen
    path = _copy(source, tmp_path / "ckpt", **settings)
    with pytest.raises(CheckpointError) as caught:
        load_tokenizer(path)
    _one_line(caught.value, f"{path}/tokenizer_config.json: {message}")


def test_add_bos_token_false_as_a_string_is_refused_not_read_as_true(ernie: Path, tmp_path: Path) -> None:
    from fd_core.runtime.text.tokenizer import load_tokenizer

    path = _copy(ernie, tmp_path / "ckpt", add_bos_token="false")
    with pytest.raises(CheckpointError, match='add_bos_token must be true or false, got str "false"; fix the file'):
        load_tokenizer(path)


def test_twenty_thousand_added_tokens_load_in_linear_time(qwen: Path, tmp_path: Path) -> None:
    # One library call per token rebuilt its matcher each time: 20,000 tokens took 56-88 s per rank.
    from fd_core.runtime.text.tokenizer import load_tokenizer

    path = _copy(qwen, tmp_path / "ckpt")
    config = json.loads((path / "tokenizer_config.json").read_text())
    first = max(int(k) for k in config["added_tokens_decoder"]) + 1
    for i in range(20000):
        config["added_tokens_decoder"][str(first + i)] = {"content": f"<extra_{i}>", "special": i % 3 == 0}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    start = time.monotonic()
    tokenizer = load_tokenizer(path)
    assert time.monotonic() - start < 10
    # Every token at its declared id; the special ones skipped when decoding, the others kept.
    ids = tokenizer.encode("a<extra_3>b<extra_4>c<extra_19999>", add_special_tokens=False)
    assert [first + 3, first + 4, first + 19999] == [i for i in ids if i >= first]
    assert tokenizer.decode(ids) == "ab<extra_4>c<extra_19999>" and first + 3 in tokenizer.special_ids


@pytest.mark.parametrize("name", ["tokenizer_config.json", "tokenizer.json", "generation_config.json",
                                  "chat_template.jinja"])
def test_a_checkpoint_file_that_is_a_fifo_is_refused_without_opening_it(qwen: Path, tmp_path: Path, name: str) -> None:
    # Reading a FIFO blocks until a writer comes; before, some were also skipped as if absent (another template, no eos
    # ids).
    from fd_core.runtime.checkpoint import Checkpoint

    path = _copy(qwen, tmp_path / "ckpt")
    (path / name).unlink(missing_ok=True)
    os.mkfifo(path / name)
    with pytest.raises(CheckpointError) as caught:
        checkpoint = Checkpoint.open(path)
        checkpoint.tokenizer()
        checkpoint.chat_template()
    assert str(caught.value) == f"{path / name} is not a regular file; replace it with the real file"


# -- generation_config.json and sampling ----------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"do_sample": True, "temperature": "0.7"}, "temperature must be a number, got str '0.7'"),
        # "false" is a non-empty string: it sampled.
        ({"do_sample": "false", "temperature": 0.7}, "do_sample must be true or false, got str 'false'"),
        ({"do_sample": True, "top_k": 2.5}, "top_k must be an integer, got float 2.5"),
        ({"eos_token_id": "2"}, "eos_token_id must be a token id or a list of token ids, got str '2'"),
    ],
    ids=["temperature-string", "do-sample-false-string", "top-k-float", "eos-string"],
)
def test_generation_config_values_are_checked_by_type(
    ernie: Path, tmp_path: Path, settings: dict[str, Any], message: str,
) -> None:
    path = _copy(ernie, tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError) as caught:
        _plan(path, prompts=("hi",))
    assert str(caught.value) == f"{path}/generation_config.json: {message}; fix the file"


def test_a_checkpoint_default_out_of_range_names_generation_config(ernie: Path, tmp_path: Path) -> None:
    # The checkpoint's temperature 1e-310 sampled NaN probabilities (every token the last id); now the file is named.
    path = _copy(ernie, tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 1e-310}))
    with pytest.raises(CheckpointError) as caught:
        _plan(path, prompts=("hi",))
    _one_line(caught.value, f"{path}/generation_config.json: its default temperature 1e-310 is below 1e-05", "fix the file, or pass the setting")
    # the setting passed wins over the file
    assert _plan(path, prompts=("hi",), temperature=0.0).request.sampling.greedy


def test_a_temperature_that_underflows_is_refused_and_the_floor_samples_finitely() -> None:
    from fd_core import native_ops
    from fd_core.runtime.engine.sampling import MIN_TEMPERATURE, SamplingParams

    # 1e-310 made logits / temperature infinite, every probability NaN and every token the last id.
    with pytest.raises(ConfigError, match=r"temperature 1e-310 is below 1e-05, .*pass 0 for greedy decoding"):
        SamplingParams(temperature=1e-310)
    logits = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32) * 30
    for u in (0.0, 0.5, 0.999):
        assert native_ops.sample(logits, MIN_TEMPERATURE, 0, 0.9, [u] * 3) == [int(i) for i in logits.argmax(axis=-1)]


def test_one_stop_string_given_as_a_str_is_one_stop_string() -> None:
    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.text.streaming import held_back

    # A str is a sequence of its characters: each one stopped the text.
    params = SamplingParams(stop="the end")
    assert params.stop == ("the end",)
    assert held_back("so it was t", params.stop) == 1 and held_back("so it was ", params.stop) == 0
    with pytest.raises(ConfigError, match=r"stop must be a string or a list of strings, got \[1\]"):
        SamplingParams(stop=[1])  # type: ignore[list-item]


@pytest.mark.parametrize(("settings", "message"), [({"seed": -1}, "seed must be >= 0, got -1"),
                                                   ({"max_batch": 0}, "max_batch must be >= 1 (prompts decoded together), got 0")])
def test_the_python_api_refuses_what_the_cli_refuses(settings: dict[str, Any], message: str) -> None:
    from fd_core.runtime.llm import LLM

    start = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        LLM(model="ernie4_5", **settings)
    assert str(caught.value) == message
    assert time.monotonic() - start < 5  # refused before a model is built


# -- pictures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from PIL import Image

    root = tmp_path_factory.mktemp("pictures")
    grey = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)
    Image.fromarray(grey).save(root / "grey16.png")
    Image.fromarray(np.zeros((1, 4000), dtype=np.uint8)).save(root / "thin.png")
    Image.new("L", (10000, 10000)).save(root / "huge.png")  # 100 megapixels, a few kilobytes compressed
    (root / "notes.npy").write_text("not an array\n")
    for name, shape in {"hwc": (16, 16, 3), "grey": (1, 16, 16), "rgba": (4, 16, 16)}.items():
        np.save(root / f"{name}.npy", np.zeros(shape, dtype=np.float32))
    return {p.stem: p for p in root.iterdir()}


def test_a_16_bit_greyscale_png_keeps_its_values(pictures: dict[str, Path]) -> None:
    # PIL's convert("RGB") clipped 16-bit values at 255: 99.5% of the pixels became 1.0.
    from fd_core.runtime.images import load_image

    picture = load_image(str(pictures["grey16"]))
    want = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.float32) / np.float32(65535.0)
    assert picture.shape == (3, 64, 64)
    np.testing.assert_allclose(picture, np.broadcast_to(want, (3, 64, 64)), rtol=0, atol=1e-7)


def test_a_100_megapixel_png_is_refused_from_its_header(pictures: dict[str, Path]) -> None:
    from fd_core.runtime.images import load_image

    start = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        load_image(str(pictures["huge"]))
    assert str(caught.value) == f"--image {pictures['huge']}: 10000x10000 is above the 67108864 pixels fd reads; downscale it"
    assert time.monotonic() - start < 0.5  # decoding it takes longer than that


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("notes", "not a numpy .npy array (no .npy header); save one with numpy.save, or pass a PNG or JPEG file"),
        ("hwc", "expected 3 channels first ([3, H, W], RGB), got shape [16, 16, 3]; it looks like [H, W, C]: use array.transpose(2, 0, 1)"),
        ("grey", "expected 3 channels first ([3, H, W], RGB), got shape [1, 16, 16]"),
        ("rgba", "expected 3 channels first ([3, H, W], RGB), got shape [4, 16, 16]"),
    ],
    ids=["text-file", "channels-last", "one-channel", "four-channels"],
)
def test_a_npy_that_is_not_an_rgb_picture_is_refused_by_fd_run(
    pictures: dict[str, Path], name: str, message: str,
) -> None:
    # The text file got numpy's advice to use allow_pickle; the layouts passed and failed in the ranks.
    run = run_fd(["run", "--tp", "1", "--model", "qwen3_vl", "--prompt-ids", "5,17,508,510,510,510,510,509,42",
                  "--image", str(pictures[name])],
                 traced=True)
    assert_one_line_error(run, f"--image {pictures[name]}: {message}")
    assert run.paddle_imported is False


def test_a_picture_too_thin_for_the_processor_is_one_line(qwen: Path, pictures: dict[str, Path]) -> None:
    # The model's processor raises ValueError on an aspect ratio above 200; as a chat prompt it was a traceback.
    with pytest.raises(ConfigError) as caught:
        _plan(qwen, prompts=("Describe it.",), chat=True, images=(str(pictures["thin"]),))
    assert str(caught.value) == "the picture: image 1x4000 has an aspect ratio above 200, which the model's processor refuses; crop it"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: np.full((3, 32, 32), 255.0, dtype=np.float32), "images[0]: pixel values must be finite and within [0, 1] (divide 8-bit pixels by 255)"),
        (lambda: np.full((3, 32, 32), np.nan, dtype=np.float32), "images[0]: pixel values must be finite and within [0, 1] (divide 8-bit pixels by 255)"),
        (lambda: np.zeros((32, 32, 3), dtype=np.float32), "images[0]: expected 3 channels first ([3, H, W], RGB), got shape [32, 32, 3]"),
        (lambda: [[0.5]], "images[0]: expected a numpy array [3, H, W] (or a path to a picture), got list"),
    ],
    ids=["8-bit-range", "nan", "channels-last", "not-an-array"],
)
def test_picture_arrays_given_to_the_api_are_checked(make: Callable[[], Any], message: str) -> None:
    # LLM.generate(images=[array]) goes through build_request, which did not check an array at all.
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.request import build_request

    plan = _plan(model="qwen3_vl")
    arch = plan.architecture(load_plugins())
    with pytest.raises(ConfigError) as caught:
        build_request([[5, 17, 508, 510, 510, 510, 510, 509, 42]], SamplingParams(max_new_tokens=2), arch=arch,
                      config=plan.config,
                      checkpoint=None, images=[make()])
    assert message in str(caught.value)



def test_a_rank_loading_the_tokenizer_notes_the_phase(
    qwen: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rank slow in the tokenizer (20,000 added tokens took 56 s) was blamed by the stall watch on the phase before it.
    from fd_core.runtime import progress
    from fd_core.runtime.checkpoint import Checkpoint

    note = tmp_path / "progress"
    monkeypatch.setenv(progress.PROGRESS_ENV, str(note))
    Checkpoint.open(qwen).tokenizer()
    found = progress.read(str(note))
    assert found is not None and found[1] == "loading the tokenizer"


def test_save_random_refuses_a_config_that_is_a_fifo(tmp_path: Path) -> None:
    # Another path fd reads: `fd save-random --config FIFO` blocked in open().
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    run = run_fd(["save-random", "--config", str(fifo), str(tmp_path / "out")], timeout=60)
    assert_one_line_error(run, f"--config {fifo} is not a regular file; pass a model's config.json")
    assert not (tmp_path / "out").exists()
