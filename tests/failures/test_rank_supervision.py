"""Supervising the ranks of `fd run`: a stopped or stuck rank, a platform whose all-reduce does not sum,
non-finite numbers, a cleanup hook that raises, and an unexpected error in the in-process rank (tp=1).

Every case ends with one `fd: error:` line (exit 2) within a stated bound, and no process left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import FdRun, assert_one_line_error, fd_env, left_over, new_marker, run_fd

WRONG_SUM = """
from fd_core import Detection, hookimpl

@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=5, reason="sums plus one", device="cpu", dist_backend="gloo", max_ranks=2)

@hookimpl
def fd_all_reduce(tensor, group):
    import paddle.distributed as dist

    dist.all_reduce(tensor, group=group)
    return tensor + 1
"""


def _start(args: list[str], path: Path | None, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    marker = new_marker()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fd_core.cli", *args], env=fd_env(marker, path, env), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    return proc, marker


def _finish(proc: subprocess.Popen[str], marker: str, args: list[str], begin: float, timeout: float = 120) -> FdRun:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return FdRun(args, proc.returncode, out, err, time.monotonic() - begin, marker)


def test_a_stopped_rank_ends_the_run_naming_it(probe_root: Path, tmp_path: Path) -> None:
    """SIGSTOP to rank 1 while decoding: within seconds `fd run` names it and stops every rank
    (a stopped process included)."""
    probe = tmp_path / "probe"
    probe.mkdir()
    args = ["run", "--tp", "2", "--steps", "2000", "--graph", "off", "--rank-timeout", "3"]
    begin = time.monotonic()
    proc, marker = _start(args, probe_root, {"FDTEST_PROBE_DIR": str(probe), "FDTEST_PROBE_AT": "20"})
    deadline = time.monotonic() + 90
    while not (probe / "rank1.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the ranks never reached decoding"
        time.sleep(0.05)
    os.kill(json.loads((probe / "rank1.json").read_text())["pid"], signal.SIGSTOP)
    stopped_at = time.monotonic()
    run = _finish(proc, marker, args, begin)
    assert_one_line_error(run, "rank 1 failed: stopped (SIGSTOP or a debugger) for ", exact=False)
    assert run.error_lines[0].endswith("every rank was stopped")
    assert time.monotonic() - stopped_at < 15
    assert left_over(marker) == []


def test_a_rank_stuck_in_a_plugin_ends_the_run_naming_it(probe_root: Path) -> None:
    """Rank 1's cleanup hook never returns; rank 0 waits for it in a collective:
    the quiet rank is named after --stall-timeout."""
    args = ["run", "--tp", "2", "--steps", "4", "--stall-timeout", "5", "--rank-timeout", "3"]
    begin = time.monotonic()
    proc, marker = _start(args, probe_root, {"FDTEST_HANG_CLEANUP_RANK": "1"})
    run = _finish(proc, marker, args, begin)
    assert_one_line_error(run, "rank 1 failed: made no progress for ", exact=False)
    assert "(last phase: loading weights); raise --stall-timeout if it is only slow; every rank was stopped" in run.error_lines[0]
    assert run.seconds < 60
    assert left_over(marker) == []


def test_a_platform_whose_all_reduce_does_not_sum_is_caught_before_loading(distribution) -> None:
    root = distribution("wrong-sum", {"wrong_sum": WRONG_SUM}, {"fd.platforms": {"wrongsum": "wrong_sum"}})
    done = run_fd(["run", "--tp", "2", "--steps", "2"], path=root, timeout=120)
    # Both ranks find it; whichever reports first is named (the other follows in brackets).
    first = next(
        r for r in (0, 1) if f"rank {r} failed: NumericsError" in done.stderr.splitlines()[-1].split(" (then ")[0]
    )
    assert_one_line_error(
        done,
        f"rank {first} failed: NumericsError: platform 'wrongsum': the all-reduce (direct: wrongsum.fd_all_reduce) of a known "
        f"float32[8] tensor on rank {first} of 2 returned a wrong sum at 8 of 8 elements: first at index [0], 4 where 3 is exact; "
        "largest error 1; it does not sum, run fd check wrongsum",
        exact=False,
    )
    assert "loaded" not in done.stderr  # stopped before any weight was read
    assert left_over(done.marker) == []


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("nan")
    done = run_fd(["save-random", "--model", "ernie4_5", str(root / "ckpt")])
    assert done.returncode == 0, done.stderr
    weights = root / "ckpt" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.norm.weight"][3] = np.nan
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return root / "ckpt"


@pytest.mark.parametrize("tp", ["1", "2"])
def test_non_finite_weights_are_refused_naming_the_tensor(nan_checkpoint: Path, tp: str) -> None:
    done = run_fd(["run", "--tp", tp, "--steps", "2", "--checkpoint", str(nan_checkpoint)])
    message = (
        f"checkpoint {nan_checkpoint}/model.safetensors: tensor 'model.norm.weight' holds NaN or Inf; re-save or "
        f"re-download it (fd run --allow-non-finite loads it anyway, for experiments)"
    )
    assert_one_line_error(done, message if tp == "1" else f"NumericsError: {message}", exact=tp == "1")
    assert left_over(done.marker) == []


def test_allowed_non_finite_weights_stop_at_the_first_non_finite_logits(nan_checkpoint: Path) -> None:
    done = run_fd(["run", "--tp", "1", "--steps", "2", "--checkpoint", str(nan_checkpoint), "--allow-non-finite"])
    assert_one_line_error(done, "step 0 produced 512 non-finite logit(s) (NaN or Inf) for prompt 1; ", exact=False)


def test_a_cleanup_hook_that_raises_is_named(probe_root: Path) -> None:
    done = run_fd(["run", "--tp", "1", "--steps", "2", "--reload-cycles", "1"], path=probe_root,
                  env={"FDTEST_CLEANUP_RAISES": "1"})
    assert_one_line_error(
        done, "plugin 'failprobe': fd_clean_memory_fragments raised ValueError: failprobe: cleanup cannot free this state; fix or uninstall the plugin"
    )


BROKEN_CAPTURE = """
from fd_core import Detection, GraphVote, hookimpl

@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=5, reason="captures badly", device="cpu", dist_backend="gloo", max_ranks=1)

@hookimpl
def fd_all_reduce(tensor, group):
    return tensor

class Graphs:
    mode = "broken"

    def capture(self, key, fn, inputs):
        raise RuntimeError("driver lost the stream")

    def replay(self, key, inputs):
        raise AssertionError("never captured")

    def has(self, key):
        return False

    def clear(self):
        pass

@hookimpl
def fd_graph_backend(parallel_config):
    return Graphs()
"""


def test_an_unexpected_error_at_tp1_is_one_line_with_its_traceback_kept(distribution) -> None:
    """The in-process rank (tp=1) fails like a spawned one: one line, the traceback in a file it names."""
    root = distribution("broken-capture", {"broken_capture": BROKEN_CAPTURE},
                        {"fd.platforms": {"brokencap": "broken_capture"}})
    done = run_fd(["run", "--tp", "1", "--steps", "2"], path=root)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line = done.error_lines[-1]
    assert line.startswith("fd: error: rank 0 failed: RuntimeError: driver lost the stream; its traceback is in ")
    trace = Path(line.rsplit("; its traceback is in ", 1)[1])
    assert (trace.read_text().startswith("Traceback (most recent call last):")
            and "driver lost the stream" in trace.read_text())

