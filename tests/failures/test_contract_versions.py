"""A plugin's declared contract version: another major skipped with a warning and listed as incompatible (refused in
one line only as the platform selected), a newer minor warned about once, none declared read as the first version;
and a deprecated form that keeps working with one warning."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable

import pytest

from conftest import assert_one_line_error, run_fd
from fakedist import listing
from fd_core import CONTRACT_VERSION, Detection
from fd_core.contract import contract_mismatch, contract_problem, contract_warning, deprecations

PLATFORM = """
from fd_core import Detection, DeviceMemory, hookimpl
{declaration}

@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority={priority}, reason="a fixture", device="cpu", dist_backend="gloo", {memory})

@hookimpl
def fd_all_reduce(tensor, group):
    return tensor
"""


# Written for contract 2.0: hooks 1.x does not have, or takes other arguments for. Registered, either would fail the run.
EXTENSION = """
from fd_core import hookimpl
FD_CONTRACT = "2.0"

@hookimpl
def fd_register_kernels(register, contract):
    raise AssertionError("a plugin of another major must never be registered")
"""

MODELS = """
from fd_core import hookimpl
FD_CONTRACT = "2.0"

@hookimpl
def fd_register_models(register):
    raise AssertionError("a model package of another major must never be registered")
"""
# What this fd says of a plugin written for contract 2.0 (its record's reason, and the fix).
MISMATCH = (f"it was written for fd's contract 2.0, and this fd-backends has contract {CONTRACT_VERSION}; install an "
            f"fd-backends with contract 2.x, or a release of 'versioned' written for 1.x")


def _platform(distribution: Callable[..., Path], declaration: str, memory: str = "", priority: int = -1) -> Path:
    source = PLATFORM.format(declaration=declaration, memory=memory, priority=priority)
    return distribution("fd-versioned", {"versioned": source}, {"fd.platforms": {"versioned": "versioned"}})


def _listed(site: Path) -> dict:
    done = run_fd(["plugins", "--json"], site)
    return next(p for p in json.loads(done.stdout)["plugins"] if p["name"] == "versioned")


def test_another_major_is_skipped_with_a_warning_and_listed_as_incompatible(distribution: Callable[..., Path]) -> None:
    """Installed but not selected, a platform of another major stops no run: it is skipped (never registered) with
    one warning, and `fd plugins` lists it as incompatible with its reason."""
    site = _platform(distribution, 'FD_CONTRACT = "2.0"')
    run = run_fd(["run", "--tp", "1", "--steps", "1", "--json"], site)
    assert run.returncode == 0, run.stderr
    assert [line for line in run.stderr.splitlines() if "versioned" in line] == [
        f"fd: warning: platform 'versioned' is skipped: {MISMATCH}"
    ]
    record = _listed(site)
    assert (record["contract"], record["contract_declared"], record["active"]) == ("2.0", True, False)
    assert (record["incompatible"], record["error"], record["status"]) == (True, MISMATCH, f"incompatible: {MISMATCH}")
    text = run_fd(["plugins"], site)
    assert text.returncode == 0, text.stderr
    assert listing(text.stdout)["platform plugins"]["versioned"].startswith(
        f"versioned fd-versioned 0.1.0, contract 2.0 incompatible: {MISMATCH}"
    )
    assert text.stdout.startswith("platform: cpu (")


def test_another_major_selected_is_refused_in_one_line_naming_both_versions(
    distribution: Callable[..., Path],
) -> None:
    """Forced, certified with `fd check`, or detected at the top priority: one line naming the plugin, its contract,
    this fd's and the fix, before anything starts."""
    site = _platform(distribution, 'FD_CONTRACT = "2.0"')
    forced = run_fd(["run", "--steps", "1"], site, env={"FD_PLATFORM": "versioned"})
    assert forced.returncode == 2 and not forced.stdout
    assert forced.stderr == f"fd: error: platform 'versioned' is selected (FD_PLATFORM=versioned), but {MISMATCH}\n"
    check = run_fd(["check", "versioned"], site, timeout=300)
    assert_one_line_error(check, f"platform 'versioned' is selected (FD_PLATFORM=versioned), but {MISMATCH}")
    detected = run_fd(["explain"], _platform(distribution, 'FD_CONTRACT = "2.0"', priority=50))
    assert detected.returncode == 2 and not detected.stdout
    assert detected.stderr == (f"fd: error: platform 'versioned' detected its hardware and is selected, but {MISMATCH}, "
                               f"or set FD_PLATFORM to another platform\n")


