"""Discovery and platform selection through real entry points of throwaway distributions."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from fd_core.errors import PlatformError, PluginError
from fd_core.host.loading import load_plugins

PLATFORM = """
from fd_core import Detection, hookimpl

@hookimpl
def fd_platform_detect():
    return Detection(detected={detected}, priority={priority}, reason="{reason}")

@hookimpl
def fd_all_reduce(tensor, group):
    return tensor
"""


def platform_source(detected: bool = True, priority: int = 5, reason: str = "saw the fake chip") -> str:
    return PLATFORM.format(detected=detected, priority=priority, reason=reason)


def test_the_host_platform_wins_when_nothing_else_is_detected() -> None:
    plugins = load_plugins({})
    assert plugins.platform == "cpu"
    cuda = plugins.record("cuda")
    assert not cuda.active and "not detected" in cuda.status
    assert cuda.detection is not None and not cuda.detection.detected


def test_highest_priority_detection_wins(install_plugin) -> None:
    install_plugin("fake-chip", {"fake_chip": platform_source(priority=5)}, {"fd.platforms": {"fakechip": "fake_chip"}})
    plugins = load_plugins({})
    assert plugins.platform == "fakechip"
    assert "highest priority (5)" in plugins.selection
    assert plugins.record("cpu").status.startswith("not active: detected, but 'fakechip' was chosen")


def test_equal_priority_is_an_error_naming_both(install_plugin) -> None:
    install_plugin("chip-a", {"chip_a": platform_source(priority=3)}, {"fd.platforms": {"chipa": "chip_a"}})
    install_plugin("chip-b", {"chip_b": platform_source(priority=3)}, {"fd.platforms": {"chipb": "chip_b"}})
    with pytest.raises(PlatformError, match=r"chipa and chipb both detected .* set FD_PLATFORM"):
        load_plugins({})


def test_fd_platform_forces_and_unknown_name_lists_installed(install_plugin) -> None:
    install_plugin("fake-chip", {"fake_chip": platform_source(priority=5)}, {"fd.platforms": {"fakechip": "fake_chip"}})
    assert load_plugins({"FD_PLATFORM": "cpu"}).platform == "cpu"
    with pytest.raises(PlatformError, match=r"^FD_PLATFORM='tpu9' names no installed platform; installed: ") as err:
        load_plugins({"FD_PLATFORM": "tpu9"})
    installed = str(err.value).split("installed: ")[1].split(", ")
    assert {"cpu", "cuda", "fakechip", "iluvatar"} <= set(installed) and installed == sorted(installed)


def test_import_error_is_listed_and_never_selected(install_plugin, capsys) -> None:
    install_plugin("broken-chip", {"broken_chip": "raise ImportError('libchip.so: cannot open shared object')"}, {"fd.platforms": {"broken": "broken_chip"}})
    plugins = load_plugins({})
    record = plugins.record("broken")
    assert plugins.platform == "cpu"
    assert record.load_error == "import failed: ImportError: libchip.so: cannot open shared object"
    assert "plugin 'broken' (broken_chip) failed to import" in capsys.readouterr().err
    with pytest.raises(PlatformError, match="that plugin failed to load"):
        load_plugins({"FD_PLATFORM": "broken"})


def test_detection_that_raises_is_reported_and_not_detected(install_plugin, capsys) -> None:
    source = "from fd_core import hookimpl\n@hookimpl\ndef fd_platform_detect():\n    raise OSError('driver version mismatch')\n"
    install_plugin("flaky-chip", {"flaky_chip": source}, {"fd.platforms": {"flaky": "flaky_chip"}})
    plugins = load_plugins({})
    record = plugins.record("flaky")
    assert plugins.platform == "cpu"
    assert record.detect_error == "fd_platform_detect raised OSError: driver version mismatch"
    assert record.status == "not active: fd_platform_detect raised OSError: driver version mismatch"
    assert "platform 'flaky': fd_platform_detect raised OSError" in capsys.readouterr().err


def test_allow_list_leaves_out_other_distributions_but_never_builtins(install_plugin) -> None:
    install_plugin("fake-chip", {"fake_chip": platform_source(priority=5)}, {"fd.platforms": {"fakechip": "fake_chip"}})
    plugins = load_plugins({"FD_PLUGINS": ""})
    assert plugins.platform == "cpu"
    left_out = plugins.record("fakechip")
    assert not left_out.allowed and left_out.status == "left out: not in FD_PLUGINS (add fakechip to it to load this plugin)" and left_out.module is None
    assert {r.name for r in plugins.records if r.builtin and r.module is not None} >= {"cpu", "cuda", "iluvatar"}
    assert load_plugins({"FD_PLUGINS": "fake-chip"}).platform == "fakechip"  # by distribution name
    assert load_plugins({"FD_PLUGINS": "fakechip"}).platform == "fakechip"  # by entry-point name


def test_allow_list_naming_a_missing_plugin_lists_installed(install_plugin) -> None:
    install_plugin("fake-chip", {"fake_chip": platform_source(priority=5)}, {"fd.platforms": {"fakechip": "fake_chip"}})
    with pytest.raises(PluginError, match=r"^FD_PLUGINS names nosuch, which is not installed; installed third-party plugins: .*fakechip"):
        load_plugins({"FD_PLUGINS": "nosuch"})


NONE_PLATFORM = """
from fd_core import hookimpl

