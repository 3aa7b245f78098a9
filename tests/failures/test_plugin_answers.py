"""What `fd` does with plugins' answers: a platform detection that calls sys.exit, hangs, or names a
dist_backend Paddle does not know (or one that is not a name), and a command a plugin registers, in `fd help`.
Each case runs the real `fd` in a subprocess with a throwaway plugin distribution on PYTHONPATH.
"""

from __future__ import annotations

from conftest import assert_one_line_error, left_over, run_fd

BAD_PLATFORM = """
import sys

from fd_core import Detection, hookimpl


@hookimpl
def fd_platform_detect():
    if "{how}" == "exit":
        sys.exit(3)
    return Detection(detected=True, priority=9, reason="a bad answer", device="cpu", dist_backend={backend!r}, max_ranks=2)
"""


def test_a_detection_calling_sys_exit_is_the_plugins_failure(distribution) -> None:
    path = distribution("fd-exits", {"fd_exits": BAD_PLATFORM.format(how="exit", backend="gloo")},
                        {"fd.platforms": {"exits": "fd_exits"}})
    run = run_fd(["explain"], path)
    assert run.returncode == 0, run.stderr  # the cpu platform is chosen; the plugin is reported, not obeyed
    assert "fd: warning: platform 'exits': fd_platform_detect raised SystemExit: 3" in run.stderr
    assert "platform: cpu" in run.stdout
    listing = run_fd(["plugins"], path)
    assert "not active: fd_platform_detect raised SystemExit: 3" in listing.stdout


def test_a_dist_backend_paddle_does_not_know_names_the_plugin_and_the_hook(distribution) -> None:
    """Asked of paddle.distributed before spawning (fd_core cannot list backends: their names are platforms')."""
    path = distribution("fd-badback", {"fd_badback": BAD_PLATFORM.format(how="", backend="carrier-pigeon")},
                        {"fd.platforms": {"badback": "fd_badback"}})
    run = run_fd(["run", "--tp", "2", "--steps", "2"], path)
    assert_one_line_error(run, "platform 'badback': fd_platform_detect returned a Detection with dist_backend='carrier-pigeon': "
                               "backend argument can only be one of", exact=False)
    assert run.error_lines[0].endswith("; fix the platform plugin")
    assert left_over(run.marker) == []


def test_a_dist_backend_that_is_not_a_name_is_a_detection_problem_said_aloud(distribution) -> None:
    path = distribution("fd-badback", {"fd_badback": BAD_PLATFORM.format(how="", backend=7)},
                        {"fd.platforms": {"badback": "fd_badback"}})
    run = run_fd(["explain"], path)
    assert run.returncode == 0, run.stderr
    assert ("fd: warning: platform 'badback': fd_platform_detect returned a Detection with dist_backend=7, "
            "expected a paddle.distributed backend name (a string); fix the plugin") in run.stderr.splitlines()
    assert "platform: cpu" in run.stdout


HANGS = """
import threading

from fd_core import hookimpl


@hookimpl
def fd_platform_detect():
    threading.Event().wait()
"""


def test_a_hanging_detection_costs_its_limit_once_not_again_in_every_rank(distribution) -> None:
    """Selection is decided in the planning process; a rank asks only the planned platform again."""
    path = distribution("fd-hangs", {"fd_hangs": HANGS}, {"fd.platforms": {"hangs": "fd_hangs"}})
    run = run_fd(["run", "--tp", "2", "--steps", "2"], path, env={"FD_HOOK_TIMEOUT": "3"})
    assert run.returncode == 0, run.stderr
    warned = [line for line in run.stderr.splitlines() if line.startswith("fd: warning: platform 'hangs': fd_platform_detect did not return within 3 s")]
    assert len(warned) == 1, run.stderr
    assert left_over(run.marker) == []


def test_fd_help_knows_plugin_commands() -> None:
    helped, direct = run_fd(["help", "bench"]), run_fd(["bench", "--help"])
    assert helped.returncode == direct.returncode == 0, helped.stderr
    assert helped.stdout == direct.stdout and helped.stdout.startswith("usage: fd bench")
