"""`fd run` with a pip-installed request gate (fd_check_request) and a device of few bytes (the memory plan): each
refusal is one line, exit 2, before any rank starts (no "starting 2 ranks", paddle never imported, no process left)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_one_line_error, left_over, run_fd
from plugin_sources import ANSWERING_GATE, REQUEST_GATE, TINY_DEVICE


def assert_no_rank_started(done) -> None:
    assert "starting 2 ranks" not in done.stderr and "loading ernie4_5" not in done.stderr, done.stderr
    assert done.paddle_imported is False, done.stderr
    assert left_over(done.marker, wait=0) == []


@pytest.fixture
def gate(distribution, tmp_path: Path):
    site = distribution("fd-gate", {"gate_probe": REQUEST_GATE}, {"fd.plugins": {"gate": "gate_probe"}})
    log = tmp_path / "gate.log"
    return site, log


def test_fd_run_refuses_a_request_the_gate_refuses_before_any_rank_starts(gate) -> None:
    site, log = gate
    done = run_fd(["run", "--tp", "2", "--temperature", "0.7", "--seed", "1"], path=site,
                  env={"FDTEST_GATE_LOG": str(log)}, traced=True)
    assert_one_line_error(done, "gate refuses this request: cannot sample with a temperature here; use greedy decoding")
    assert_no_rank_started(done)
    [call] = [json.loads(line) for line in log.read_text().splitlines()]
    assert ((call["tp"], call["temperature"], call["architecture"], call["paddle_imported"])
            == (2, 0.7, "ernie4_5", False))


def test_fd_run_asks_the_gate_once_in_the_parent_and_runs_what_it_accepts(gate) -> None:
    site, log = gate
    done = run_fd(["run", "--tp", "2", "--steps", "3", "--graph", "off", "--json"], path=site,
                  env={"FDTEST_GATE_LOG": str(log)})
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["tokens"]) == 3
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 1 and calls[0]["max_new_tokens"] == 3  # the parent's plan; no rank asks again


def test_a_gate_answering_a_non_string_is_refused_naming_the_plugin(distribution) -> None:
    source = ANSWERING_GATE.replace("ANSWER = None", "ANSWER = 7")
    site = distribution("fd-answering", {"answering_gate": source}, {"fd.plugins": {"answering": "answering_gate"}})
    done = run_fd(["run", "--tp", "2"], path=site, traced=True)
    assert_one_line_error(
        done, "plugin 'answering': fd_check_request returned int 7; return a reason (str) to refuse the request, or None to accept it"
    )
    assert_no_rank_started(done)


@pytest.fixture
def tiny(distribution):
    return distribution("fd-tiny", {"tiny_device": TINY_DEVICE}, {"fd.platforms": {"tiny": "tiny_device"}})


def test_weights_that_do_not_fit_one_rank_are_refused_by_run_and_explain_alike(tiny) -> None:
    # ernie4_5's preset: 427264 bytes of float32 weights at tp=1, 214272 a rank at tp=2; the device holds 300000.
    env = {"FD_PLATFORM": "tiny", "FDTEST_TINY_FREE": "300000"}
    done = run_fd(["run", "--tp", "1", "--memory-fraction", "1"], path=tiny, env=env, traced=True)
    message = (
        "ernie4_5 needs about 0.41 MiB of weights per rank (float32, tp=1), and device 0 of platform 'tiny' has 0.29 MiB free of "
        "0.29 MiB, of which --memory-fraction 1 allows 0.29 MiB; use a larger --tp, a higher --memory-fraction or a smaller model"
    )
    assert_one_line_error(done, message)
    assert_no_rank_started(done)
    explained = run_fd(["explain", "--tp", "1", "--memory-fraction", "1"], path=tiny, env=env)
    assert_one_line_error(explained, message)
    # At tp=2 each rank holds half, on a device of its own: it fits, with a small step's scratch, and the rest is KV
    # cache.
    fits = run_fd(["explain", "--tp", "2", "--memory-fraction", "1", "--max-prefill-tokens", "16", "--json"], path=tiny,
                  env=env)
    assert fits.returncode == 0, fits.stderr
    memory = json.loads(fits.stdout)["memory"]
    assert memory["weights_per_rank"] == 214272 and memory["ranks_per_device"] == 1 and memory["scratch_bytes"] > 0
    assert memory["capacity_tokens"] == (300000 - 214272 - memory["scratch_bytes"]) // 256
    assert memory["blocks"] == memory["capacity_tokens"] // 16


def test_at_the_platforms_most_ranks_the_refusal_does_not_advise_more_ranks(tiny) -> None:
    """tp=2 is the tiny platform's max_ranks: weights that do not fit a rank there are refused without "a larger
    --tp", which the platform would refuse next."""
    env = {"FD_PLATFORM": "tiny", "FDTEST_TINY_FREE": "200000"}
    done = run_fd(["explain", "--tp", "2", "--memory-fraction", "1"], path=tiny, env=env)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.endswith("use a higher --memory-fraction or a smaller model (--tp 2 is the most ranks platform 'tiny' "
                         "serves)"), line
    assert "larger --tp" not in line


def test_a_request_needing_more_cache_than_the_capacity_is_refused_with_the_numbers(tiny) -> None:
    # 214272 bytes of weights a rank, a step's scratch, 256 bytes of cache a token: room for 100 tokens, 6 blocks.
    from fd_core.runtime.memory import scratch_bytes
    from fd_core.runtime.plan import model_config_for
    from fd_models.ernie4_5.plugin import ARCHITECTURE

    scratch = scratch_bytes(model_config_for(ARCHITECTURE, None), 2, 16, 8)
    env = {"FD_PLATFORM": "tiny", "FDTEST_TINY_FREE": str(214272 + scratch + 256 * 100)}
    done = run_fd(["run", "--tp", "2", "--memory-fraction", "1", "--steps", "120", "--max-prefill-tokens", "16"],
                  path=tiny, env=env, traced=True)
    assert_one_line_error(
        done,
        "this request needs 8 KV-cache blocks of 16 positions (its longest prompt, 4 tokens, and 120 new), and ernie4_5 at "
        "tp=2 has 6 (what --memory-fraction 1 leaves after the weights; 4096 bytes a block per rank); ask for fewer tokens, "
        "or raise --memory-fraction or --tp",
    )
    assert_no_rank_started(done)


@pytest.mark.parametrize("fraction", ["0", "1.5", "nan"])
def test_a_memory_fraction_outside_0_1_is_a_usage_error(fraction: str) -> None:
    done = run_fd(["run", "--memory-fraction", fraction], traced=True)
    assert_one_line_error(
        done, f"--memory-fraction must be a number in (0, 1] (the share of free device memory fd may use), got {float(fraction)!r}"
    )
    assert done.paddle_imported is False