@hookimpl
def fd_platform_detect():
    return None
"""

HANGING_PLATFORM = """
import threading
from fd_core import hookimpl

@hookimpl
def fd_platform_detect():
    threading.Event().wait()
"""

IMPOSTOR_CPU = """
from fd_core import Detection, hookimpl

@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=99, reason="not really the cpu")
"""


def test_detection_may_return_none_as_its_spec_says(install_plugin) -> None:
    install_plugin("quiet-chip", {"quiet_chip": NONE_PLATFORM}, {"fd.platforms": {"quiet": "quiet_chip"}})
    plugins = load_plugins({})
    record = plugins.record("quiet")
    assert record.detect_error is None and record.detection is not None and not record.detection.detected
    assert "fd_platform_detect returned None" in record.status


def test_detection_that_never_returns_is_bounded_and_named(install_plugin, capsys) -> None:
    install_plugin("stuck-chip", {"stuck_chip": HANGING_PLATFORM}, {"fd.platforms": {"stuck": "stuck_chip"}})
    plugins = load_plugins({"FD_HOOK_TIMEOUT": "0.5"})
    assert plugins.platform == "cpu"
    assert plugins.record("stuck").status == (
        "not active: fd_platform_detect did not return within 0.5 s; fix or uninstall the plugin "
        "(FD_PLUGINS can leave it out, FD_HOOK_TIMEOUT raises the limit)"
    )
    assert "platform 'stuck': fd_platform_detect did not return within 0.5 s" in capsys.readouterr().err


def test_a_second_distribution_claiming_a_builtin_platform_name_is_reported_not_shadowing(install_plugin) -> None:
    install_plugin("impostor", {"impostor_cpu": IMPOSTOR_CPU}, {"fd.platforms": {"cpu": "impostor_cpu"}})
    message = (
        "distribution 'impostor' declares platform plugin 'cpu', which fd-backends already provides; "
        "uninstall it, or leave it out with FD_PLUGINS"
    )
    with pytest.raises(PluginError) as err:
        load_plugins({})
    assert str(err.value) == message
    listed = load_plugins({}, strict=False)
    cpus = [r for r in listed.records if r.name == "cpu"]
    assert ([r.distribution for r in cpus] == ["fd-backends", "impostor"]
            or sorted(r.distribution for r in cpus) == ["fd-backends", "impostor"])
    builtin = next(r for r in cpus if r.builtin)
    assert listed.platform == "cpu" and builtin.active and builtin.detection.reason.startswith("always available")
    assert next(r for r in cpus if not r.builtin).status == f"failed: {message}"
    assert load_plugins({"FD_PLUGINS": ""}).platform == "cpu"  # leaving the newcomer out resolves it


def test_forcing_a_platform_without_its_hardware_says_so() -> None:
    plugins = load_plugins({"FD_PLATFORM": "cuda"}, strict=False)
    assert plugins.selection == (
        f"forced by FD_PLATFORM=cuda; its hardware is not detected here: paddle is the CPU build (paddlepaddle {version('paddlepaddle')}): "
        "install paddlepaddle-gpu for your CUDA version, see docs/install.md"
    )


def test_forcing_a_platform_the_allow_list_leaves_out_says_so(install_plugin) -> None:
    install_plugin("fake-chip", {"fake_chip": platform_source(priority=5)}, {"fd.platforms": {"fakechip": "fake_chip"}})
    with pytest.raises(PlatformError, match=r"^FD_PLATFORM='fakechip' names a platform that FD_PLUGINS leaves out; add fakechip to FD_PLUGINS"):
        load_plugins({"FD_PLATFORM": "fakechip", "FD_PLUGINS": ""})
