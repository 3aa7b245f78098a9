"""Fuzzing the loader and the config checks in-process: a seeded generator of corrupted checkpoints and
configs; every case must end in a one-line FdError or load correctly, never another exception or a hang.

Cases are generated from a real `save-random` checkpoint of the tiny ERNIE-4.5 and its config.json:
truncations, header edits (length field, dtypes, shapes, offsets, names), random bytes, and type and
range mutations of every config field the models read. The seed is fixed, so a failure reproduces;
FDTEST_FUZZ_SEED picks another.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from fd_core.errors import FdError

SEED = int(os.environ.get("FDTEST_FUZZ_SEED", "20261130"))
CHECKPOINT_CASES = 220
CONFIG_CASES = 260
WEIRD: list[Any] = [None, True, -1, 0, 1, 2**62, -(2**62), 1.5, math.nan, math.inf, -0.0, "", "64", "x" * 300, [],
                    [1, 2], {}, {"a": 1}]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from fd_core.host.backend import load_backend
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.plan import model_config_for
    from fd_core.runtime.save_random import save_random_checkpoint

    root = tmp_path_factory.mktemp("fuzz")
    good = save_random_checkpoint("ernie4_5", str(root / "good"), seed=3)
    plugins = load_plugins({})
    arch = plugins.registry.get("ernie4_5")
    specs = arch.build(model_config_for(arch, str(good)), load_backend(plugins=plugins)).weight_specs()
    return {"root": root, "good": good, "specs": specs, "arch": arch, "registry": plugins.registry}


def _header(data: bytes) -> tuple[int, dict[str, Any]]:
    length = int.from_bytes(data[:8], "little")
    return length, json.loads(data[8 : 8 + length])


def _rewrite(data: bytes, header: dict[str, Any]) -> bytes:
    length, _ = _header(data)
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + length :]


def _checkpoint_mutations(rng: random.Random) -> list[tuple[str, Callable[[bytes], bytes]]]:
    def truncate(data: bytes) -> bytes:
        return data[: rng.randrange(len(data))]

    def flip(data: bytes) -> bytes:
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(min(len(out), 8 + _header(data)[0]))] = rng.randrange(256)
        return bytes(out)

    def length_field(data: bytes) -> bytes:
        return rng.choice([0, 1, 7, 2**63 - 1, 2**40, len(data), len(data) * 2]).to_bytes(8, "little") + data[8:]

    def edit(field: str) -> Callable[[bytes], bytes]:
        def mutate(data: bytes) -> bytes:
            _, header = _header(data)
            name = rng.choice([k for k in header if k != "__metadata__"])
            entry = header[name]
            if field == "dtype":
                entry["dtype"] = rng.choice(["I64", "U8", "BOOL", "F8_E4M3", "XX", "", 7])
            elif field == "shape":
                entry["shape"] = rng.choice([[], [0], [3, 3], [-1, 4], [2**40, 2**40], "64", [1.5]])
            elif field == "offsets":
                entry["data_offsets"] = rng.choice([[0, 0], [10, 5], [0, 2**50], [-4, 8], "x", [0]])
            elif field == "name":
                header[rng.choice(["", "model.layers.9.mlp.up_proj.weight", name + "x"])] = header.pop(name)
            elif field == "drop":
                del header[name]
            return _rewrite(data, header)

        return mutate

    def garbage(data: bytes) -> bytes:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 4096)))

    return [("truncate", truncate), ("flip header bytes", flip), ("length field", length_field),
            ("dtype", edit("dtype")), ("shape", edit("shape")), ("offsets", edit("offsets")), ("name", edit("name")),
            ("drop", edit("drop")), ("garbage", garbage)]


def _load(directory: Path, specs: dict[str, Any]) -> None:
    from fd_core.runtime.weights import load_checkpoint

    shards = load_checkpoint(directory, specs, 0, 2, check_finite=True)
    for name in shards:  # read every tensor, as loading does
        shards[name]


def test_corrupted_checkpoints_fail_in_one_line_or_load(base: dict[str, Any]) -> None:
    rng = random.Random(SEED)
    data = (base["good"] / "model.safetensors").read_bytes()
    mutations = _checkpoint_mutations(rng)
    outcomes = {"error": 0, "loaded": 0}
    for case in range(CHECKPOINT_CASES):
        label, mutate = mutations[case % len(mutations)]
        directory = base["root"] / f"ckpt{case}"
        directory.mkdir()
        shutil.copy(base["good"] / "config.json", directory / "config.json")
        (directory / "model.safetensors").write_bytes(mutate(data))
        try:
            _load(directory, base["specs"])
        except FdError as exc:
            assert "\n" not in str(exc) and str(exc).strip(), f"case {case} ({label}): a multi-line or empty error: {exc!r}"
            outcomes["error"] += 1
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {case} ({label}) of seed {SEED}: {type(exc).__name__}: {exc}")
        else:
            outcomes["loaded"] += 1
        shutil.rmtree(directory)
    assert outcomes["error"] > CHECKPOINT_CASES // 2, outcomes  # the generator really corrupts


FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "vocab_size", "head_dim", "rope_theta", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
          "use_bias", "hidden_act", "rope_parameters", "architectures", "text_config")


def test_mutated_configs_fail_in_one_line_or_parse(base: dict[str, Any]) -> None:
    rng = random.Random(SEED + 1)
    good = json.loads((base["good"] / "config.json").read_text())
    arch = base["arch"]
    errors = 0
    for case in range(CONFIG_CASES):
        data = copy.deepcopy(good)
        for _ in range(rng.randint(1, 3)):
            field = rng.choice(FIELDS)
            if rng.random() < 0.15:
                data.pop(field, None)
            elif field == "rope_parameters":
                data[field] = rng.choice(
                    [{"rope_type": rng.choice(["yarn", "linear", 5, None])}, {"rope_theta": rng.choice(WEIRD)},
                     rng.choice(WEIRD)]
                )
            else:
                data[field] = rng.choice(WEIRD)
        try:
            config = arch.config_from(data, source="fuzz")
            config.check_tensor_parallel(2)
            config.estimated_bytes(1, 64)
        except FdError as exc:
            assert "\n" not in str(exc) and str(exc).strip(), f"case {case}: a multi-line or empty error: {exc!r}"
            errors += 1
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"config case {case} of seed {SEED}: {type(exc).__name__}: {exc}; config {json.dumps(data, default=str)[:300]}")
    assert errors > CONFIG_CASES // 2
