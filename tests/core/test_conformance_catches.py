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
    root = make_distribution(tmp_path / "broken", "broken-chip", {"broken_chip": BROKEN}, {"fd.platforms": {"brokenchip": "broken_chip"}})
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
    root = make_distribution(tmp_path / "typo", "typo-chip", {"typo_chip": TYPO}, {"fd.platforms": {"typochip": "typo_chip"}})
    done = run_fd(["check", "typochip"], path=root)
    assert done.returncode == 2
    assert done.stderr.strip() == "fd: error: plugin 'typochip': hook 'fd_all_reduse' matches no hookspec; did you mean 'fd_all_reduce'?"
