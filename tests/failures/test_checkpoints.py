"""Bad checkpoints: an error naming the file and the tensor, exit code 2, nothing half loaded or half written.

Directory-level problems (no config.json, a pickle file, unreadable config.json) are found by
`plan_run` in the `fd` process before any rank starts. Tensor-level problems need the model's
weight specs, so each rank finds them while reading: it reads and checks every tensor into numpy
arrays before a single parameter is assigned (fd_core.runtime.weights.load_checkpoint), and a rank that
fails stops the others.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import FdRun, assert_one_line_error, left_over, run_fd, start_fd
from fd_core.errors import CheckpointError

TENSOR = "model.layers.1.mlp.down_proj.weight"
EXTRA = "model.layers.1.mlp.extra.weight"


def _variant(root: Path, good: Path, name: str, tensors: dict | None) -> Path:
    from safetensors.numpy import save_file

    directory = root / name
    directory.mkdir()
    shutil.copy(good / "config.json", directory / "config.json")
    if tensors is not None:
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A good `fd save-random` checkpoint and one broken copy per failure case."""
    from safetensors.numpy import load_file

    root = tmp_path_factory.mktemp("checkpoints")
    saved = run_fd(["save-random", "--model", "ernie4_5", str(root / "good")])
    assert saved.returncode == 0, saved.stderr
    good = root / "good"
    tensors = load_file(str(good / "model.safetensors"))
    out = {"good": good}
    out["missing"] = _variant(root, good, "missing", {k: v for k, v in tensors.items() if k != TENSOR})
    out["extra"] = _variant(root, good, "extra", {**tensors, EXTRA: np.zeros((2, 2), np.float32)})
    out["shape"] = _variant(root, good, "shape", {**tensors, TENSOR: np.zeros((3, 3), np.float32)})
    out["dtype"] = _variant(root, good, "dtype", {**tensors, TENSOR: tensors[TENSOR].astype(np.int32)})
    out["truncated"] = _variant(root, good, "truncated", None)
    data = (good / "model.safetensors").read_bytes()
    (out["truncated"] / "model.safetensors").write_bytes(data[:-1000])
    out["pickle"] = _variant(root, good, "pickle", tensors)
    (out["pickle"] / "pytorch_model.bin").write_bytes(b"\x80\x04N.")  # pickle of None: never opened
    out["no-config"] = root / "no-config"
    out["no-config"].mkdir()
    shutil.copy(good / "model.safetensors", out["no-config"])
    out["bad-json"] = _variant(root, good, "bad-json", tensors)
    (out["bad-json"] / "config.json").write_text('{"architectures": ["ernie4_5"],')
    return out


def expected_message(case: str, directory: Path) -> str:
    weights = directory / "model.safetensors"
    mismatch = "the checkpoint does not match this architecture's config"
    return {
        "missing": f"checkpoint {directory}: tensor {TENSOR!r} is missing; {mismatch}",
        "extra": f"checkpoint {weights}: unexpected tensor {EXTRA!r}; {mismatch}",
        "shape": f"checkpoint {weights}: tensor {TENSOR!r} has shape [3, 3], expected [64, 128]",
        "dtype": f"checkpoint {weights}: tensor {TENSOR!r} has dtype I32, expected a float type (F32, BF16, F16, F64)",
        "truncated": (
            f"checkpoint {weights}: truncated: tensor 'model.layers.1.self_attn.v_proj.weight' ends at byte 427008 "
            f"of the data, but the file holds 426264; re-save or re-download it"
        ),
    }[case]


TENSOR_CASES = ["missing", "extra", "shape", "dtype", "truncated"]
# Each `fd run --tp 2` costs seconds (two ranks import paddle); the others take the same path, and
# their messages are checked in-process above.
CLI_CASES = ["shape", "truncated"]


@pytest.mark.parametrize("case", TENSOR_CASES)
def test_tensor_problem_is_found_before_any_parameter_is_touched(checkpoints: dict[str, Path], case: str) -> None:
    """In-process, one rank: load() raises naming the file and tensor, and the model still holds build's zeros."""
    from fd_core.config import ParallelConfig
    from fd_core.host.backend import load_backend
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for

    directory = checkpoints[case]
    plugins = load_plugins({})
    arch = plugins.registry.get("ernie4_5")
    runner = ModelRunner(load_backend(ParallelConfig(), plugins=plugins), arch, model_config_for(arch, str(directory)),
                         str(directory))
    with pytest.raises(CheckpointError) as err:
        runner.load()
    assert str(err.value) == expected_message(case, directory)
    assert runner.model is not None
    untouched = [name for name, p in runner.model.named_parameters() if np.any(p.numpy())]
    assert untouched == [], f"parameters assigned before the checkpoint was fully checked: {untouched}"


