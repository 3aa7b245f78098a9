"""`fd run` never gives silently wrong tokens from a graph backend whose replay does not compute from its inputs, or
loses the KV-cache write the step makes in place: the first replay of each captured step is compared with the eager
step it replaces, its output and the state it writes (failure modes, rounds 4 and 5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import assert_one_line_error, run_fd

# The cpu platform, except that its graph backend's replay returns what the capture computed (its inputs then),
# whatever it is given: every replayed decode step repeats the capture's logits.
STALE = '''
from fd_core import Detection, hookimpl
from fd_plugins.cpu import platform as cpu

FD_CONTRACT = "1.2"


@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=-1, reason="a test's platform", device="cpu", dist_backend="gloo")


@hookimpl
def fd_all_reduce(tensor, group):
    return cpu.fd_all_reduce(tensor, group)


class Stale:
    mode = "static"

    def __init__(self):
        self.inner, self.first = cpu.fd_graph_backend(None), {}

    def capture(self, key, fn, inputs):
        self.inner.capture(key, fn, inputs)
        self.first[key] = self.inner.replay(key, inputs)

    def replay(self, key, inputs):
        return self.first[key]

    def has(self, key):
        return self.inner.has(key)

    def clear(self):
        self.inner.clear()
        self.first.clear()


@hookimpl
def fd_graph_backend(parallel_config):
    return Stale()
'''


def _platform(distribution: Any) -> Path:
    return distribution("fd-stale", {"fdtest_stale": STALE}, {"fd.platforms": {"stale": "fdtest_stale"}})


# The same, except that its replay computes from its inputs but on copies of the float tensors it is given (the KV
# caches): its output is right, and the step's cache write is lost.
LOST_WRITE = STALE.replace('''    def replay(self, key, inputs):
        return self.first[key]''', '''    def replay(self, key, inputs):
        import paddle

        copies = [paddle.assign(x) if x.dtype == paddle.float32 else x for x in inputs]
        return self.inner.replay(key, copies)''')


def test_a_replay_that_loses_its_cache_write_stops_the_run_naming_the_platform(distribution: Any) -> None:
    """Its outputs equal the eager step's (the round 4 check passed it, and later tokens were wrong with exit 0); the
    state the step writes does not."""
    assert LOST_WRITE != STALE
    platform = distribution("fd-lost-write", {"fdtest_lost": LOST_WRITE}, {"fd.platforms": {"lost": "fdtest_lost"}})
    run = run_fd(["run", "--tp", "1", "--graph", "on", "--steps", "6"], platform, {"FD_PLATFORM": "lost"},
                 timeout=300)
    assert_one_line_error(run, "platform 'lost': its graph backend's first replay of (1, 4) did not write the state "
                               "the eager step writes in place", exact=False)


def test_a_stale_replay_stops_the_run_naming_the_platform(distribution: Any) -> None:
    run = run_fd(["run", "--tp", "1", "--graph", "on", "--steps", "6"], _platform(distribution),
                 {"FD_PLATFORM": "stale"}, timeout=300)
    assert_one_line_error(run, "platform 'stale': its graph backend's first replay of (1, 4) differs from the eager "
                               "step it replaces", exact=False)
    assert "fix its fd_graph_backend, or run with --graph off" in run.stderr


def test_an_honest_replay_is_checked_once_and_reported(distribution: Any) -> None:
    """The cpu platform's own static graphs pass the check; its cost is the run's replay_check phase."""
    import json

    run = run_fd(["run", "--tp", "1", "--graph", "on", "--steps", "6", "--json"], timeout=300)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["timings_s"]["replay_check"] > 0, doc["timings_s"]
