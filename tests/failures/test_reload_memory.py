"""Repeated weight reloads (clear graphs, release, clean, load, capture): memory must not creep.

`fd run --tp 1 --reload-cycles 100 --json` reports each cycle's resident set size and whether its
tokens matched the first generation. One rank and the default graph mode (a Paddle static graph
captured again in every cycle) is the path engines that update weights in place exercise.

What was found (details in docs/failure-modes.md): Paddle 3.3.1 keeps every program that
`paddle.jit.to_static` traces alive, about 1.5 MB per trace of the tiny decode step plus an executor
of about 3 MB, so re-tracing on every capture grew memory by about 4.9 MB a cycle. The cpu
platform's static-graph backend now traces once per function and input shapes and reuses that
program on later captures (a program reads the parameters when it runs, so reloaded weights are
used); 100 cycles then stay within the issue's 2%.
"""

from __future__ import annotations

import json

import pytest

from conftest import left_over, run_fd

CYCLES = 100


@pytest.fixture(scope="module")
def hundred() -> dict:
    done = run_fd(["run", "--tp", "1", "--steps", "4", "--reload-cycles", str(CYCLES), "--json"], timeout=600)
    assert done.returncode == 0, done.stderr
    assert left_over(done.marker, wait=0) == []
    result = json.loads(done.stdout)
    assert [c["cycle"] for c in result["reload_cycles"]] == list(range(1, CYCLES + 1))
    return result


def test_hundred_reload_cycles_recapture_and_keep_the_tokens(hundred: dict) -> None:
    assert hundred["graph"]["allowed"], "the cycles must recapture a graph, the path that leaked"
    assert all(c["tokens_match"] for c in hundred["reload_cycles"])


def test_hundred_reload_cycles_rss_after_cycle_100_within_2_percent_of_cycle_1(hundred: dict) -> None:
    cycles = hundred["reload_cycles"]
    first, last = cycles[0]["rss_bytes"], cycles[-1]["rss_bytes"]
    assert last <= first * 1.02, f"RSS grew {100 * (last / first - 1):.2f}% from cycle 1 to cycle {CYCLES} ({(last - first) / 2**20:.1f} MiB)"
