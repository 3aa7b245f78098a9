"""A wrapper on every hook a plugin may wrap: `fd run` (two ranks, a reload cycle) and `fd explain` work,
and each wrapper really runs (pluggy calls every hook; nothing re-implements its call loop)."""

from __future__ import annotations

import json
from pathlib import Path

from fakedist import run_fd

WRAPPERS = '''
import json
import os

from fd_core import hookimpl


def _seen(hook):
    directory = os.environ.get("FDTEST_WRAPPED_DIR")
    if directory:
        with open(os.path.join(directory, f"{hook}.{os.getpid()}"), "a") as f:
            f.write("1")


@hookimpl(wrapper=True)
def fd_all_reduce(tensor, group):
    _seen("fd_all_reduce")
    return (yield)


@hookimpl(wrapper=True)
def fd_clean_memory_fragments(state_dict):
    _seen("fd_clean_memory_fragments")
    return (yield)


@hookimpl(wrapper=True)
def fd_graph_eligibility(model_config, parallel_config, graph_mode):
    _seen("fd_graph_eligibility")
    return (yield)


@hookimpl(wrapper=True)
def fd_graph_backend(parallel_config):
    _seen("fd_graph_backend")
    return (yield)


@hookimpl(wrapper=True)
def fd_clear_graphs(model):
    _seen("fd_clear_graphs")
    return (yield)


@hookimpl(wrapper=True)
def fd_register_models(register):
    _seen("fd_register_models")
    return (yield)


@hookimpl(wrapper=True)
def fd_register_commands(register):
    _seen("fd_register_commands")
    return (yield)
'''

WRAPPABLE = ("fd_all_reduce", "fd_clean_memory_fragments", "fd_graph_eligibility", "fd_graph_backend",
             "fd_clear_graphs", "fd_register_models", "fd_register_commands")


def test_a_wrapper_on_every_hook_runs_and_changes_nothing(install_plugin, tmp_path: Path) -> None:
    root = install_plugin("wrap-all", {"wrap_all": WRAPPERS}, {"fd.plugins": {"wrapall": "wrap_all"}})
    seen = tmp_path / "seen"
    seen.mkdir()
    env = {"FDTEST_WRAPPED_DIR": str(seen)}
    explain = run_fd(["explain", "--tp", "2"], path=root, env=env)
    assert explain.returncode == 0, explain.stderr
    assert "all-reduce: hook call (wrapped by wrapall)" in explain.stdout
    plain = run_fd(["run", "--tp", "2", "--steps", "4", "--json"], timeout=300)
    wrapped = run_fd(["run", "--tp", "2", "--steps", "4", "--reload-cycles", "1", "--json"], path=root, env=env,
                     timeout=300)
    assert wrapped.returncode == 0, wrapped.stderr
    assert json.loads(wrapped.stdout)["tokens"] == json.loads(plain.stdout)["tokens"]
    called = {p.name.split(".")[0] for p in seen.iterdir()}
    assert called == set(WRAPPABLE), f"wrappers that never ran: {set(WRAPPABLE) - called}"
