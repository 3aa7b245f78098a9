"""Failure modes, round 3: processes, plugins, signals and the network (issue 23).

A plugin that prints, SIGHUP and the temporary directories of a run, nothing listening beyond
loopback, bad values in options and the environment, detections that misbehave, and where a run's
clock starts. Each case runs the real `fd` in a subprocess and checks its exit code and its one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_one_line_error, fd_env, left_over, new_marker, run_fd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
import kit  # noqa: E402

PRINTER = """
import os
import sys

from fd_core import hookimpl

print("PRINTER-IMPORT")


@hookimpl
def fd_graph_eligibility(model_config, parallel_config):
    print("PRINTER-VOTE")
    return None


@hookimpl
def fd_clean_memory_fragments(state_dict):
    print("PRINTER-CLEAN", flush=True)
    sys.stdout.write("PRINTER-WRITE\\n")


@hookimpl
def fd_check_request(request, model_config, parallel_config, stream):
    print("PRINTER-GATE")
    return None
"""


@pytest.fixture(scope="module")
def printer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A distribution holding an extension plugin that prints at import and from hooks run in the parent and in the ranks."""
    from fakedist import make_distribution

    root = tmp_path_factory.mktemp("printer")
    return make_distribution(root, "fd-printer", {"fd_printer": PRINTER}, {"fd.plugins": {"printer": "fd_printer"}})


def _printed(stream: str) -> list[str]:
    return sorted({line for line in stream.splitlines() if line.startswith("PRINTER-")})


@pytest.mark.parametrize("args", [["explain", "--json"], ["run", "--tp", "1", "--steps", "2", "--json"], ["run", "--tp", "2", "--steps", "2", "--json"]],
                         ids=["explain", "run-tp1", "run-tp2"])
def test_what_a_plugin_prints_never_mixes_with_json(printer: Path, args: list[str]) -> None:
    """Prints at import, from a vote, the request gate and a rank's cleanup land on stderr; stdout is JSON alone."""
    run = run_fd(args, printer, timeout=120)
    assert run.returncode == 0, run.stderr
    json.loads(run.stdout)  # nothing but the JSON
    assert _printed(run.stdout) == []
    expected = {"PRINTER-IMPORT", "PRINTER-VOTE"} | ({"PRINTER-CLEAN", "PRINTER-WRITE", "PRINTER-GATE"} if args[0] == "run" else set())
    assert expected <= set(_printed(run.stderr)), run.stderr


def test_what_a_plugin_prints_never_lands_in_the_text(printer: Path, tmp_path: Path) -> None:
    """`fd run --prompt ... > out.txt` keeps only the generated text."""
    checkpoint = tmp_path / "ckpt"
    saved = run_fd(["save-random", "--model", "ernie4_5", str(checkpoint)])
    assert saved.returncode == 0, saved.stderr
    kit.sentencepiece_tokenizer(checkpoint)
    plain = run_fd(["run", "--tp", "1", "--checkpoint", str(checkpoint), "--prompt", "hello", "--steps", "3"])
    printed = run_fd(["run", "--tp", "1", "--checkpoint", str(checkpoint), "--prompt", "hello", "--steps", "3"], printer)
    assert plain.returncode == printed.returncode == 0, printed.stderr
    assert printed.stdout == plain.stdout, printed.stdout
    assert {"PRINTER-IMPORT", "PRINTER-CLEAN"} <= set(_printed(printed.stderr))
