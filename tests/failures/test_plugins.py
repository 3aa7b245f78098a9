"""Broken plugins and plugin selection, seen from the `fd` command a user runs.

The same cases are covered in-process by tests/core (test_selection.py, test_validation.py,
test_registration.py); these tests add what only the command shows: the exit code, the single
error line, and what `fd plugins` / `fd explain` print. Each `fd` here runs in a subprocess with a
throwaway plugin distribution on PYTHONPATH, as if pip-installed.
"""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from conftest import assert_one_line_error, run_fd
from fakedist import listing
from plugin_sources import MISSPELLED_HOOK, NO_CLEAR_HOOK, NOT_A_GENERATOR, UNKNOWN_ARGUMENT

BROKEN_IMPORT = "raise ImportError('libchip.so: cannot open shared object file')\n"

FLAKY_DETECT = """
from fd_core import hookimpl

@hookimpl
def fd_platform_detect():
    raise OSError('driver version mismatch')
"""

CHIP = """
from fd_core import Detection, hookimpl

@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority={priority}, reason="saw the fake chip")

@hookimpl
def fd_all_reduce(tensor, group):
    return tensor
"""


def test_plugin_that_raises_on_import_is_listed_with_its_error_and_never_selected(distribution) -> None:
    site = distribution("broken-chip", {"broken_chip": BROKEN_IMPORT}, {"fd.platforms": {"broken": "broken_chip"}})
    done = run_fd(["plugins"], path=site)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("platform: cpu ("), done.stdout
    row = listing(done.stdout)["platform plugins"]["broken"]
    assert row == "broken broken-chip 0.1.0 not loaded error: import failed: ImportError: libchip.so: cannot open shared object file"
    # The other plugins work: every built-in model package is active and registers its architecture.
    assert set(listing(done.stdout)["architectures"]) == {"ernie4_5", "ernie4_5_vl", "qwen3_vl"}
    assert "fd: warning: plugin 'broken' (broken_chip) failed to import: ImportError: libchip.so" in done.stderr
    listed = json.loads(run_fd(["plugins", "--json"], path=site).stdout)
    record = next(p for p in listed["plugins"] if p["name"] == "broken")
    assert (record["active"], record["error"]) == (False, "import failed: ImportError: libchip.so: cannot open shared object file")
    assert listed["platform"] == "cpu"
    # Forcing it is the only way to ask for it, and that is an error that says why.
    forced = run_fd(["explain"], path=site, env={"FD_PLATFORM": "broken"})
    assert_one_line_error(
        forced,
        "FD_PLATFORM='broken': that plugin failed to load (import failed: ImportError: libchip.so: cannot open "
        "shared object file); fix or reinstall it",
    )


def test_detection_that_raises_is_reported_and_stated_in_explain(distribution) -> None:
    site = distribution("flaky-chip", {"flaky_chip": FLAKY_DETECT}, {"fd.platforms": {"flaky": "flaky_chip"}})
    done = run_fd(["explain"], path=site)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("platform: cpu (")
    assert "  flaky: not active: fd_platform_detect raised OSError: driver version mismatch" in done.stdout.splitlines()
    assert "fd: warning: platform 'flaky': fd_platform_detect raised OSError: driver version mismatch" in done.stderr


@pytest.mark.parametrize(
    ("source", "group", "message"),
    [
        (MISSPELLED_HOOK, "fd.models", "plugin 'bad': hook 'fd_clear_grpah_opt_backend' matches no hookspec; did you mean 'fd_clear_graphs'?"),
        (
            UNKNOWN_ARGUMENT,
            "fd.plugins",
            "plugin 'bad': hook 'fd_graph_eligibility' takes argument 'paralel_config', which the hookspec "
            "fd_graph_eligibility(model_config, parallel_config, graph_mode) does not provide; did you mean 'parallel_config'?",
        ),
        (
            NOT_A_GENERATOR,
            "fd.plugins",
            "plugin 'bad': hook 'fd_all_reduce': declared as wrapper=True or hookwrapper=True but function is not a "
            "generator function; make it a generator that yields exactly once",
        ),
    ],
    ids=["misspelled-hook", "unknown-argument", "wrapper-not-a-generator"],
)
def test_invalid_hook_fails_at_load_naming_plugin_hook_and_fix(
    distribution, source: str, group: str, message: str,
) -> None:
    site = distribution("bad-plugin", {"bad_plugin": source}, {group: {"bad": "bad_plugin"}})
    for command in (["plugins"], ["run", "--steps", "1"]):
        done = run_fd(command, path=site, traced=True)
        assert_one_line_error(done, message)
        assert done.paddle_imported is False  # `fd run` stopped at load: no rank started


