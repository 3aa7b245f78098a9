"""fd_register_commands: plugins add `fd` subcommands; `fd bench` is one; clashes blame the newcomer."""

from __future__ import annotations

import pytest

from fakedist import run_fd
from fd_core.cli import CORE_COMMANDS
from fd_core.errors import PluginError
from fd_core.host.loading import load_plugins

HELLO = """
from fd_core import hookimpl

def hello(args):
    print("hello", *args)
    return 7

@hookimpl
def fd_register_commands(register):
    register("hello", "say hello", hello)
"""

CLASH = """
from fd_core import hookimpl

@hookimpl
def fd_register_commands(register):
    register("run", "run something else", lambda args: 0)
"""


def test_bench_is_a_plugin_command_and_the_core_imports_no_benchmark_code() -> None:
    import subprocess
    import sys

    plugins = load_plugins({})
    summary, _, owner = plugins.commands["bench"]
    assert owner == "bench" and "benchmarks" in summary
    code = "import sys, fd_core.cli, fd_core.runtime.plan, fd_core.host.backend\nassert not any(m.startswith('fd_bench') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_plugin_command_runs_with_its_arguments_and_exit_code(install_plugin) -> None:
    root = install_plugin("hello-cmd", {"hello_cmd": HELLO}, {"fd.plugins": {"hello": "hello_cmd"}})
    done = run_fd(["hello", "--loud", "world"], path=root)
    assert done.returncode == 7 and done.stdout.strip() == "hello --loud world"
    listing = run_fd(["--help"], path=root)
    assert "say hello [from plugin hello]" in listing.stdout


def test_a_command_taking_a_name_fd_has_blames_the_plugin(install_plugin) -> None:
    install_plugin("clash-cmd", {"clash_cmd": CLASH}, {"fd.plugins": {"clashcmd": "clash_cmd"}})
    with pytest.raises(PluginError, match=r"^plugin 'clashcmd' adds command 'run', which 'fd itself' already provides; rename it in 'clashcmd'$"):
        load_plugins({}, reserved_commands=CORE_COMMANDS)
