"""Bad values in options, the launcher's environment and a checkpoint directory: each is refused with one
`fd: error:` line (exit 2) before any rank starts, and no process left.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_error, left_over, run_fd


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["run", "--seed", "-1"], {}, "argument --seed: must be >= 0, got -1 (see fd run --help)"),
        (["run", "--rank-timeout", "nan"], {}, "argument --rank-timeout: must be a positive, finite number of seconds, got nan (see fd run --help)"),
        (["run", "--stall-timeout", "0"], {}, "argument --stall-timeout: must be a positive, finite number of seconds, got 0 (see fd run --help)"),
        (["run"], {"PADDLE_TRAINER_ID": "abc", "PADDLE_TRAINERS_NUM": "2"},
         "PADDLE_TRAINER_ID='abc', PADDLE_TRAINERS_NUM='2': not rank numbers; unset them, or start fd with python -m paddle.distributed.launch"),
        (["plugins"], {"FD_HOOK_TIMEOUT": "soon"}, "FD_HOOK_TIMEOUT='soon' is not a number of seconds"),
    ],
    ids=["negative-seed", "nan-timeout", "zero-stall", "launcher-garbage", "hook-timeout-garbage"],
)
def test_bad_values_are_one_line(args: list[str], env: dict[str, str], message: str) -> None:
    done = run_fd(args, env=env)
    assert_one_line_error(done, message)


def test_absurd_sizes_are_refused_before_allocating(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    from fd_models.presets import TINY_TEXT

    directory = tmp_path / "huge"
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps(
            {**TINY_TEXT, "num_hidden_layers": 1_000_000, "hidden_size": 4096, "head_dim": 128,
             "intermediate_size": 16384}
        )
    )
    save_file({"placeholder": np.zeros(1, dtype=np.float32)}, str(directory / "model.safetensors"))
    done = run_fd(["run", "--checkpoint", str(directory)], traced=True)
    assert_one_line_error(done, "ernie4_5 needs about ", exact=False)
    # One rank's share of the weights against the device it runs on (the host, shared by the tp=2 ranks).
    assert "GiB of weights per rank (float32, 2 ranks of tp=2 share it), and device 0 of platform 'cpu' has " in done.error_lines[0]
    assert done.paddle_imported is False


def test_a_pickle_named_in_capitals_is_still_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    from fd_models.presets import TINY_TEXT

    (directory / "config.json").write_text(json.dumps(TINY_TEXT))
    (directory / "weights.PT").write_bytes(b"\x80\x04N.")
    done = run_fd(["run", "--checkpoint", str(directory)], traced=True)
    assert_one_line_error(done, f"checkpoint {directory}/weights.PT: pickle-based weight files are refused (loading them can run code); convert it to safetensors")


@pytest.mark.parametrize(("args", "env", "expected"), [
    (["run", "--tp", "2", "--rank-timeout", "1e13"], {}, "argument --rank-timeout: must be at most 604800 seconds (a week), got 1e13"),
    (["run", "--tp", "2", "--stall-timeout", "1e13"], {}, "argument --stall-timeout: must be at most 604800 seconds (a week), got 1e13"),
    (["explain"], {"FD_HOOK_TIMEOUT": "1e13"}, "FD_HOOK_TIMEOUT='1e13' is more than a week; give at most 604800 seconds"),
], ids=["rank-timeout", "stall-timeout", "hook-timeout"])
def test_a_wait_too_long_to_give_is_refused_at_once(args: list[str], env: dict[str, str], expected: str) -> None:
    run = run_fd(args, env=env, traced=True)
    assert_one_line_error(run, f"{expected} (see fd run --help)" if args[0] == "run" else expected)
    assert run.paddle_imported is False
    assert run.seconds < 20


def test_a_stray_trainers_num_is_refused_naming_it() -> None:
    """PADDLE_TRAINERS_NUM without the rest of a launcher's environment: Paddle's spawn would assert."""
    run = run_fd(["run", "--tp", "2", "--steps", "2"], env={"PADDLE_TRAINERS_NUM": "2"})
    assert_one_line_error(run, "PADDLE_TRAINERS_NUM=2 is set, but this process was not started by paddle.distributed.launch "
                               "(PADDLE_TRAINER_ID is unset); unset PADDLE_TRAINERS_NUM to spawn the ranks here")
    assert left_over(run.marker) == []
