"""cpu_checked on two real ranks (paddle.distributed spawn over gloo, nothing mocked), plus the conformance suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from typing import Any

import pytest

import checked_workers
from fd_checked_allreduce import platform
from fd_core import Capabilities, Detection, GraphVote, ModelConfig, ParallelConfig
from fd_core.testing import PlatformSuite

INSTALLED = any(ep.name == "cpu_checked" for ep in entry_points(group="fd.platforms"))
needs_install = pytest.mark.skipif(
    not INSTALLED, reason="fd-checked-allreduce is not installed: pip install ./examples/fd-checked-allreduce"
)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    """Both ranks' results of `checked_workers.battery`, from one spawn shared by every test here."""
    from fd_core.runtime.ranks.spawn import spawn_ranks

    return spawn_ranks(checked_workers.battery, (), 2, "gloo")


def test_detection_is_opt_in_and_does_not_import_paddle() -> None:
    answer = platform.fd_platform_detect()
    assert isinstance(answer, Detection)
    assert answer.detected and answer.priority == -1
    assert answer.reason.startswith("opt-in: set FD_PLATFORM=cpu_checked")
    probe = ("import sys; from fd_checked_allreduce import platform as p; p.fd_platform_detect(); "
             "print('paddle' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.strip() == "False"


def test_graph_vote_vetoes_tensor_parallel_and_allows_one_rank() -> None:
    config = ModelConfig(architecture="probe")
    veto = platform.fd_graph_eligibility(config, ParallelConfig(tp_size=2, tp_rank=0), "static")
    assert isinstance(veto, GraphVote) and not veto.allow and not veto.advisory
    assert "static graph would skip it" in veto.reason
    assert platform.fd_graph_eligibility(config, ParallelConfig(tp_size=1), "static").allow


def test_fingerprints_tell_shapes_and_dtypes_apart() -> None:
    assert platform.fingerprint(3, [2, 2], "float32") != platform.fingerprint(3, [4], "float32")
    assert platform.fingerprint(3, [4], "float16") != platform.fingerprint(3, [4], "bfloat16")
    names = {platform.fingerprint(0, [], "float32")[1]: "float32"}
    assert platform.describe(platform.fingerprint(12, [1, 4, 1024], "float32"), names) == "call 12: float32[1, 4, 1024]"


def test_ranks_in_step_sum_and_ranks_out_of_step_fail_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for run in ranks:
        assert run["platform"] == "cpu_checked" and run["binding"] == "direct: cpu_checked.fd_all_reduce"
        assert run["sum"] == [[3.0] * 3] * 2
        assert not run["graph"]["allowed"] and "cpu_checked vetoed" in run["graph"]["summary"]
        assert "rank 0 call 2: float32[4]; rank 1 call 2: float32[2, 2]" in run["shape"], run["shape"]
        assert "rank 0 call 3: float32[4]; rank 1 call 3: float64[4]" in run["dtype"], run["dtype"]
        assert "rank 0 call 5: float32[4]; rank 1 call 4: float32[4]" in run["skipped"], run["skipped"]


@needs_install
class TestCpuCheckedConformance(PlatformSuite):
    @pytest.fixture
    def platform_name(self) -> str:
        return "cpu_checked"

    @pytest.fixture
    def capabilities(self) -> Capabilities:
        return platform.FD_CAPABILITIES


@needs_install
def test_fd_run_gives_the_same_tokens_as_the_cpu_platform() -> None:
    """`fd run` at tp=2 with cpu_checked active (eager: it vetoes static graphs) vs cpu."""

    def run(name: str) -> dict[str, Any]:
        env = {**os.environ, "FD_PLATFORM": name}
        done = subprocess.run([sys.executable, "-m", "fd_core.cli", "run", "--steps", "8", "--json"],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    checked, cpu = run("cpu_checked"), run("cpu")
    assert checked["platform"] == "cpu_checked" and checked["all_reduce"] == "direct: cpu_checked.fd_all_reduce"
    assert checked["tokens"] == cpu["tokens"]