def test_two_platforms_at_equal_priority_is_an_error_naming_both(distribution) -> None:
    distribution("chip-a", {"chip_a": CHIP.format(priority=3)}, {"fd.platforms": {"chipa": "chip_a"}})
    site = distribution("chip-b", {"chip_b": CHIP.format(priority=3)}, {"fd.platforms": {"chipb": "chip_b"}})
    done = run_fd(["run", "--steps", "1"], path=site, traced=True)
    assert_one_line_error(done, "platforms chipa and chipb both detected their hardware at priority 3; set FD_PLATFORM to one of them")
    assert done.paddle_imported is False
    chosen = run_fd(["plugins", "--json"], path=site, env={"FD_PLATFORM": "chipb"})
    assert json.loads(chosen.stdout)["platform"] == "chipb"


def test_fd_platform_naming_nothing_installed_lists_the_installed_platforms(distribution) -> None:
    site = distribution("chip-a", {"chip_a": CHIP.format(priority=3)}, {"fd.platforms": {"chipa": "chip_a"}})
    done = run_fd(["run", "--steps", "1"], path=site, env={"FD_PLATFORM": "tpu9"}, traced=True)
    assert_one_line_error(done, "FD_PLATFORM='tpu9' names no installed platform; installed: ", exact=False)
    installed = done.error_lines[0].split("installed: ")[1].split(", ")
    assert {"chipa", "cpu", "cuda", "iluvatar"} <= set(installed) and installed == sorted(installed)
    assert done.paddle_imported is False


def test_fd_plugins_naming_a_missing_plugin_lists_the_installed_third_party_plugins(distribution) -> None:
    site = distribution("chip-a", {"chip_a": CHIP.format(priority=3)}, {"fd.platforms": {"chipa": "chip_a"}})
    done = run_fd(["plugins"], path=site, env={"FD_PLUGINS": "chip-a,nosuch"})
    assert_one_line_error(done, "FD_PLUGINS names nosuch, which is not installed; installed third-party plugins: ", exact=False)
    assert "chipa" in done.error_lines[0].split("installed third-party plugins: ")[1].split(", ")


def test_forced_platform_whose_hardware_is_absent_fails_before_any_process_starts() -> None:
    # The cuda platform is installed (a built-in) but this machine has no CUDA build of paddle.
    done = run_fd(["run"], env={"FD_PLATFORM": "cuda"}, traced=True)
    assert_one_line_error(
        done,
        f"platform 'cuda' is selected but its hardware is not here (paddle is the CPU build (paddlepaddle {version('paddlepaddle')}): "
        "install paddlepaddle-gpu for your CUDA version, see docs/install.md); unset FD_PLATFORM or run on that hardware",
    )
    assert done.paddle_imported is False  # nothing was spawned: spawning imports paddle.distributed


def test_graph_capable_architecture_without_clear_hook_fails_registration(distribution) -> None:
    """In-process: tests/core/test_registration.py; here the command's view of it."""
    site = distribution("mini-vl", {"mini_vl_pkg": NO_CLEAR_HOOK}, {"fd.models": {"mini_vl": "mini_vl_pkg"}})
    done = run_fd(["run", "--steps", "1"], path=site, traced=True)
    assert_one_line_error(
        done,
        "plugin 'mini_vl' registers graph-capable architecture 'mini_vl' without a graph-clear hook: "
        "implement fd_clear_graphs(model) in 'mini_vl' or register it with graph_capable=False",
    )
    assert done.paddle_imported is False


def test_empty_allow_list_loads_no_third_party_plugin_and_says_so(distribution) -> None:
    site = distribution("fake-chip", {"fake_chip": CHIP.format(priority=5)},
                        {"fd.platforms": {"fakechip": "fake_chip"}})
    assert json.loads(run_fd(["plugins", "--json"], path=site).stdout)["platform"] == "fakechip"  # loaded when allowed
    done = run_fd(["plugins"], path=site, env={"FD_PLUGINS": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("platform: cpu (")
    row = listing(done.stdout)["platform plugins"]["fakechip"]
    assert row == "fakechip fake-chip 0.1.0 left out: not in FD_PLUGINS (add fakechip to it to load this plugin)"
    listed = json.loads(run_fd(["plugins", "--json"], path=site, env={"FD_PLUGINS": ""}).stdout)["plugins"]
    third_party = [p for p in listed if not p["builtin"]]
    assert third_party and all(not p["allowed"] and not p["active"] and p["hooks"] == [] for p in third_party)
    assert all(p["status"] == f"left out: not in FD_PLUGINS (add {p['name']} to it to load this plugin)" for p in third_party)
    # This distribution's built-ins remain.
    builtins = {p["name"] for p in listed if p["builtin"] and p["allowed"]}
    assert {"cpu", "cuda", "iluvatar", "ernie4_5", "ernie4_5_vl", "qwen3_vl"} <= builtins
