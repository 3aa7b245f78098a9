"""Dying ranks, Ctrl-C and SIGTERM during `fd run --tp 2`, and where the ranks rendezvous.

Failures are injected by the test-only `failprobe` extension plugin (failprobe_plugin.py): a hook
wrapper around fd_all_reduce that raises, or SIGKILLs its own process, on a chosen rank after a
chosen number of calls, and records each rank's rendezvous environment and listening sockets.
Runs use `--graph off` so that every decode step calls the wrapper (a captured graph replays
without calling Python), and 2000 steps, so that a rank still running at the end would have been
left running by fd rather than have finished.

Each scenario is a separate `fd run`; they run at the same time (module fixture) to keep the suite
short, and each test asserts one scenario's outcome.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import FdRun, fd_env, left_over, new_marker, play_concurrently

# 6 all-reduce calls per forward pass of the tiny ERNIE at tp=2 (embedding, 2 per layer, LM head):
# call 31 is in the 5th decode step, call 60 in the 9th.
FAIL_AFTER = 30
PROBE_AT = 60
BOUND_S = 5.0  # from a rank's failure (or the signal) to `fd run` having exited, ranks included
RUN = ["run", "--tp", "2", "--steps", "2000", "--graph", "off", "--rank-timeout", "3"]


@dataclass
class Outcome:
    run: FdRun
    probe_dir: Path
    signalled_at: float | None = None  # time.time() when the signal was sent
    ended_at: float = 0.0  # time.time() when `fd run` had exited
    survivors: list[int] = field(default_factory=list)

    def rank_record(self, rank: int) -> dict:
        return json.loads((self.probe_dir / f"rank{rank}.json").read_text())

    def failed_at(self, rank: int) -> float:
        return float((self.probe_dir / f"rank{rank}.failing").read_text())


def _play(name: str, probe_root: Path, work: Path, env: dict[str, str], send: tuple[str, int] | None) -> Outcome:
    """Run one scenario: start `fd run`, optionally signal it once both ranks are decoding, wait, collect."""
    probe_dir = work / name
    probe_dir.mkdir()
    marker = new_marker()
    out, err = open(work / f"{name}.out", "w+"), open(work / f"{name}.err", "w+")
    full_env = fd_env(marker, probe_root, {"FDTEST_PROBE_DIR": str(probe_dir), "FDTEST_PROBE_AT": str(PROBE_AT), **env})
    begin = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fd_core.cli", *RUN], env=full_env, stdout=out, stderr=err, text=True,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    signalled_at = None
    try:
        if send is not None:
            target, sig = send
            deadline = time.monotonic() + 90
            while not all((probe_dir / f"rank{r}.json").exists() for r in (0, 1)):
                assert proc.poll() is None and time.monotonic() < deadline, f"{name}: the ranks never reached decoding"
                time.sleep(0.05)
            signalled_at = time.time()
            if target == "group":  # what a terminal does on Ctrl-C: the whole foreground job
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended_at = time.time()
    out.seek(0)
    err.seek(0)
    run = FdRun(RUN, proc.returncode, out.read(), err.read(), time.monotonic() - begin, marker)
    return Outcome(run, probe_dir, signalled_at, ended_at, left_over(marker))


SCENARIOS = {
    "rank1-raises": ({"FDTEST_FAIL_RANK": "1", "FDTEST_FAIL_AFTER": str(FAIL_AFTER), "FDTEST_FAIL_HOW": "raise"}, None),
    "rank0-sigkill": ({"FDTEST_FAIL_RANK": "0", "FDTEST_FAIL_AFTER": str(FAIL_AFTER), "FDTEST_FAIL_HOW": "kill"}, None),
    "ctrl-c": ({}, ("group", signal.SIGINT)),
    "sigterm": ({}, ("parent", signal.SIGTERM)),
    "parent-sigkill": ({}, ("parent", signal.SIGKILL)),
}


@pytest.fixture(scope="module")
def outcomes(probe_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    work = tmp_path_factory.mktemp("ranks")
    return play_concurrently(list(SCENARIOS), lambda name: _play(name, probe_root, work, *SCENARIOS[name]))  # type: ignore[return-value]


def outcome(outcomes: dict, name: str) -> Outcome:
    result = outcomes[name]
    if isinstance(result, BaseException):
        raise result
    return result


def assert_quiet_stop(o: Outcome) -> None:
    """No rank left, and no crash report from a rank that fd stopped on purpose."""
    assert o.survivors == [], f"processes left running: {o.survivors}"
    for noise in ("Traceback", "FatalError", "C++ Traceback", "Termination signal"):
        assert noise not in o.run.stderr, o.run.stderr


@pytest.mark.parametrize(
    ("name", "rank", "message"),
    [
        ("rank1-raises", 1, f"RuntimeError: failprobe: injected failure on rank 1 at all-reduce call {FAIL_AFTER + 1}"),
        ("rank0-sigkill", 0, "killed by SIGKILL"),
    ],
)
def test_a_failing_rank_ends_the_run_within_seconds_naming_it(
    outcomes: dict, name: str, rank: int, message: str,
) -> None:
    o = outcome(outcomes, name)
    assert o.run.returncode == 2, o.run.stderr
    assert len(o.run.error_lines) == 1 and o.run.stderr.strip().splitlines()[-1] == o.run.error_lines[0], o.run.stderr
    line = o.run.error_lines[0]
    # The culprit first; the peer it took down (its collective failed) may follow in parentheses.
    assert line.startswith(f"fd: error: rank {rank} failed: {message}"), line
    rest = line.removeprefix(f"fd: error: rank {rank} failed: {message}")
    # An unexpected error (not a signal) names the file its whole traceback was kept in.
    rest, _, trace = rest.partition("; its traceback is in ")
    assert rest == "" or rest.startswith(f" (then rank {1 - rank}: "), line
    assert bool(trace) is ("RuntimeError" in message), line
    if trace:
        assert "failprobe: injected failure" in Path(trace).read_text()
    assert o.ended_at - o.failed_at(rank) < BOUND_S, f"took {o.ended_at - o.failed_at(rank):.1f}s after the failure"
    assert_quiet_stop(o)


def test_ctrl_c_stops_every_rank_with_exit_code_130(outcomes: dict) -> None:
    o = outcome(outcomes, "ctrl-c")
    assert o.run.returncode == 130, o.run.stderr
    assert o.run.stderr.strip().splitlines()[-1] == "fd: interrupted"
    assert o.run.stdout == ""  # no summary of a run that did not finish
    assert o.ended_at - o.signalled_at < BOUND_S
    assert_quiet_stop(o)


def test_sigterm_stops_every_rank_with_exit_code_143(outcomes: dict) -> None:
    """Not in the issue's table: a process manager's stop must not orphan the ranks either."""
    o = outcome(outcomes, "sigterm")
    assert o.run.returncode == 143, o.run.stderr
    assert o.run.stderr.strip().splitlines()[-1] == "fd: terminated; every rank was stopped"
    assert o.ended_at - o.signalled_at < BOUND_S
    assert_quiet_stop(o)


def test_ranks_die_with_fd_run_when_it_is_killed_outright(outcomes: dict) -> None:
    """SIGKILL cannot be handled: the ranks ask the kernel to kill them when their parent dies."""
    o = outcome(outcomes, "parent-sigkill")
    assert o.run.returncode == -signal.SIGKILL
    assert o.survivors == [], f"ranks orphaned by a killed fd run: {o.survivors}"


def test_rank_endpoints_are_loopback(outcomes: dict) -> None:
    o = outcome(outcomes, "ctrl-c")
    for rank in (0, 1):
        env = o.rank_record(rank)["env"]
        endpoints = env["PADDLE_TRAINER_ENDPOINTS"].split(",")
        assert len(endpoints) == 2 and all(e.startswith("127.0.0.1:") for e in endpoints), env
        assert env["PADDLE_CURRENT_ENDPOINT"] == endpoints[rank], env
        assert env["PADDLE_MASTER"] is None or env["PADDLE_MASTER"].startswith("127.0.0.1:"), env


def test_ranks_listen_only_on_loopback(outcomes: dict) -> None:
    """Paddle's own store (rank 0 serving it) would listen on every interface;
    fd serves it on 127.0.0.1 from the parent."""
    o = outcome(outcomes, "ctrl-c")
    listening = {rank: o.rank_record(rank)["listening"] for rank in (0, 1)}
    assert all(a.startswith("127.") for addresses in listening.values() for a in addresses), listening


def test_the_rank_named_is_the_one_that_failed_first_not_a_bystander() -> None:
    """The race behind the scenarios above, made deterministic: a dead rank makes its peers fail in
    their next collective within milliseconds, and the parent may see those failures first."""
    from fd_core.runtime.ranks.spawn import RankFailure, _describe

    peer = "RuntimeError: [pair.cc:584] TIMEOUT self_rank = 0 pair_rank = 1"
    killed = RankFailure(1, "killed by SIGKILL", (0, 0.0))
    assert _describe([RankFailure(0, peer, (1, 100.0)), killed]) == f"rank 1 failed: killed by SIGKILL (then rank 0: {peer})"
    raised = RankFailure(1, "RuntimeError: injected", (1, 99.5))
    assert _describe([RankFailure(0, peer, (1, 100.0)), raised]) == f"rank 1 failed: RuntimeError: injected (then rank 0: {peer})"
    same = "CheckpointError: checkpoint x: tensor 'w' is missing"
    assert _describe([RankFailure(1, same, (1, 5.0)), RankFailure(0, same, (1, 4.0))]) == f"rank 0 failed: {same} (rank 1 failed the same way)"
