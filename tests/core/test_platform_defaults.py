"""Platform defaults (contract 1.2): what the user did not set comes from the platform's Detection, else fd's default,
and an option always wins; `fd explain` shows each value and where it came from; a platform's one-prompt-a-step
prefill is what the engine does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fd_core.detection import Detection
from fd_core.errors import ConfigError
from fd_core.runtime.settings import resolve_settings

NOTHING = {"max_batch": None, "max_prefill_tokens": None, "max_prefill_prompts": None, "kv_block_size": None}


def test_the_option_then_the_platform_then_fd() -> None:
    mine = Detection(detected=True, max_batch=16, max_prefill_prompts=1, kv_block_size=64)
    settings = resolve_settings({**NOTHING, "max_batch": 4}, mine, "mychip", "float32", dtype_requested=False)
    assert (settings.max_batch, settings.max_prefill_prompts, settings.kv_block_size, settings.max_prefill_tokens) == (
        4, 1, 64, 512)
    assert settings.to_dict()["max_batch"]["from"] in ("--max-batch", "LLM(max_batch=...)")
    assert settings.source("max_prefill_prompts") == "platform mychip"
    assert settings.source("max_prefill_tokens") == "fd's default"
    assert settings.source("dtype") == "platform mychip (its preferred)"
    plain = resolve_settings(NOTHING, Detection(detected=True), "cpu", "float32", dtype_requested=True)
    assert (plain.max_batch, plain.max_prefill_prompts, plain.kv_block_size) == (8, None, 16)
    assert "no limit (fd's default)" in " ".join(plain.lines())


def test_a_bad_option_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="must be a positive integer, got 0"):
        resolve_settings({**NOTHING, "max_prefill_prompts": 0}, Detection(detected=True), "cpu", "float32", False)


def test_a_platform_default_that_is_not_a_positive_integer_is_the_plugins_error() -> None:
    assert "max_batch=0" in (Detection(detected=True, max_batch=0).problem() or "")
    assert "capture_sizes" in (Detection(detected=True, capture_sizes=(0,)).problem() or "")


def _explain(*args: str) -> dict:
    env = {**os.environ, "FD_PLATFORM": "cpu_checked"}
    done = subprocess.run([sys.executable, "-m", "fd_core.cli", "explain", "--tp", "1", *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) if "--json" in args else {"text": " ".join(done.stdout.split())}


def test_fd_explain_shows_the_platforms_defaults_and_the_option_over_them() -> None:
    """The cpu_checked example platform prefills one prompt a step and captures batches of 1, 2, 4 and 8."""
    text = _explain()["text"]
    assert "prompts prefilled a step: 1 (platform cpu_checked)" in text, text
    assert "max batch: 8 (fd's default)" in text, text
    doc = _explain("--json", "--max-prefill-prompts", "3")
    assert doc["settings"]["max_prefill_prompts"] == {"value": 3, "from": "--max-prefill-prompts"}
    assert doc["capture"] == {"sizes": [1, 2, 4, 8], "from": "platform"}


def test_one_prompt_a_step_prefills_prompts_in_turn_and_gives_the_same_tokens() -> None:
    from fd_core.host.backend import load_backend
    from fd_core.runtime.engine.loop import Engine
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for
    from fd_core.runtime.request import Request

    backend = load_backend(env={"FD_PLATFORM": "cpu"})
    arch = backend.plugins.registry.get("ernie4_5")
    runner = ModelRunner(backend, arch, model_config_for(arch, None), seed=0, graph="off")
    runner.load()
    runner.decide()
    model = runner.model
    assert model is not None
    prefills: list[int] = []
    prefill = model.prefill

    def counted(ids: object, image: object, batch: object) -> object:
        # The prompts' rows (the step's decode rows ride in its prefill call too: one token each; every prompt here
        # has two or more).
        prefills.append(int((batch.lengths > 1).sum()))  # type: ignore[attr-defined]
        return prefill(ids, image, batch)

    model.prefill = counted  # type: ignore[method-assign]
    request = Request.greedy([[5, 6, 7], [8, 9], [10, 11, 12, 13]], 3)
    together = [c.token_ids for c in Engine(runner).generate(request)]
    assert prefills == [3]  # one step prefills the three prompts
    prefills.clear()
    in_turn = [c.token_ids for c in Engine(runner, max_prefill_prompts=1).generate(request)]
    assert prefills == [1, 1, 1]
    assert in_turn == together


def test_a_claimed_dtype_the_platform_cannot_run_fails_the_suite() -> None:
    """The mutant of failure-modes round 4: a platform whose Detection.dtypes claims bfloat16 first (fd run's default)
    while its kernels cannot run it (Paddle's CPU build has no bfloat16 matmul) now fails `fd check`, naming the
    dtype, instead of passing it and failing `fd run` with Paddle's raw message."""
    import dataclasses

    from fd_core.host.loading import load_plugins
    from fd_core.testing.suite import ModelTests

    plugins = load_plugins({"FD_PLATFORM": "cpu"})
    record = plugins.record("cpu")
    assert record.detection is not None
    record.detection = dataclasses.replace(record.detection, dtypes=("bfloat16", "float32"))
    with pytest.raises(pytest.fail.Exception, match=r"cpu claims bfloat16 \(Detection.dtypes=\('bfloat16', "
                                                    r"'float32'\)\), but ernie4_5 cannot run in it on this platform"):
        ModelTests().test_the_model_path_runs_in_every_claimed_dtype(plugins, plugins.detection)
