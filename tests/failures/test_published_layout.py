"""Bad input in the published checkpoint layout: config.json, shard indexes, dtypes, architectures.

Everything a config.json or an index can get wrong is found by `plan_run` in the `fd` process,
before paddle is imported or any rank starts; what needs the tensors' headers (a tensor in two
shards) is found by each rank before any parameter is touched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import assert_one_line_error, left_over, run_fd
from fd_core.errors import CheckpointError
from fd_models.presets import TINY_QWEN3_VL, TINY_TEXT


def assert_nothing_started(run) -> None:
    assert run.paddle_imported is False, run.stderr
    assert left_over(run.marker, wait=0) == []


def write_config(directory: Path, data: dict) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(data))
    save_file({"placeholder": np.zeros(1, dtype=np.float32)}, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4; fix config.json"),
        ({"head_dim": None, "hidden_size": 66}, "hidden_size=66 is not a multiple of num_attention_heads=4 and no head_dim is given; set head_dim or fix the sizes"),
        ({"hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
        ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a positive number, got '1e-5'"),
        ({"vocab_size": None}, "vocab_size must be a positive integer, got None"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters asks for rope type 'yarn', which is not supported (only default rope); remove the scaling or use a checkpoint without it"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; the decoders implement silu (SwiGLU)"),
    ],
    ids=["kv-heads", "head-dim", "negative", "string-size", "string-eps", "null-vocab", "rope-scaling", "activation"],
)
def test_inconsistent_config_is_one_line_before_any_process(tmp_path: Path, change: dict, message: str) -> None:
    directory = write_config(tmp_path / "ckpt", {**TINY_TEXT, **change})
    done = run_fd(["run", "--checkpoint", str(directory)], traced=True)
    assert_one_line_error(done, f"{directory}/config.json: {message}")
    assert_nothing_started(done)


def test_missing_size_is_refused_not_defaulted(tmp_path: Path) -> None:
    data = {k: v for k, v in TINY_TEXT.items() if k != "intermediate_size"}
    directory = write_config(tmp_path / "ckpt", data)
    done = run_fd(["run", "--checkpoint", str(directory)], traced=True)
    assert_one_line_error(done, f"{directory}/config.json: config.json does not set intermediate_size; a model config must give its sizes")
    assert_nothing_started(done)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vision_config": None}, 'a Qwen3-VL config needs a "vision_config" object; use the checkpoint\'s own config.json'),
        ({"text_config": [1, 2]}, "text_config must be a JSON object, got list"),
        ({"image_token_id": 9999}, "image_token_id must be a token id below vocab_size=512, got 9999"),
    ],
    ids=["no-vision-config", "text-config-list", "image-token"],
)
def test_bad_vl_config_is_one_line_before_any_process(tmp_path: Path, change: dict, message: str) -> None:
    data = {k: v for k, v in {**TINY_QWEN3_VL, **change}.items() if v is not None}
    directory = write_config(tmp_path / "ckpt", data)
    done = run_fd(["run", "--checkpoint", str(directory)], traced=True)
    assert_one_line_error(done, f"{directory}/config.json: {message}")
    assert_nothing_started(done)


def test_unregistered_architecture_names_it_and_the_registered_ones(tmp_path: Path) -> None:
    directory = write_config(tmp_path / "llama", {**TINY_TEXT, "architectures": ["LlamaForCausalLM"]})
    done = run_fd(["run", "--checkpoint", str(directory)], traced=True)
    assert_one_line_error(
        done,
        f"checkpoint {directory}: architecture 'LlamaForCausalLM' is not registered; registered: ernie4_5 (Ernie4_5ForCausalLM), "
        "ernie4_5_vl (Ernie4_5_VLMoeForConditionalGeneration), qwen3_vl (Qwen3VLForConditionalGeneration)",
    )
    assert_nothing_started(done)


def test_a_dtype_the_platform_cannot_compute_in(tmp_path: Path) -> None:
    done = run_fd(["run", "--dtype", "bfloat16"], traced=True)
    assert_one_line_error(done, "platform cpu cannot compute in bfloat16 (it offers float32); pass --dtype float32")
    assert_nothing_started(done)


def test_steps_beyond_the_models_positions(tmp_path: Path) -> None:
    directory = write_config(tmp_path / "short", {**TINY_TEXT, "max_position_embeddings": 8})
    done = run_fd(["run", "--checkpoint", str(directory), "--steps", "5"], traced=True)
    assert_one_line_error(done, (
        "the prompt has 4 tokens and 5 new tokens are asked for: 9 exceed the model's context of 8 "
        "(max_position_embeddings of ernie4_5); shorten the prompt or ask for fewer tokens"
    ))
    assert_nothing_started(done)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("published")
    done = run_fd(["save-random", "--model", "ernie4_5", str(root / "good")])
    assert done.returncode == 0, done.stderr
    return root / "good"


def _sharded(saved: Path, target: Path, split: int = 10) -> tuple[Path, dict[str, str]]:
    """`saved` rewritten as two shards with an index, as transformers writes a large model."""
    tensors = load_file(str(saved / "model.safetensors"))
    names = sorted(tensors)
    target.mkdir()
    shutil.copy(saved / "config.json", target / "config.json")
    weight_map = {}
    for i, part in enumerate((names[:split], names[split:])):
        file_name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(target / file_name), metadata={"format": "pt"})
        weight_map.update({n: file_name for n in part})
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return target, weight_map


def test_index_naming_a_missing_file(saved: Path, tmp_path: Path) -> None:
    directory, _ = _sharded(saved, tmp_path / "ckpt")
    (directory / "model-00002-of-00002.safetensors").unlink()
    done = run_fd(["run", "--checkpoint", str(directory)], traced=True)
    assert_one_line_error(
        done, f"checkpoint {directory}/model.safetensors.index.json: names model-00002-of-00002.safetensors, which is missing; re-download the checkpoint"
    )
    assert_nothing_started(done)


def _load(directory: Path) -> None:
    from fd_core.host.backend import load_backend
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for

    plugins = load_plugins({})
    arch = plugins.registry.get("ernie4_5")
    runner = ModelRunner(load_backend(plugins=plugins), arch, model_config_for(arch, str(directory)), str(directory))
    try:
        runner.load()
    finally:
        assert runner.model is not None
        touched = [name for name, p in runner.model.named_parameters() if p._is_initialized() and np.any(p.numpy())]
        assert touched == [] or touched == [name for name, _ in runner.model.named_parameters()], touched


def test_sharded_checkpoint_loads_and_equals_the_single_file(saved: Path, tmp_path: Path) -> None:
    directory, _ = _sharded(saved, tmp_path / "ckpt")
    single = run_fd(["run", "--tp", "1", "--checkpoint", str(saved), "--json"])
    sharded = run_fd(["run", "--tp", "1", "--checkpoint", str(directory), "--json"])
    assert single.returncode == 0 and sharded.returncode == 0, sharded.stderr
    assert json.loads(single.stdout)["tokens"] == json.loads(sharded.stdout)["tokens"]


def test_tensor_in_two_shards(saved: Path, tmp_path: Path) -> None:
    directory, weight_map = _sharded(saved, tmp_path / "ckpt")
    first = load_file(str(directory / "model-00001-of-00002.safetensors"))
    name = sorted(first)[0]
    second = load_file(str(directory / "model-00002-of-00002.safetensors"))
    save_file({**second, name: first[name]}, str(directory / "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError) as err:
        _load(directory)
    assert str(err.value) == f"checkpoint {directory}/model-00002-of-00002.safetensors: tensor {name!r} is also in model-00001-of-00002.safetensors; keep one copy"


def test_index_placing_a_tensor_in_the_wrong_file(saved: Path, tmp_path: Path) -> None:
    directory, weight_map = _sharded(saved, tmp_path / "ckpt")
    name = sorted(weight_map)[0]
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {**weight_map, name: "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError) as err:
        _load(directory)
    assert str(err.value) == (
        f"checkpoint {index}: says {name!r} is in model-00002-of-00002.safetensors, which does not hold it; re-download the checkpoint"
    )


def test_a_fifo_named_like_the_weights_is_refused_without_hanging(saved: Path, tmp_path: Path) -> None:
    directory = tmp_path / "fifo"
    directory.mkdir()
    shutil.copy(saved / "config.json", directory / "config.json")
    os.mkfifo(directory / "model.safetensors")
    done = run_fd(["run", "--checkpoint", str(directory)], traced=True, timeout=60)
    assert_one_line_error(done, f"checkpoint {directory}/model.safetensors: weight file is not a regular file; replace it with the real file")
    assert_nothing_started(done)


def test_stored_float_types_widen_exactly(tmp_path: Path) -> None:
    """bfloat16 and float16 tensors read as float32 equal a conversion computed another way (bit shift, numpy)."""
    from fd_core import WeightSpec
    from fd_core.runtime.weights import load_checkpoint

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, (6, 4), dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0x3F80  # no inf / NaN patterns
    half = rng.standard_normal((6, 4)).astype(np.float16)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    save_file({"b": half, "h": half}, str(directory / "model.safetensors"))
    # Rewrite tensor "b" as BF16 holding `bits`: same byte size as F16, so only the header changes.
    raw = bytearray((directory / "model.safetensors").read_bytes())
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header["b"]["dtype"] = "BF16"
    start, end = header["b"]["data_offsets"]
    body = raw[8 + length :]
    body[start:end] = bits.tobytes()
    text = json.dumps(header).encode().ljust(length)
    (directory / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + bytes(body))

    specs = {"b": WeightSpec((6, 4), 1), "h": WeightSpec((6, 4), 0)}
    for rank in (0, 1):
        shards = load_checkpoint(directory, specs, tp_rank=rank, tp_size=2)
        widened = (bits.astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(np.asarray(shards["b"]), widened[:, 2 * rank : 2 * rank + 2])
        np.testing.assert_array_equal(np.asarray(shards["h"]), half.astype(np.float32)[3 * rank : 3 * rank + 3])
        assert np.asarray(shards["b"]).dtype == np.float32


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from PIL import Image

    root = tmp_path_factory.mktemp("pictures")
    out = {"good": root / "good.png", "text": root / "notes.png", "empty": root / "empty.jpg",
           "huge": root / "huge.npy"}
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(out["good"])
    out["text"].write_text("not a picture")
    out["empty"].write_bytes(b"")
    np.lib.format.open_memmap(out["huge"], mode="w+", dtype=np.uint8, shape=(3, 10000, 10000))  # sparse on disk
    return out


QWEN_PROMPT = "5,17,508,510,510,510,510,509,42"  # one run of 4 placeholders: a 32x32 picture


@pytest.mark.parametrize(
    ("picture", "message"),
    [
        ("text", "--image {path}: not a readable picture (UnidentifiedImageError: cannot identify image file '{path}'); pass a PNG or JPEG file"),
        ("empty", "--image {path}: not a readable picture (UnidentifiedImageError: cannot identify image file '{path}'); pass a PNG or JPEG file"),
        ("huge", "--image {path}: 10000x10000 is above the 67108864 pixels fd reads; downscale it"),
        ("missing", "--image {path}: no such file; pass a PNG or JPEG picture or a .npy array [3, H, W]"),
    ],
)
def test_bad_pictures_are_one_line_before_any_process(
    pictures: dict[str, Path], tmp_path: Path, picture: str, message: str,
) -> None:
    path = pictures.get(picture, tmp_path / "missing.png")
    done = run_fd(["run", "--model", "qwen3_vl", "--prompt-ids", QWEN_PROMPT, "--image", str(path)], traced=True)
    assert_one_line_error(done, message.format(path=path))
    assert_nothing_started(done)


@pytest.mark.parametrize(
    ("images", "message"),
    [
        (0, "have lengths 4; the 0 picture(s) given need none"),
        (2, "have lengths 4; the 2 picture(s) given need 4, 4"),
    ],
    ids=["placeholders-without-image", "more-images-than-placeholders"],
)
def test_placeholders_must_match_the_pictures(pictures: dict[str, Path], images: int, message: str) -> None:
    args = ["run", "--model", "qwen3_vl", "--prompt-ids", QWEN_PROMPT]
    for _ in range(images):
        args += ["--image", str(pictures["good"])]
    done = run_fd(args, traced=True)
    assert_one_line_error(
        done, f"the prompt's runs of image placeholder tokens (510) {message}, one run per picture in order; put one run of image tokens per --image in the prompt"
    )
    assert_nothing_started(done)


def test_a_good_picture_runs(pictures: dict[str, Path]) -> None:
    done = run_fd(
        ["run", "--tp", "1", "--model", "qwen3_vl", "--prompt-ids", QWEN_PROMPT, "--image", str(pictures["good"]),
         "--steps", "2", "--json"]
    )
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["tokens"]) == 2


def test_expert_sizes_tp_cannot_split(tmp_path: Path) -> None:
    from fd_models.presets import TINY_ERNIE_VL

    data = json.loads(json.dumps(TINY_ERNIE_VL))
    data["text_config"]["moe_intermediate_size"] = [32, 15]
    directory = write_config(tmp_path / "ckpt", data)
    done = run_fd(["run", "--tp", "2", "--checkpoint", str(directory)], traced=True)
    assert_one_line_error(
        done, "tp=2 does not divide moe_intermediate_size[1]=15 of ernie4_5_vl; choose a tp that divides each of them"
    )
    assert_nothing_started(done)
