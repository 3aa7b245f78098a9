"""What is certified is what runs: `fd run`, the conformance suite and the reference tests share one
engine, so an engine whose decode steps are broken fails all three; and a run is planned once (one
plugin discovery and one read of each checkpoint file per process)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Installed at interpreter start (sitecustomize): every decode step's token is off by one, so the
# first token (prefill) stays right and every later one is wrong.
BREAK_THE_ENGINE = '''
from fd_core.runtime.engine.loop import Engine

_real = Engine._push


def _broken(self, seq, token, events):
    return _real(self, seq, token ^ 1 if seq.tokens else token, events)  # every token after a sequence's first


Engine._push = _broken
'''


@pytest.fixture(scope="module")
def broken_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("broken-engine")
    (site / "sitecustomize.py").write_text(BREAK_THE_ENGINE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FD_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))
    return env


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_the_break_changes_what_fd_run_prints(broken_env: dict[str, str]) -> None:
    """The control: the broken engine is the one `fd run` generates through."""
    args = [sys.executable, "-m", "fd_core.cli", "run", "--tp", "1", "--max-new-tokens", "4", "--json"]
    good, bad = _run(args), _run(args, broken_env)
    assert good.returncode == 0 and bad.returncode == 0, good.stderr + bad.stderr
    good_tokens, bad_tokens = json.loads(good.stdout)["tokens"], json.loads(bad.stdout)["tokens"]
    assert good_tokens[0] == bad_tokens[0] and good_tokens[1:] != bad_tokens[1:]


def test_a_broken_engine_fails_the_conformance_suite(broken_env: dict[str, str]) -> None:
    done = _run([sys.executable, "-m", "fd_core.cli", "check", "cpu", "-k", "engine"], broken_env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed   test_the_engine_generates_what_the_model_computes_without_a_cache" in done.stdout, done.stdout
    assert "the decode step, the KV cache or a captured graph is wrong" in done.stdout


def test_a_broken_engine_fails_the_reference_tests(broken_env: dict[str, str]) -> None:
    pytest.importorskip("transformers", reason="the reference comes with the test extra (pip install -e '.[test]')")
    test = "tests/models/test_reference.py::test_tp1_matches_the_reference[ernie]"
    done = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", test], broken_env)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout[-3000:]


COUNT_READS = '''
import collections, importlib.metadata, json, os, sys

opened = collections.Counter()


def note(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        opened[os.path.basename(os.fsdecode(args[0]))] += 1


sys.addaudithook(note)
discoveries = []
_entry_points = importlib.metadata.entry_points


def counting(*args, **kwargs):
    discoveries.append(kwargs.get("group"))
    return _entry_points(*args, **kwargs)


importlib.metadata.entry_points = counting
from fd_core.cli import main

code = main(sys.argv[1:])
print(json.dumps({"code": code, "opened": opened, "discoveries": discoveries.count("fd.platforms")}), file=sys.stderr)
'''


@pytest.fixture(scope="module")
def text_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kit import text_checkpoint

    path = text_checkpoint(tmp_path_factory.mktemp("plan-once"), "qwen3_vl")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "do_sample": False}))
    return path


def test_a_tp1_run_discovers_plugins_once_and_reads_each_checkpoint_file_once(text_checkpoint_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    done = _run([sys.executable, "-c", COUNT_READS, "run", "--tp", "1", "--checkpoint", str(text_checkpoint_dir),
                 "--chat", "--prompt", "Hello there", "--max-new-tokens", "3"], env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report["code"] == 0 and report["discoveries"] == 1, report
    # tokenizer.json itself is opened by the tokenizers library's native code, which the audit hook does not see.
    files = ["config.json", "generation_config.json", "preprocessor_config.json", "tokenizer_config.json"]
    assert all((text_checkpoint_dir / name).is_file() for name in files)
    assert {name: report["opened"].get(name) for name in files} == dict.fromkeys(files, 1), report["opened"]


def test_the_plan_is_plain_data_a_rank_receives(text_checkpoint_dir: Path) -> None:
    from fd_core.runtime.plan import RunConfig, plan_run

    plan = plan_run(
        RunConfig(model="", checkpoint=str(text_checkpoint_dir), prompts=("Hello there",), steps=3, progress=False)
    )
    assert plan.checkpoint is not None and plan.checkpoint.tokenizer() is not None  # loaded here, not carried
    copy = pickle.loads(pickle.dumps(plan))
    assert copy.request == plan.request and copy.config == plan.config and copy.model == plan.model == "qwen3_vl"
    assert copy.checkpoint is not None and copy.checkpoint.config == plan.checkpoint.config
    assert copy.checkpoint.tokenizer().encode("Hello there") == plan.checkpoint.tokenizer().encode("Hello there")


def test_a_rank_that_cannot_select_the_planned_platform_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank asks only the planned platform's detection again (the others were asked in planning):
    one that says no there stops it."""
    import dataclasses

    from fd_core.errors import PlatformError
    from fd_core.runtime.plan import RunConfig, plan_run
    from fd_core.runtime.ranks.worker import RankWorker

    plan = dataclasses.replace(plan_run(RunConfig(model="ernie4_5", steps=2, progress=False)), platform="elsewhere")
    with pytest.raises(PlatformError, match=r"^rank 0: the run was planned on 'elsewhere', which this rank could not select \(no platform detected"):
        RankWorker.start(plan)
