"""Shared fixtures: a clean FD_* environment and throwaway plugin distributions."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Callable, Iterator, Mapping

import pytest

from fakedist import make_distribution


@pytest.fixture(autouse=True)
def _clean_fd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("FD_PLATFORM", "FD_PLUGINS"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """Install a throwaway distribution for this test: install_plugin(name, {module: source}, {group: {ep: value}})."""
    added: list[str] = []

    def install(name: str, modules: Mapping[str, str], entry_points: Mapping[str, Mapping[str, str]]) -> Path:
        root = make_distribution(tmp_path / name, name, modules, entry_points)
        monkeypatch.syspath_prepend(str(root))
        added.extend(modules)
        importlib.invalidate_caches()
        return root

    yield install
    for module in added:
        sys.modules.pop(module, None)
