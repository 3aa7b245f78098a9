"""The whole conformance suite against the cpu platform, for real: two gloo ranks, static graphs."""

from __future__ import annotations

import pytest

from fd_core.testing import Capabilities, PlatformSuite
from fd_plugins.cpu import platform as cpu


class TestCpuPlatform(PlatformSuite):
    @pytest.fixture
    def platform_name(self) -> str:
        return "cpu"

    @pytest.fixture
    def capabilities(self) -> Capabilities:
        return cpu.FD_CAPABILITIES
