"""Every hookspec is documented in docs/hooks.md, and tested somewhere in tests/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fd_core.plugins import HOOK_NAMES

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "hooks.md").read_text()


def test_there_are_hooks() -> None:
    assert len(HOOK_NAMES) == 7


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_hook_has_a_section_with_its_signature_and_an_example(hook: str) -> None:
    match = re.search(rf"^### {hook}\n(.*?)(?=^### |^## |\Z)", DOC, re.S | re.M)
    assert match, f"docs/hooks.md has no '### {hook}' section"
    section = match.group(1)
    assert f"`{hook}(" in section, f"the {hook} section does not give its signature"
    assert "```python" in section and f"def {hook}(" in section, f"the {hook} section has no example implementation"


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_hook_is_exercised_by_a_test(hook: str) -> None:
    this = Path(__file__).resolve()
    users = [
        p for p in (ROOT / "tests").rglob("test_*.py")
        if p.resolve() != this and re.search(rf"\b{hook}\b|\.{hook.removeprefix('fd_')}\(", p.read_text())
    ]
    assert users, f"no test exercises {hook}"


def test_doc_examples_are_valid_plugins() -> None:
    """Each example block defines hook implementations that pass load-time validation."""
    from types import ModuleType

    from fd_core.plugins import validate_module

    blocks = re.findall(r"```python\n(.*?)```", DOC, re.S)
    assert len(blocks) >= len(HOOK_NAMES)
    for index, block in enumerate(blocks):
        module = ModuleType(f"doc_example_{index}")
        exec(compile(block, module.__name__, "exec"), module.__dict__)
        validate_module(module.__name__, module)
