"""Helpers for the failure-mode tests: `fd` in a subprocess, tagged so that its processes can be found.

Every `fd` started here carries FDTEST_MARKER=<unique id> in its environment; spawned ranks inherit
it, so "no process is left" is checked by scanning /proc/*/environ for the marker (no psutil), which
also finds ranks orphaned by a dead parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pytest

import leftovers
from fakedist import make_distribution

HERE = Path(__file__).parent
MARKER = "FDTEST_MARKER"
# Runs `fd` as the console script does, then reports whether paddle was ever imported: a run that
# never imported paddle cannot have spawned a rank (spawning goes through paddle.distributed).
_TRACED = (
    "import sys\n"
    "from fd_core.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "except SystemExit as exc:\n"
    "    code = exc.code\n"
    "print('\\nFDTEST paddle imported:', 'paddle' in sys.modules)\n"
    "sys.exit(code)\n"
)


@dataclass
class FdRun:
    """A finished `fd` command."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    marker: str
    paddle_imported: bool | None = None

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("fd: error:")]


def fd_env(marker: str, path: Path | None = None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The user's environment without FD_* settings, tagged with `marker`, `path` first on PYTHONPATH."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("FD_", "FDTEST_"))}
    if path is not None:
        full["PYTHONPATH"] = os.pathsep.join(p for p in [str(path), full.get("PYTHONPATH", "")] if p)
    full[MARKER] = marker
    full.update(env or {})
    return full


def new_marker() -> str:
    return f"fdtest-{uuid.uuid4().hex}"


def start_fd(
    args: Sequence[str], path: Path | None = None, env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """Start `fd args` in its own process group (as a shell job), SIGINT at its default, as in a terminal."""
    marker = new_marker()

    def default_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a harness may have started us with SIGINT ignored

    proc = subprocess.Popen(
        [sys.executable, "-m", "fd_core.cli", *args],
        env=fd_env(marker, path, env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    return proc, marker


def run_fd(
    args: Sequence[str], path: Path | None = None, env: Mapping[str, str] | None = None, timeout: float = 120,
    traced: bool = False
) -> FdRun:
    """Run `fd args` to completion; with `traced`, also learn whether it imported paddle."""
    marker = new_marker()
    command = [sys.executable, "-c", _TRACED, *args] if traced else [sys.executable, "-m", "fd_core.cli", *args]
    start = time.monotonic()
    done = subprocess.run(command, env=fd_env(marker, path, env), capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - start
    stdout, imported = done.stdout, None
    if traced:
        stdout, _, flag = stdout.rpartition("\nFDTEST paddle imported: ")
        imported = flag.strip() == "True"
    return FdRun(list(args), done.returncode, stdout, done.stderr, seconds, marker, imported)


def play_concurrently(names: Sequence[str], play: Callable[[str], object]) -> dict[str, object]:
    """`play(name)` for every name at once, one thread each (the scenarios wait on ranks, not on the CPU); each
    name's result, or the exception it raised (reported by the test that reads that scenario)."""
    results: dict[str, object] = {}

    def one(name: str) -> None:
        try:
            results[name] = play(name)
        except BaseException as exc:  # noqa: BLE001 - handed to the test that reads this scenario
            results[name] = exc

    threads = [threading.Thread(target=one, args=(name,)) for name in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def processes_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment carries `marker`."""
    return leftovers.processes_with(MARKER, marker)


def left_over(marker: str, wait: float = 3.0) -> list[int]:
    """Processes of a finished run still alive after `wait` seconds; they are killed, then returned."""
    return leftovers.left_over(MARKER, marker, wait)


def assert_one_line_error(run: FdRun, expected: str, *, exact: bool = True) -> None:
    """Exit code 2, no traceback, and stderr's last line is the one `fd: error:` line."""
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    assert len(run.error_lines) == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line == run.error_lines[0], run.stderr
    if exact:
        assert line == f"fd: error: {expected}", run.stderr
    else:
        assert expected in line, run.stderr


@pytest.fixture(scope="session")
def probe_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A distribution holding the test-only `failprobe` extension plugin (see failprobe_plugin.py)."""
    source = (HERE / "failprobe_plugin.py").read_text()
    root = tmp_path_factory.mktemp("failprobe")
    return make_distribution(root, "fd-failprobe", {"fd_failprobe": source},
                             {"fd.plugins": {"failprobe": "fd_failprobe"}})


@pytest.fixture
def distribution(tmp_path: Path):
    """Write a throwaway plugin distribution for `fd` in a subprocess; returns the directory to put on
    PYTHONPATH (one per test, shared by every distribution the test writes):
    distribution(name, {module: source}, {group: {entry point: module}})."""

    def make(name: str, modules: Mapping[str, str], entry_points: Mapping[str, Mapping[str, str]]) -> Path:
        return make_distribution(tmp_path / "site", name, modules, entry_points)

    return make
