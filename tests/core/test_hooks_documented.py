"""Every hookspec is documented in docs/hooks.md, and tested somewhere in tests/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fd_core.host.records import HOOK_NAMES

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "hooks.md").read_text()


def test_there_are_hooks() -> None:
    assert len(HOOK_NAMES) == 14


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

    from fd_core.host.validation import validate_module

    blocks = re.findall(r"```python\n(.*?)```", DOC, re.S)
    assert len(blocks) >= len(HOOK_NAMES)
    for index, block in enumerate(blocks):
        module = ModuleType(f"doc_example_{index}")
        exec(compile(block, module.__name__, "exec"), module.__dict__)
        validate_module(module.__name__, module)


def test_the_documented_graph_backend_passes_the_suites_graph_check() -> None:
    """The fd_graph_backend example is one a vendor can copy: it meets the contract the suite checks."""
    from types import ModuleType

    from fd_core.testing.suite import check_graph_backend

    section = re.search(r"^### fd_graph_backend\n(.*?)(?=^### )", DOC, re.S | re.M).group(1)
    module = ModuleType("doc_graph_backend")
    exec(compile(re.search(r"```python\n(.*?)```", section, re.S).group(1), module.__name__, "exec"), module.__dict__)
    check_graph_backend(module.fd_graph_backend(None), "the documented example")


def test_the_graph_check_fails_a_backend_that_replays_python() -> None:
    """The example the docs used to give: replay calls fn again. The check must say so."""
    from fd_core.testing.suite import check_graph_backend

    class EagerGraphs:
        mode = "eager-replay"

        def __init__(self):
            self._fns = {}

        def capture(self, key, fn, inputs):
            self._fns[key] = fn

        def replay(self, key, inputs):
            return self._fns[key](*inputs)

        def has(self, key):
            return key in self._fns

        def clear(self):
            self._fns.clear()

    with pytest.raises(AssertionError, match="capture\\(key, fn, inputs\\) did not trace fn"):
        check_graph_backend(EagerGraphs(), "eager")