def test_an_extension_or_model_package_of_another_major_is_skipped(distribution: Callable[..., Path]) -> None:
    """Neither is registered (their hooks would fail the run); each is warned about once and listed as incompatible,
    and an architecture asked for that no compatible package registers names the skipped package."""
    site = distribution("fd-versioned", {"versioned_ext": EXTENSION, "versioned_models": MODELS},
                        {"fd.plugins": {"versioned": "versioned_ext"}, "fd.models": {"versioned": "versioned_models"}})
    run = run_fd(["run", "--tp", "1", "--steps", "1", "--json"], site)
    assert run.returncode == 0, run.stderr
    assert sorted(line for line in run.stderr.splitlines() if "versioned" in line) == [
        f"fd: warning: extension 'versioned' is skipped: {MISMATCH}",
        f"fd: warning: model package 'versioned' is skipped: {MISMATCH}",
    ]
    listed = json.loads(run_fd(["plugins", "--json"], site).stdout)
    records = {p["kind"]: p for p in listed["plugins"] if p["name"] == "versioned"}
    assert set(records) == {"extension", "model"}
    for record in records.values():
        assert (record["incompatible"], record["active"], record["error"]) == (True, False, MISMATCH)
    assert listed["problems"] == []
    unknown = run_fd(["run", "--model", "versioned_lm", "--steps", "1"], site)
    assert_one_line_error(unknown, f"; model package 'versioned' is not loaded: {MISMATCH}", exact=False)


def test_a_newer_minor_loads_with_one_warning(distribution: Callable[..., Path]) -> None:
    major, minor = CONTRACT_VERSION.split(".")
    newer = f"{major}.{int(minor) + 1}"
    site = _platform(distribution, f'FD_CONTRACT = "{newer}"')
    run = run_fd(["run", "--tp", "1", "--steps", "1", "--json"], site)
    assert run.returncode == 0, run.stderr
    warned = [line for line in run.stderr.splitlines() if f"contract {newer}" in line]
    assert warned == [
        f"fd: warning: plugin 'versioned' was written for fd's contract {newer}, newer than this fd-backends' "
        f"{CONTRACT_VERSION}: what it uses of {newer} is not here; upgrade fd-backends"
    ]
    record = _listed(site)
    assert (record["contract"], record["contract_declared"], record["error"]) == (newer, True, None)
    # fd check loads the plugins more than once in its process: still one warning.
    check = run_fd(["check", "versioned", "-k", "detection_is_well_formed"], site, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    assert sum(f"contract {newer}" in line for line in check.stderr.splitlines()) == 1, check.stderr


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
    """Same major, same or older minor: neither refused nor warned; another major, a newer minor or no version:
    said."""
    major, minor = (int(p) for p in CONTRACT_VERSION.split("."))
    for same in (CONTRACT_VERSION, f"{major}.0"):
        assert contract_problem("p", same) is None and contract_warning("p", same) is None
        assert contract_mismatch("p", same) is None
    assert contract_mismatch("p", f"{major + 1}.0") and contract_mismatch("p", f"{major - 1}.9")
    assert contract_problem("p", f"{major + 1}.0") is None and contract_problem("p", "1.0.0")
    assert contract_warning("p", f"{major}.{minor + 1}") and contract_mismatch("p", f"{major}.{minor + 1}") is None


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
