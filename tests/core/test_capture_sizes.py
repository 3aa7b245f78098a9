"""Capture sizes (Detection.capture_sizes, contract 1.2): a decode batch is padded up to the next size the platform
captures and runs eagerly above the largest; the suite's check catches an engine that captures another size, and
`fd explain` says which sizes and whose they are."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from fd_core.host.loading import PluginSet, load_plugins
from fd_core.runtime.engine import loop
from fd_core.runtime.engine.loop import capture_size
from fd_core.testing.suite import ModelTests


def test_the_batch_a_decode_step_is_captured_at() -> None:
    assert [capture_size(rows, (1, 2, 4, 8), 16) for rows in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    assert [capture_size(rows, (), 6) for rows in (1, 3, 5, 6)] == [1, 4, 6, 6]  # none declared: powers of two


def _declaring(sizes: tuple[int, ...]) -> PluginSet:
    """The cpu platform, as if its detection declared `sizes`."""
    plugins = load_plugins({"FD_PLATFORM": "cpu"})
    record = plugins.record("cpu")
    assert record.detection is not None
    record.detection = dataclasses.replace(record.detection, capture_sizes=sizes)
    return plugins


def test_the_suite_passes_padding_and_eager_above_the_largest() -> None:
    plugins = _declaring((1, 2))
    ModelTests().test_decode_batches_are_captured_at_the_declared_sizes(plugins, plugins.detection)


def test_the_suite_catches_an_engine_that_captures_an_undeclared_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case vendors met: a batch of 3 captured on a device that captures fewer sizes (here 1 and 2)."""
    plugins = _declaring((1, 2))
    monkeypatch.setattr(loop, "capture_size", lambda rows, sizes, max_batch: loop._bucket(rows, max_batch))
    with pytest.raises(AssertionError, match=r"captured at batch sizes \[3\], but the platform captures only \[1, 2\]"):
        ModelTests().test_decode_batches_are_captured_at_the_declared_sizes(plugins, plugins.detection)


def test_fd_explain_shows_the_sizes_and_whose_they_are() -> None:
    done = subprocess.run([sys.executable, "-m", "fd_core.cli", "explain", "--tp", "1", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    import json

    doc = json.loads(done.stdout)
    assert doc["capture"] == {"sizes": [1, 2, 4, 8], "from": "fd"}
