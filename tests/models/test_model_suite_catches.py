"""Every check of the model suite fails on a package broken in what it checks, by name.

The package (tests/models/suite_llama_sources.py) is installed as a third party's would be: a module
and a real .dist-info on sys.path, found through its `fd.models` entry point, in this process and
in the spawned ranks. Its `good` variant passes; each other variant breaks one thing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fakedist import make_distribution, run_fd
from fd_core.host.loading import load_plugins
from fd_core.testing.model_suite import ModelSuite
from suite_llama_sources import MODEL, PLUGIN

FAILED = (AssertionError, pytest.fail.Exception)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_distribution(tmp_path_factory.mktemp("suite-llama"), "fd-suite-llama",
                             {"fd_suite_llama": PLUGIN, "fd_suite_llama_model": MODEL},
                             {"fd.models": {"suite_llama": "fd_suite_llama"}})
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


@pytest.fixture
def suite(package: Path) -> Any:
    plugins = load_plugins({})
    return plugins, ModelSuite()


def _args(plugins: Any, name: str) -> tuple[Any, ...]:
    return plugins, plugins.registry.get(name), 0, {"model": name, "checkpoint": None}


def test_the_good_package_passes_what_the_broken_ones_fail(suite: Any, tmp_path: Path) -> None:
    plugins, checks = suite
    checks.test_reference_greedy_tokens(plugins, plugins.registry.get("suite_llama"), 0, tmp_path)
    checks.test_graph_on_equals_graph_off(*_args(plugins, "suite_llama"))
    checks.test_graph_clear_really_clears(*_args(plugins, "suite_llama"))
    checks.test_reload_cycles_keep_the_tokens(*_args(plugins, "suite_llama"))
    checks.test_sequences_joining_a_running_batch_get_their_alone_tokens(*_args(plugins, "suite_llama"))


def test_a_wrong_rotary_layout_fails_the_reference_check(suite: Any, tmp_path: Path) -> None:
    plugins, checks = suite
    with pytest.raises(AssertionError, match=r"suite_llama_bad_rope: on a checkpoint saved by transformers. LlamaForCausalLM .* first-step logits differ"):
        checks.test_reference_greedy_tokens(plugins, plugins.registry.get("suite_llama_bad_rope"), 0, tmp_path)


def test_a_missing_all_reduce_fails_the_tp_check(suite: Any) -> None:
    plugins, checks = suite
    with pytest.raises(AssertionError, match=r"suite_llama_no_reduce: tp=2 \(--graph off\) (gives|failed)"):
        checks.test_tp2_equals_tp1(*_args(plugins, "suite_llama_no_reduce"))


def test_a_captured_step_unlike_eager_fails_the_graph_check(suite: Any) -> None:
    plugins, checks = suite
    with pytest.raises(AssertionError, match=r"suite_llama_graph_drift: with the captured decode graph the tokens are"):
        checks.test_graph_on_equals_graph_off(*_args(plugins, "suite_llama_graph_drift"))


def test_a_clear_hook_that_clears_nothing_fails_the_clear_check(suite: Any) -> None:
    plugins, checks = suite
    with pytest.raises(AssertionError, match=r"suite_llama_clear_noop: fd_clear_graphs returned True but never cleared"):
        checks.test_graph_clear_really_clears(*_args(plugins, "suite_llama_clear_noop"))


def test_a_reload_that_changes_the_weights_fails_the_reload_check(suite: Any) -> None:
    plugins, checks = suite
    with pytest.raises(AssertionError, match=r"suite_llama_reload_drift: reload cycle 1 changed the output"):
        checks.test_reload_cycles_keep_the_tokens(*_args(plugins, "suite_llama_reload_drift"))


def test_one_position_for_every_row_fails_the_continuous_batching_check(suite: Any) -> None:
    plugins, checks = suite
    with pytest.raises(AssertionError, match=r"suite_llama_one_position: prompt \[.*\] gives .* when it joins a running batch"):
        checks.test_sequences_joining_a_running_batch_get_their_alone_tokens(
            *_args(plugins, "suite_llama_one_position")
        )


def test_fd_check_model_names_the_failed_reference_check(package: Path) -> None:
    done = run_fd(["check", "--model", "suite_llama_bad_rope", "-k", "reference", "--json"], package, timeout=300)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    rows = {r["check"]: r for r in report["checks"]}
    assert (report["model"] == "suite_llama_bad_rope"
            and rows["test_reference_greedy_tokens[preset]"]["outcome"] == "failed")
    assert "transformers' LlamaForCausalLM" in rows["test_reference_greedy_tokens[preset]"]["detail"]


def test_without_transformers_the_reference_is_not_verified_never_passed(package: Path, tmp_path: Path) -> None:
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("raise ImportError('transformers is not installed (test stand-in)')\n")
    path = f"{tmp_path}:{package}"
    done = run_fd(["check", "--model", "suite_llama", "-k", "reference"], Path(path), timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "skipped  test_reference_greedy_tokens[preset]" in done.stdout and "not verified:" in done.stdout
    allowed = run_fd(["check", "--model", "suite_llama", "-k", "reference", "--allow-unverified", "--json"], Path(path),
                     timeout=300)
    assert allowed.returncode == 0 and json.loads(allowed.stdout)["counts"]["passed"] == 0


def test_a_prefill_blind_to_its_cached_prefix_fails_the_paged_cache_check(suite: Any) -> None:
    plugins, checks = suite
    checks.test_shared_prefixes_chunks_and_preemption_keep_the_tokens(*_args(plugins, "suite_llama"))
    with pytest.raises(AssertionError, match=r"suite_llama_prefix_blind: with their shared prefix found cached the prompts compute something else"):
        checks.test_shared_prefixes_chunks_and_preemption_keep_the_tokens(*_args(plugins, "suite_llama_prefix_blind"))

