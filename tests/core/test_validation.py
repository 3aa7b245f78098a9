"""Loud validation at load: every hook implementation must match a spec, named with the nearest valid name."""

from __future__ import annotations

import pytest

from fakedist import run_fd
from fd_core.errors import PluginError
from fd_core.host.loading import load_plugins
from plugin_sources import MISSPELLED_HOOK as MISSPELLED
from plugin_sources import NOT_A_GENERATOR
from plugin_sources import UNKNOWN_ARGUMENT as BAD_ARGUMENT

UNDECORATED = """
def fd_clean_memory_fragments(state_dict):
    pass
"""


def test_misspelled_hook_names_plugin_hook_and_nearest(install_plugin) -> None:
    install_plugin("typo-models", {"typo_models": MISSPELLED}, {"fd.models": {"typo": "typo_models"}})
    with pytest.raises(PluginError) as err:
        load_plugins({})
    assert str(err.value) == (
        "plugin 'typo': hook 'fd_clear_grpah_opt_backend' matches no hookspec; did you mean 'fd_clear_graphs'?"
    )


def test_unknown_argument_names_the_nearest_argument(install_plugin) -> None:
    install_plugin("bad-arg", {"bad_arg": BAD_ARGUMENT}, {"fd.plugins": {"badarg": "bad_arg"}})
    with pytest.raises(PluginError, match=r"plugin 'badarg': hook 'fd_graph_eligibility' takes argument 'paralel_config'.*did you mean 'parallel_config'\?"):
        load_plugins({})


def test_wrapper_that_is_not_a_generator_fails_at_load(install_plugin) -> None:
    install_plugin("bad-wrapper", {"bad_wrapper": NOT_A_GENERATOR}, {"fd.plugins": {"badwrap": "bad_wrapper"}})
    with pytest.raises(PluginError, match=r"^plugin .badwrap.: hook .fd_all_reduce.: declared as wrapper=True or hookwrapper=True but function is not a generator function; make it a generator that yields exactly once$"):
        load_plugins({})


def test_hook_named_function_without_hookimpl_is_an_error(install_plugin) -> None:
    install_plugin("no-marker", {"no_marker": UNDECORATED}, {"fd.plugins": {"nomarker": "no_marker"}})
    with pytest.raises(PluginError, match=r"plugin 'nomarker': function 'fd_clean_memory_fragments' is named like a hook but lacks @hookimpl"):
        load_plugins({})


def test_cli_lists_a_misspelled_hook_and_ends_with_one_error_line_and_exit_2(install_plugin, tmp_path) -> None:
    root = install_plugin("typo-models", {"typo_models": MISSPELLED}, {"fd.models": {"typo": "typo_models"}})
    error = "plugin 'typo': hook 'fd_clear_grpah_opt_backend' matches no hookspec; did you mean 'fd_clear_graphs'?"
    done = run_fd(["plugins"], path=root)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"fd: error: {error}"
    assert "Traceback" not in done.stderr
    # The listing still shows every plugin, the broken one with its error.
    assert "cpu" in done.stdout and "ernie4_5" in done.stdout
    assert f"failed: {error}" in " ".join(done.stdout.split())  # the listing wraps at 100 columns
    ran = run_fd(["run", "--tp", "1", "--steps", "1"], path=root)
    assert ran.returncode == 2 and ran.stderr.strip().splitlines()[-1] == f"fd: error: {error}"


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("fd_clean_graphs", "fd_clear_graphs"),
        ("fd_clear_grpah_opt_backend", "fd_clear_graphs"),  # FastDeploy's own spelling of the method
        ("fd_clear_graph", "fd_clear_graphs"),
        ("fd_allreduce", "fd_all_reduce"),
        ("fd_all_reduced", "fd_all_reduce"),
        ("fd_graph_eligible", "fd_graph_eligibility"),
        ("fd_graph_eligibilty", "fd_graph_eligibility"),
        ("fd_graphs_backend", "fd_graph_backend"),
        ("fd_register_model", "fd_register_models"),
        ("fd_platform_detection", "fd_platform_detect"),
        ("fd_detect_platform", "fd_platform_detect"),
        ("fd_clean_memory_fragment", "fd_clean_memory_fragments"),
    ],
)
def test_nearest_name_for_realistic_typos(typo: str, meant: str) -> None:
    from fd_core.host.records import HOOK_NAMES
    from fd_core.host.suggest import nearest as _nearest

    assert _nearest(typo, HOOK_NAMES) == f"did you mean {meant!r}?"


def test_nothing_near_lists_the_valid_names() -> None:
    from fd_core.host.records import HOOK_NAMES
    from fd_core.host.suggest import nearest as _nearest

    assert _nearest("fd_teleport", HOOK_NAMES).startswith("valid names: fd_all_reduce, ")