@pytest.mark.parametrize("case", TENSOR_CASES)
def test_every_rank_checks_every_tensor_not_only_its_shard(checkpoints: dict[str, Path], case: str) -> None:
    from fd_core.config import ParallelConfig
    from fd_core.host.backend import load_backend
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.plan import model_config_for
    from fd_core.runtime.weights import load_checkpoint

    plugins = load_plugins({})
    arch = plugins.registry.get("ernie4_5")
    backend = load_backend(ParallelConfig(tp_size=2, tp_rank=1), plugins=plugins)
    specs = arch.build(model_config_for(arch, None), backend).weight_specs()
    for rank in (0, 1):
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(checkpoints[case], specs, tp_rank=rank, tp_size=2)
        assert str(err.value) == expected_message(case, checkpoints[case])


@pytest.fixture(scope="module")
def tp2_runs(checkpoints: dict[str, Path]) -> dict[str, FdRun]:
    """`fd run --tp 2 --checkpoint <broken>` for CLI_CASES, started together to save time."""
    started = {}
    for case in CLI_CASES:
        started[case] = (start_fd(["run", "--tp", "2", "--steps", "2", "--checkpoint", str(checkpoints[case])]),
                         time.monotonic())
    runs = {}
    for case, ((proc, marker), begin) in started.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        runs[case] = FdRun(proc.args, proc.returncode, out, err, time.monotonic() - begin, marker)
    return runs


@pytest.mark.parametrize("case", CLI_CASES)
def test_fd_run_with_a_broken_checkpoint_names_file_and_tensor_and_stops_every_rank(
    tp2_runs: dict[str, FdRun], checkpoints: dict[str, Path], case: str
) -> None:
    run = tp2_runs[case]
    # Every rank finds the same problem; the line names the first, then says the other agreed if its
    # failure landed within the settle window (on a loaded machine the other rank may still be reading).
    assert_one_line_error(run, f"failed: CheckpointError: {expected_message(case, checkpoints[case])}", exact=False)
    line = run.error_lines[0]
    first, other = (0, 1) if line.startswith("fd: error: rank 0 failed") else (1, 0)
    named = f"fd: error: rank {first} failed: CheckpointError: {expected_message(case, checkpoints[case])}"
    assert line in (named, f"{named} (rank {other} failed the same way)")
    assert "FatalError" not in run.stderr and "C++ Traceback" not in run.stderr
    assert left_over(run.marker) == []


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no-config", "checkpoint {d}: config.json is missing; add the model's config.json beside the weights"),
        ("pickle", "checkpoint {d}/pytorch_model.bin: pickle-based weight files are refused (loading them can run code); convert it to safetensors"),
        ("bad-json", "checkpoint {d}/config.json: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 32 (char 31)); fix or regenerate config.json"),
    ],
)
def test_directory_problem_fails_before_any_rank_starts(checkpoints: dict[str, Path], case: str, message: str) -> None:
    done = run_fd(["run", "--tp", "2", "--checkpoint", str(checkpoints[case])], traced=True)
    assert_one_line_error(done, message.format(d=checkpoints[case]))
    assert done.paddle_imported is False
    assert left_over(done.marker, wait=0) == []


def test_save_random_refuses_a_non_empty_directory_and_leaves_it_alone(
    checkpoints: dict[str, Path], tmp_path: Path,
) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    done = run_fd(["save-random", str(target)])
    assert_one_line_error(done, f"{target}: exists and is not empty; choose a new directory")
    assert [p.name for p in target.iterdir()] == ["notes.txt"] and (target / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no staging directory left behind


def test_save_that_fails_midway_leaves_no_file_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save_checkpoint writes into a staging directory and renames it whole: a failure leaves nothing."""
    from fd_core.runtime import weights
    from fd_core.runtime.weights import save_checkpoint

    def write_half_then_fail(path: Path, tensors: dict, dtype: str) -> None:
        Path(path).write_bytes(b"\x00" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights, "_write_safetensors", write_half_then_fail)
    with pytest.raises(OSError, match="No space left on device"):
        save_checkpoint(tmp_path / "ckpt", {"architectures": ["ernie4_5"]}, {"w": np.zeros(4, np.float32)})
    assert list(tmp_path.iterdir()) == []

