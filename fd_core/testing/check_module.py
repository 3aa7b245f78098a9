"""The conformance suite against an installed platform, as `fd check PLATFORM` runs it."""

from __future__ import annotations

from typing import Any

import pytest

from fd_core.capabilities import Capabilities, capabilities_of
from fd_core.testing.suite import PlatformSuite


class TestInstalledPlatform(PlatformSuite):
    @pytest.fixture
    def platform_name(self, request: pytest.FixtureRequest) -> str:
        name = request.config.getoption("fd_platform")
        if not name:
            pytest.fail("pass --fd-platform NAME (fd check does)")
        return name

    @pytest.fixture
    def capabilities(self, platform_module: Any) -> Capabilities:
        return capabilities_of(platform_module)
