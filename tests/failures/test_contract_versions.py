"""A plugin's declared contract version: another major refused in one line, a newer minor warned about once, none
declared read as the first version; and a deprecated form that keeps working with one warning."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable

import pytest

from fakedist import run_fd
from fd_core import CONTRACT_VERSION, Detection
from fd_core.contract import contract_problem, contract_warning, deprecations

PLATFORM = """
from fd_core import Detection, DeviceMemory, hookimpl
{declaration}

@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=-1, reason="a fixture", device="cpu", dist_backend="gloo", {memory})

@hookimpl
def fd_all_reduce(tensor, group):
    return tensor
"""


def _platform(distribution: Callable[..., Path], declaration: str, memory: str = "") -> Path:
    source = PLATFORM.format(declaration=declaration, memory=memory)
    return distribution("fd-versioned", {"versioned": source}, {"fd.platforms": {"versioned": "versioned"}})


def _listed(site: Path) -> dict:
    done = run_fd(["plugins", "--json"], site)
    return next(p for p in json.loads(done.stdout)["plugins"] if p["name"] == "versioned")


def test_another_major_is_refused_in_one_line_naming_both_versions(distribution: Callable[..., Path]) -> None:
    site = _platform(distribution, 'FD_CONTRACT = "2.0"')
    run = run_fd(["run", "--steps", "1"], site)
    assert run.returncode == 2 and not run.stdout
    assert run.stderr == (
        f"fd: error: plugin 'versioned' was written for fd's contract 2.0, and this fd-backends has contract "
        f"{CONTRACT_VERSION}; install an fd-backends with contract 2.x, or a release of 'versioned' written for 1.x\n"
    )
    record = _listed(site)
    assert record["contract"] == "2.0" and record["contract_declared"] and not record["active"]
    assert record["error"].startswith("plugin 'versioned' was written for fd's contract 2.0")


def test_a_newer_minor_loads_with_one_warning(distribution: Callable[..., Path]) -> None:
    site = _platform(distribution, 'FD_CONTRACT = "1.7"')
    run = run_fd(["run", "--tp", "1", "--steps", "1", "--json"], site)
    assert run.returncode == 0, run.stderr
    warned = [line for line in run.stderr.splitlines() if "contract 1.7" in line]
    assert warned == [
        f"fd: warning: plugin 'versioned' was written for fd's contract 1.7, newer than this fd-backends' "
        f"{CONTRACT_VERSION}: what it uses of 1.7 is not here; upgrade fd-backends"
    ]
    record = _listed(site)
    assert (record["contract"], record["contract_declared"], record["error"]) == ("1.7", True, None)
    # fd check loads the plugins more than once in its process: still one warning.
    check = run_fd(["check", "versioned", "-k", "detection_is_well_formed"], site, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    assert sum("contract 1.7" in line for line in check.stderr.splitlines()) == 1, check.stderr


@pytest.mark.parametrize("declared", ["1", "v1.0", "1.0.0", 1.0])
def test_a_declaration_that_is_not_a_version_is_refused(distribution: Callable[..., Path], declared: object) -> None:
    site = _platform(distribution, f"FD_CONTRACT = {declared!r}")
    run = run_fd(["run", "--steps", "1"], site)
    assert run.returncode == 2
    assert run.stderr == (
        f"fd: error: plugin 'versioned': FD_CONTRACT = {declared!r} is not a contract version; write it as "
        f"\"MAJOR.MINOR\", the version of fd's contract the plugin was written for (this fd's is {CONTRACT_VERSION})\n"
    )


def test_none_declared_is_the_first_version_and_says_so(distribution: Callable[..., Path]) -> None:
    site = _platform(distribution, "")
    record = _listed(site)
    assert (record["contract"], record["contract_declared"], record["error"]) == ("1.0", False, None)
    text = run_fd(["plugins"], site).stdout
    assert "fd-versioned 0.1.0, contract 1.0 (not declared)" in text


def test_the_version_rules() -> None:
    """Same major, same or older minor: neither refused nor warned; another major or a newer minor: said."""
    major, minor = (int(p) for p in CONTRACT_VERSION.split("."))
    for same in (CONTRACT_VERSION, f"{major}.0"):
        assert contract_problem("p", same) is None and contract_warning("p", same) is None
    assert contract_problem("p", f"{major + 1}.0") and contract_problem("p", f"{major - 1}.9")
    assert contract_warning("p", f"{major}.{minor + 1}") and contract_problem("p", f"{major}.{minor + 1}") is None


def test_a_deprecated_detection_field_works_with_one_warning_at_the_caller() -> None:
    """Detection.memory_bytes (deprecated in 1.0 for device_memory): read as before, warned once, where the
    platform built its answer."""
    from fd_core.runtime.memory import reported_devices

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = Detection(detected=True, memory_bytes=3 << 30)
        Detection(detected=True, memory_bytes=1 << 30)
    assert reported_devices(old)[0].total == 3 << 30
    notes = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(notes) <= 1 and any("Detection.memory_bytes is deprecated" in n for n in deprecations())
    if notes:  # none when an earlier test of this process met the deprecation first
        assert notes[0].filename == __file__
        assert str(notes[0].message) == (
            f"Detection.memory_bytes is deprecated in fd's contract {CONTRACT_VERSION}: use device_memory="
            "(DeviceMemory(total=..., free=...), ...), one a device; it is removed in contract 2.0"
        )


def test_fd_check_lists_the_deprecations_a_platform_uses(distribution: Callable[..., Path]) -> None:
    site = _platform(distribution, 'FD_CONTRACT = "1.0"', memory="memory_bytes=8 << 30")
    done = run_fd(["check", "versioned", "-k", "detection_is_well_formed", "--json"], site, timeout=300)
    report = json.loads(done.stdout)
    assert report["deprecations"] == [
        f"Detection.memory_bytes is deprecated in fd's contract {CONTRACT_VERSION}: use device_memory="
        "(DeviceMemory(total=..., free=...), ...), one a device; it is removed in contract 2.0"
    ]
    text = run_fd(["check", "versioned", "-k", "detection_is_well_formed"], site, timeout=300)
    assert text.stdout.splitlines()[-1].startswith("deprecated: Detection.memory_bytes is deprecated")
    # Shown where a run meets it too (Python hides DeprecationWarning outside __main__): once, naming the plugin file.
    run = run_fd(["plugins"], site)
    shown = [line for line in run.stderr.splitlines() if "DeprecationWarning" in line]
    assert len(shown) == 1 and "versioned.py" in shown[0], run.stderr
