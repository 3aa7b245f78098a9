"""The model conformance suite against an installed architecture, as `fd check --model NAME` runs it."""

from __future__ import annotations

import pytest

from fd_core.testing.model_suite import ModelSuite


class TestInstalledModel(ModelSuite):
    @pytest.fixture
    def architecture_name(self, request: pytest.FixtureRequest) -> str:
        name = request.config.getoption("fd_model")
        if not name:
            pytest.fail("pass --fd-model NAME (fd check --model does)")
        return name
