"""The conformance suite fails a deliberately broken plugin, saying which contract it broke."""

from __future__ import annotations

import re

from fakedist import make_distribution, run_fd

BROKEN = """
from fd_core import Capabilities, Detection, GraphVote, hookimpl

FD_CAPABILITIES = Capabilities(dtypes=("float32",), graphs=False)

@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=-5, reason="emulated", dist_backend="gloo")

@hookimpl
def fd_all_reduce(tensor, group):
    import paddle.distributed as dist

    if 0 in tensor.shape:
        return tensor
    dist.all_reduce(tensor, group=group)
    return tensor + 1  # off by one: the wrong sum

@hookimpl
def fd_graph_eligibility(model_config):
    return GraphVote.veto("")  # a veto without its reason
"""

TYPO = """
from fd_core import Detection, hookimpl

@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=-5, reason="emulated", dist_backend="gloo")

@hookimpl
def fd_all_reduse(tensor, group):
    return tensor
"""


def test_wrong_sum_and_silent_veto_fail_with_the_broken_contract(tmp_path) -> None:
    root = make_distribution(tmp_path / "broken", "broken-chip", {"broken_chip": BROKEN},
                             {"fd.platforms": {"brokenchip": "broken_chip"}})
    done = run_fd(["check", "brokenchip"], path=root, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    assert rows["test_two_ranks_sum[1-float32]"].split()[0] == "failed"
    assert "brokenchip: all-reduce of float32[1] on rank 0 returned a wrong sum" in rows["test_two_ranks_sum[1-float32]"]
    assert rows["test_two_ranks_sum[0-float32]"].split()[0] == "passed"  # zero-size: nothing to get wrong
    assert "plugin 'brokenchip': fd_graph_eligibility vetoed without a reason" in rows["test_votes_are_well_formed"]
    assert re.search(r"skipped\s+test_replay_equals_eager_and_clear_recaptures\s+brokenchip: capabilities.graphs is False", done.stdout)
    assert re.search(r"^\d+ passed, [1-9]\d* failed, \d+ skipped$", done.stdout, re.M)


def test_misspelled_hook_fails_before_any_check_runs(tmp_path) -> None:
    root = make_distribution(tmp_path / "typo", "typo-chip", {"typo_chip": TYPO},
                             {"fd.platforms": {"typochip": "typo_chip"}})
    done = run_fd(["check", "typochip"], path=root)
    assert done.returncode == 2
    assert done.stderr.strip() == "fd: error: plugin 'typochip': hook 'fd_all_reduse' matches no hookspec; did you mean 'fd_all_reduce'?"


RAISING_CLEANUP = """
from fd_core import Capabilities, Detection, hookimpl

FD_CAPABILITIES = Capabilities(dtypes=("float32",), graphs=False)

@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=-5, reason="emulated", dist_backend="gloo", device="cpu")

@hookimpl
def fd_all_reduce(tensor, group):
    return tensor

@hookimpl
def fd_clean_memory_fragments(state_dict):
    for value in (state_dict or {}).values():
        value.numpy()  # numpy arrays (what the runner stages for seeded weights) have no .numpy()
"""

# A model package whose graph-clear hook claims ERNIE-4.5 models and clears nothing.
LYING_CLEAR = """
from fd_core import hookimpl

@hookimpl(tryfirst=True)
def fd_clear_graphs(model):
    return True
"""


def test_a_cleanup_that_fails_on_what_the_runner_passes_is_caught(tmp_path) -> None:
    root = make_distribution(tmp_path / "c", "cleanup-chip", {"cleanup_chip": RAISING_CLEANUP},
                             {"fd.platforms": {"cleanupchip": "cleanup_chip"}})
    done = run_fd(["check", "cleanupchip", "-k", "cleanup"], path=root, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"failed\s+test_cleanup_takes_every_argument_the_runner_passes\s+.*plugin 'cleanupchip': fd_clean_memory_fragments raised AttributeError", done.stdout)


def test_a_graph_clear_hook_that_clears_nothing_is_caught(tmp_path) -> None:
    root = make_distribution(tmp_path / "l", "lying-clear", {"lying_clear": LYING_CLEAR},
                             {"fd.plugins": {"lyingclear": "lying_clear"}})
    done = run_fd(["check", "cpu", "-k", "really_clears"], path=root, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "fd_clear_graphs returned True but the graphs are still captured" in done.stdout


STRIDED = """
from fd_core import Detection, hookimpl
from fd_plugins.cpu import platform as cpu
from fd_plugins.cpu.platform import (  # noqa: F401
    FD_CAPABILITIES, fd_clean_memory_fragments, fd_graph_backend, fd_graph_eligibility,
)

FD_CONTRACT = "1.2"


@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=-5, reason="emulated", device="cpu", dist_backend="gloo")


@hookimpl
def fd_all_reduce(tensor, group):
    return cpu.fd_all_reduce(tensor, group)


def strided_matmul(x, weight, transpose_weight=False):
    import paddle

    # The right values as a transposed view: eager runs and the kernel checks take it; a capture that feeds it to the
    # all-reduce refuses it.
    rows = x.reshape([-1, x.shape[-1]])
    out = paddle.matmul(weight, rows, transpose_x=not transpose_weight, transpose_y=True).T
    return out if len(x.shape) == 2 else out.reshape([*x.shape[:-1], out.shape[-1]])


@hookimpl
def fd_register_kernels(register):
    register("matmul", strided_matmul)
"""


def test_a_product_returning_a_strided_view_fails_the_tp2_capture_check(tmp_path) -> None:
    """Before, `fd check` passed it and `fd run --tp 2 --graph on` crashed at capture (issue 44)."""
    root = make_distribution(tmp_path / "strided", "strided-chip", {"strided_chip": STRIDED},
                             {"fd.platforms": {"stridedchip": "strided_chip"}})
    done = run_fd(["check", "stridedchip", "-k", "captured_at_tp2 or every_kernel_in_use"], path=root, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    assert rows["test_every_kernel_in_use_matches_the_native_op"].split()[0] == "passed"  # its values are right
    row = rows["test_a_model_captured_at_tp2_gives_the_eager_tokens"]
    assert row.split()[0] == "failed" and "stridedchip: ernie4_5 at tp=2" in row and "viewed Tensor" in row, row
