"""Bad `fd run` configuration: one error line, exit code 2, and no process started.

Every check runs in `plan_run` (or argparse) in the `fd` process before any rank is spawned.
"No process started" is shown two ways: paddle was never imported (spawning goes through
paddle.distributed, and the rank count check needs no paddle), and nothing carrying the run's
marker is alive afterwards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import assert_one_line_error, left_over, run_fd
from fd_models.presets import TINY_TEXT

CORES = os.cpu_count() or 1
HEADS = "num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=512"


def config_checkpoint(directory: Path, **overrides: object) -> Path:
    """A checkpoint directory whose config.json is the tiny ERNIE preset with `overrides`.

    The weights file is a placeholder: these runs must fail on the config, before any weight is read.
    """
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**TINY_TEXT, **overrides, "architectures": ["ernie4_5"]}))
    save_file({"placeholder": np.zeros(1, dtype=np.float32)}, str(directory / "model.safetensors"))
    return directory


def assert_nothing_started(run) -> None:
    assert run.paddle_imported is False, run.stderr
    assert left_over(run.marker, wait=0) == []
    assert "INFO" not in run.stderr and "launch.py" not in run.stderr  # no paddle output at all


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "argument --max-new-tokens/--steps: must be >= 1, got 0 (see fd run --help)"),
        (["--steps", "-1"], "argument --max-new-tokens/--steps: must be >= 1, got -1 (see fd run --help)"),
        (["--tp", "0"], "argument --tp: must be >= 1, got 0 (see fd run --help)"),
        (["--model", "nosuch"], "unknown architecture 'nosuch'; registered: ernie4_5 (Ernie4_5ForCausalLM), ernie4_5_vl (Ernie4_5_VLMoeForConditionalGeneration), qwen3_vl (Qwen3VLForConditionalGeneration)"),
        (["--prompt-ids", "1,999"], "prompt token id 999 is outside the vocabulary 0..511"),
    ],
    ids=["steps-0", "steps-negative", "tp-0", "unknown-model", "prompt-outside-vocab"],
)
def test_bad_run_arguments(args: list[str], message: str) -> None:
    done = run_fd(["run", *args], traced=True)
    assert_one_line_error(done, message)
    assert_nothing_started(done)


def test_tp_that_does_not_divide_the_heads() -> None:
    done = run_fd(["run", "--tp", "3"], traced=True)
    expected = f"tp=3 does not divide {HEADS} of ernie4_5; choose a tp that divides each of them"
    if CORES < 3:  # both problems, in one line: fixing one at a time would cost a second failed start
        expected += f"; also --tp 3 is more than platform 'cpu' serves here ({CORES}); use --tp {CORES} or fewer"
    assert_one_line_error(done, expected)
    assert_nothing_started(done)


@pytest.mark.parametrize(
    ("overrides", "bad"),
    [
        ({"num_key_value_heads": 3, "num_attention_heads": 6, "hidden_size": 96}, "num_key_value_heads=3"),
        ({"vocab_size": 511}, "vocab_size=511"),
        ({"intermediate_size": 129}, "intermediate_size=129"),
    ],
    ids=["kv-heads", "vocab", "intermediate"],
)
def test_tp_that_does_not_divide_a_sharded_dimension_of_the_checkpoint(
    tmp_path: Path, overrides: dict, bad: str,
) -> None:
    checkpoint = config_checkpoint(tmp_path / "ckpt", **overrides)
    done = run_fd(["run", "--tp", "2", "--checkpoint", str(checkpoint)], traced=True)
    assert_one_line_error(done, f"tp=2 does not divide {bad} of ernie4_5; choose a tp that divides each of them")
    assert_nothing_started(done)


def test_tp_above_what_the_platform_serves(tmp_path: Path) -> None:
    tp = 1 << CORES.bit_length()  # the smallest power of two above the core count (the cpu platform's limit)
    checkpoint = config_checkpoint(
        tmp_path / "wide", num_attention_heads=tp, num_key_value_heads=tp, head_dim=16, hidden_size=16 * tp,
        intermediate_size=128 * tp, vocab_size=512 * tp,
    )
    done = run_fd(["run", "--tp", str(tp), "--checkpoint", str(checkpoint)], traced=True)
    assert_one_line_error(done, f"--tp {tp} is more than platform 'cpu' serves here ({CORES}); use --tp {CORES} or fewer")
    assert_nothing_started(done)


def test_tp_64_names_both_the_model_and_the_platform_limit() -> None:
    if CORES >= 64:
        pytest.skip("this host serves 64 ranks")
    done = run_fd(["run", "--tp", "64"], traced=True)
    assert_one_line_error(
        done,
        "tp=64 does not divide num_attention_heads=4, num_key_value_heads=2 of ernie4_5; choose a tp that divides each of them; "
        f"also --tp 64 is more than platform 'cpu' serves here ({CORES}); use --tp {CORES} or fewer",
    )
    assert_nothing_started(done)
