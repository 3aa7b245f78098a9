"""The model conformance suite (fd_core.testing.ModelSuite) on every built-in architecture, as `fd check --model` runs it.

The suite's tp, graph, graph-clear, reload, save-random and reference checks replace the equalities
tests/models used to assert on its own; tests/models keeps what the suite cannot express (logits,
the order of lifecycle calls, pictures, the reference cases of tests/models/test_reference.py).
"""

from __future__ import annotations

import pytest

from fd_core.testing import ModelSuite

ARCHS = ["ernie4_5", "ernie4_5_vl", "qwen3_vl"]


class TestBuiltinModels(ModelSuite):
    @pytest.fixture(params=ARCHS)
    def architecture_name(self, request: pytest.FixtureRequest) -> str:
        return str(request.param)
