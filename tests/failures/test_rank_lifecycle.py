"""A rank's lifecycle hooks (fd_rank_start, fd_before_step, fd_rank_end) as `fd run` calls them, read from what an
installed extension recorded in each rank: once at the start before any step, before every prefill and decode step,
once at the end with how it ended (normal, error, a signal), bounded in time."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import assert_one_line_error, left_over, run_fd, start_fd

# Each hook appends one JSON line to $FDTEST_LIFECYCLE_LOG; FDTEST_LIFECYCLE_FAIL=start makes fd_rank_start raise,
# FDTEST_LIFECYCLE_FAIL=end-hangs makes fd_rank_end sleep past fd's limit.
LIFECYCLE = """
import json
import os
import threading
import time

from fd_core import hookimpl

FD_CONTRACT = "1.2"


def _note(hook, rank, **more):
    line = {"hook": hook, "pid": os.getpid(), "thread": threading.get_ident(), "rank": rank.rank,
            "local_rank": rank.local_rank, "world_size": rank.world_size, "threads": rank.threads,
            "model": rank.model, **more}
    with open(os.environ["FDTEST_LIFECYCLE_LOG"], "a") as f:
        f.write(json.dumps(line) + "\\n")


@hookimpl
def fd_rank_start(rank):
    _note("start", rank)
    if os.environ.get("FDTEST_LIFECYCLE_FAIL") == "start":
        raise RuntimeError("the vendor runtime did not start")


@hookimpl
def fd_before_step(rank, rows):
    _note("step", rank, rows=rows)


@hookimpl
def fd_rank_end(rank, reason):
    _note("end", rank, reason=reason)
    if os.environ.get("FDTEST_LIFECYCLE_FAIL") == "end-hangs":
        time.sleep(60)
"""


@pytest.fixture
def lifecycle(distribution: Any) -> Path:
    return distribution("fd-lifecycle", {"fdtest_lifecycle": LIFECYCLE}, {"fd.plugins": {"lifecycle": "fdtest_lifecycle"}})


def _log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("tp", [1, 2])
def test_each_rank_starts_once_steps_and_ends_normally(lifecycle: Path, tmp_path: Path, tp: int) -> None:
    log = tmp_path / "lifecycle.jsonl"
    run = run_fd(["run", "--tp", str(tp), "--steps", "3"], lifecycle, {"FDTEST_LIFECYCLE_LOG": str(log)}, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = _log(log)
    for rank in range(tp):
        mine = [line for line in lines if line["rank"] == rank]
        hooks = [line["hook"] for line in mine]
        # Started once before any step, ended once after the last, normally.
        assert hooks[0] == "start" and hooks[-1] == "end" and hooks.count("start") == hooks.count("end") == 1, hooks
        assert mine[-1]["reason"] == "normal"
        steps = [line["rows"] for line in mine if line["hook"] == "step"]
        assert steps[0] is None and steps[1:] == [1, 1], steps  # the prefill, then the decode steps of one row
        assert (mine[0]["local_rank"], mine[0]["world_size"], mine[0]["model"]) == (rank, tp, "ernie4_5")
        assert len({line["pid"] for line in mine}) == 1  # the rank's own process (the caller's at tp=1)
    assert len({line["pid"] for line in lines}) == tp


def test_a_failing_start_stops_the_run_in_one_line_and_ends_the_rank(lifecycle: Path, tmp_path: Path) -> None:
    log = tmp_path / "lifecycle.jsonl"
    run = run_fd(["run", "--tp", "1", "--steps", "3"], lifecycle,
                 {"FDTEST_LIFECYCLE_LOG": str(log), "FDTEST_LIFECYCLE_FAIL": "start"}, timeout=300)
    assert_one_line_error(run, "plugin 'lifecycle': fd_rank_start raised RuntimeError: the vendor runtime did not "
                               "start on rank 0; fix or uninstall the plugin")
    assert [(line["hook"], line.get("reason")) for line in _log(log)] == [("start", None), ("end", "error")]


def test_a_stopped_run_ends_every_rank_with_signal(lifecycle: Path, tmp_path: Path) -> None:
    """SIGTERM to `fd run` while its two ranks decode: each rank calls fd_rank_end with "signal" before it exits."""
    log = tmp_path / "lifecycle.jsonl"
    proc, marker = start_fd(["run", "--tp", "2", "--steps", "4000"], lifecycle, {"FDTEST_LIFECYCLE_LOG": str(log)})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and sum(line.get("rows") == 1 for line in _log(log)) < 4:
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr
    ends = sorted((line["rank"], line["reason"]) for line in _log(log) if line["hook"] == "end")
    assert ends == [(0, "signal"), (1, "signal")], (ends, stderr)
    assert not left_over(marker)


def test_an_end_hook_that_hangs_is_left_behind_in_bounded_time(lifecycle: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """fd waits RANK_END_TIMEOUT_S for fd_rank_end, then warns in one line naming the plugin and goes on."""
    import sys

    from fd_core.host.backend import Backend
    from fd_core.host.loading import load_plugins
    from fd_core.lifecycle import RankContext

    monkeypatch.syspath_prepend(str(lifecycle))
    monkeypatch.setenv("FDTEST_LIFECYCLE_LOG", str(tmp_path / "lifecycle.jsonl"))
    monkeypatch.setenv("FDTEST_LIFECYCLE_FAIL", "end-hangs")
    try:
        backend = Backend(load_plugins({"FD_PLATFORM": "cpu"}))
        backend.rank_start(RankContext())
        start = time.monotonic()
        problems = backend.rank_end(RankContext(), "normal", timeout=0.5)
        assert time.monotonic() - start < 5
        assert problems == ["plugin 'lifecycle': fd_rank_end did not return within 0.5 s, and the rank ended without "
                            "it; fix the plugin"]
        # Only what started is ended, once: a second end (or one without a start) calls nothing.
        assert backend.rank_end(RankContext(), "normal", timeout=0.5) == []
    finally:
        sys.modules.pop("fdtest_lifecycle", None)
