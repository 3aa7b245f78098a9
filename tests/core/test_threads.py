"""The compute-thread decision: --threads, then the platform's threads variable (the cpu platform's OMP_NUM_THREADS,
when the user set it), then the usable cores shared among the host's ranks; what fd run reports of it (and of the
decode step's parts); and the cpu platform's thread policy, which lives in its plugin, not in fd_core."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fd_core.errors import ConfigError
from fd_core.lifecycle import RankContext
from fd_core.runtime.plan import RunConfig, plan_run
from fd_core.runtime.threads import decide_threads
from fd_plugins.cpu.cores import CGROUP_V1_QUOTA, CGROUP_V2_CPU_MAX, cgroup_cpu_limit, usable_cores


def files(contents: dict[str, str]):
    return lambda path: contents.get(path)


def test_cgroup_quota_v2_v1_and_unlimited() -> None:
    assert cgroup_cpu_limit(files({CGROUP_V2_CPU_MAX: "150000 100000"})) == 1.5
    assert cgroup_cpu_limit(files({CGROUP_V2_CPU_MAX: "max 100000"})) is None
    assert cgroup_cpu_limit(files({CGROUP_V1_QUOTA[0]: "50000", CGROUP_V1_QUOTA[1]: "100000"})) == 0.5
    assert cgroup_cpu_limit(files({CGROUP_V1_QUOTA[0]: "-1", CGROUP_V1_QUOTA[1]: "100000"})) is None
    assert cgroup_cpu_limit(files({})) is None


@pytest.mark.parametrize(
    ("ranks", "cores", "quota", "expected"),
    [
        (1, 2, None, 2),  # tp=1 on 2 cores: both
        (2, 2, None, 1),  # tp=2: one each
        (1, 8, 2.0, 2),  # the quota caps the affinity mask
        (1, 8, 1.5, 2),  # a part core still runs a thread part of the time
        (2, 8, 4.0, 2),
        (4, 2, None, 1),  # never below one
        (1, 3, 16.0, 3),  # a quota above the mask changes nothing
    ],
)
def test_usable_cores_shared_among_ranks(ranks: int, cores: int, quota: float | None, expected: int) -> None:
    threads = decide_threads(None, ranks, usable_cores(cores, quota), {})
    assert threads.per_rank == expected
    assert f"shared by {ranks} rank(s)" in threads.reason


def test_the_cpu_platform_reports_its_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from fd_plugins.cpu.platform import fd_platform_detect

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    detection = fd_platform_detect()
    assert detection.host_cores == usable_cores(len(__import__("os").sched_getaffinity(0)), cgroup_cpu_limit())
    assert detection.problem() is None
    assert detection.threads_env == "OMP_NUM_THREADS"  # the user's setting names the variable
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert fd_platform_detect().threads_env is None


def test_threads_option_then_the_platforms_variable() -> None:
    env = {"OMP_NUM_THREADS": "1"}
    assert decide_threads(3, 2, 2, env, "OMP_NUM_THREADS").per_rank == 3  # --threads wins
    user = decide_threads(None, 1, 2, env, "OMP_NUM_THREADS")
    assert (user.per_rank, user.reason, user.chosen) == (1, "OMP_NUM_THREADS", True)
    # A variable the platform does not name is not read.
    assert decide_threads(None, 1, 2, {"OMP_NUM_THREADS": "4"}).per_rank == 2
    assert decide_threads(None, 1, 2, {"OMP_NUM_THREADS": " "}, "OMP_NUM_THREADS").per_rank == 2


def test_the_cpu_platform_names_only_the_users_setting() -> None:
    from fd_plugins.cpu.threads import openmp_loops, users_threads_env

    assert users_threads_env({"OMP_NUM_THREADS": "4"}, paddle_imported=True) == "OMP_NUM_THREADS"
    assert users_threads_env({"OMP_NUM_THREADS": "1"}, paddle_imported=False) == "OMP_NUM_THREADS"
    # Paddle's import writes OMP_NUM_THREADS=1 when it is unset: after it, "1" is not the user's choice.
    assert users_threads_env({"OMP_NUM_THREADS": "1"}, paddle_imported=True) is None
    assert users_threads_env({}, paddle_imported=False) is None
    # The user's setting holds for Paddle's own OpenMP loops too; otherwise they run one thread.
    assert (openmp_loops({"OMP_NUM_THREADS": "4"}), openmp_loops({})) == (4, 1)


@pytest.mark.parametrize("raw", ["two", "0", "-3"])
def test_bad_env_is_one_line(raw: str) -> None:
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS"):
        decide_threads(None, 1, 2, {"OMP_NUM_THREADS": raw}, "OMP_NUM_THREADS")


def test_plan_carries_the_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    plan = plan_run(RunConfig(model="ernie4_5", tp=2))
    assert plan.threads is not None and (plan.threads.per_rank, plan.threads.reason) == (3, "OMP_NUM_THREADS")
    assert plan_run(RunConfig(model="ernie4_5", tp=2, threads=5)).threads.per_rank == 5  # type: ignore[union-attr]


def test_fd_run_and_explain_report_threads_per_rank() -> None:
    env_free = {k: v for k, v in __import__("os").environ.items() if k != "OMP_NUM_THREADS"}
    run = subprocess.run([sys.executable, "-m", "fd_core.cli", "run", "--tp", "1", "--steps", "2",
                          "--threads", "1", "--json"],
                         capture_output=True, text=True, env=env_free, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(run.stdout)
    assert doc["threads"] == {"per_rank": 1, "reason": "--threads", "chosen": True}
    # The decode step's parts (fd -v prints them): choosing the token and the rest add up to the step.
    step = doc["decode_step_ms"]
    assert (0 < step["choose"] < step["step"]
            and abs(step["choose"] + step["model_and_loop"] - step["step"]) < 0.01), step
    explain = subprocess.run([sys.executable, "-m", "fd_core.cli", "explain", "--tp", "2"], capture_output=True,
                             text=True, env=env_free, timeout=300)
    assert explain.returncode == 0, explain.stderr[-2000:]
    text = " ".join(explain.stdout.split())  # the report wraps at 100 columns
    assert "threads: 1 per rank" in text and "shared by 2 rank(s)" in text, text


def test_openmp_limit_reaches_the_loaded_runtime() -> None:
    """set_openmp_threads changes the OpenMP runtime paddle loaded (and loads none of its own)."""
    code = (
        "import ctypes, os, paddle\n"
        "from fd_plugins.cpu.threads import OPENMP_LIBRARIES, set_openmp_threads\n"
        "def loaded():\n"
        "    for n in OPENMP_LIBRARIES:\n"
        "        try:\n"
        "            return ctypes.CDLL(n, mode=os.RTLD_NOLOAD)\n"
        "        except OSError:\n"
        "            pass\n"
        "omp = loaded()\n"
        "assert omp is not None, 'paddle loaded no OpenMP runtime'\n"
        "assert set_openmp_threads(3) and omp.omp_get_max_threads() == 3\n"
        "assert set_openmp_threads(1) and omp.omp_get_max_threads() == 1\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_a_one_row_decode_step_runs_on_one_thread_unless_the_user_chose_the_count() -> None:
    """The cpu platform's MKL count drops to 1 for a one-row decode step (MKL does not thread it); a count the user
    chose is kept in every phase."""
    from fd_plugins.cpu.threads import phase_threads

    default = RankContext(threads=2)
    assert [phase_threads(default, rows) for rows in (1, 2, None)] == [1, 2, 2]
    chosen = RankContext(threads=2, threads_chosen=True)
    assert [phase_threads(chosen, rows) for rows in (1, 2, None)] == [2, 2, 2]


def test_fd_core_names_no_thread_library() -> None:
    """The thread policy is the cpu platform's: fd_core's code names no OpenMP, MKL or Intel OpenMP setting."""
    import pathlib
    import re

    import fd_core

    root = pathlib.Path(fd_core.__file__).parent
    named = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"OpenMP|\bMKL\b|KMP_|OMP_NUM_THREADS|libiomp|libgomp", line)]
    assert not named, f"fd_core names a thread library: {named}"
