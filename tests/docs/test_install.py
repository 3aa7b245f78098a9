"""docs/install.md and README's install section, checked on this machine's Paddle CPU build.

The install commands may name only extras that pyproject.toml defines, and a GPU build only from Paddle's
index (PyPI has no 3.x GPU build). What the page quotes for this machine (`fd plugins`, the forced
`fd run`, paddle's own checks) is run for real and compared. The NVIDIA and Iluvatar `fd plugins` excerpts
and the wrong-build table are produced by the real command and detection with the device queries and
package metadata substituted: none of this runs on a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable

import paddle
import pytest

from fakedist import listing, run_fd
from fd_plugins.cuda import build
from fd_plugins.cuda import platform as cuda
from fd_plugins.iluvatar import platform as iluvatar

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "install.md"
README = ROOT / "README.md"
# The Paddle version the page's excerpts were taken with; compared as "whatever is installed".
DOC_PADDLE_VERSION = "3.3.1"
PADDLE_VERSION = version("paddlepaddle")

CUDA_REASON = f"paddle is the CPU build (paddlepaddle {PADDLE_VERSION}): install paddlepaddle-gpu for your CUDA version, see docs/install.md"
ILUVATAR_REASON = (
    f"paddle-iluvatar-gpu is not installed and paddle is the CPU build (paddlepaddle {PADDLE_VERSION}): "
    "Iluvatar GPUs need Paddle's CPU build (paddlepaddle) plus its paddle-iluvatar-gpu custom-device plugin, see docs/install.md"
)
REASONS = {"cuda": CUDA_REASON, "iluvatar": ILUVATAR_REASON}


# --- the extras and indexes the install commands name -------------------------------------------------

# `.[cpu,test]` or `fd-backends[cpu]`: the extras of this package, in a pip command.
_EXTRAS = re.compile(r"(?:(?<=[\s'\"])\.|fd-backends)\[([^\]]*)\]")


def defined_extras() -> set[str]:
    """The extras pyproject.toml defines (read from the file: installed metadata can lag behind it)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def install_lines(text: str) -> list[str]:
    """Every line of `text` (code blocks and inline code alike) that runs `pip install`."""
    return [line for line in text.splitlines() if re.search(r"\bpip3? install\b", line)]


def named_extras(text: str) -> set[str]:
    return {e.strip() for line in install_lines(text) for group in _EXTRAS.findall(line) for e in group.split(",")}


def gpu_installs_off_paddles_index(text: str) -> list[str]:
    """paddlepaddle-gpu install commands that would ask PyPI (which stops at 2.6.2) for it; a --dry-run
    is the page recording that check, not an instruction."""
    return [
        line for line in install_lines(text)
        if "paddlepaddle-gpu" in line and "--dry-run" not in line and not re.search(r"(-i|--index-url)\s+https://www\.paddlepaddle\.org\.cn/packages/", line)
    ]


@pytest.mark.parametrize("page", [README, DOC], ids=lambda p: p.name)
def test_install_commands_name_only_extras_that_pyproject_defines(page: Path) -> None:
    named = named_extras(page.read_text())
    assert "cpu" in named, f"{page.name}: no install command with the cpu extra was found (is the parser blind?)"
    assert named <= defined_extras(), f"{page.name} installs extras pyproject.toml does not define: {sorted(named - defined_extras())}"


@pytest.mark.parametrize("page", [README, DOC], ids=lambda p: p.name)
def test_gpu_builds_are_installed_from_paddles_index(page: Path) -> None:
    text = page.read_text()
    assert any("paddlepaddle-gpu" in line for line in install_lines(text)), f"{page.name} gives no GPU install command"
    assert not gpu_installs_off_paddles_index(text)


def test_the_command_checks_catch_a_missing_extra_and_a_pypi_gpu_build() -> None:
    """The checks above, on a deliberately broken README: the extra this issue removed, and PyPI's GPU build."""
    broken = README.read_text() + "\n```sh\npip install 'fd-backends[gpu]'\npip install -e '.[cpu,cuda12]'\n```\n"
    assert named_extras(broken) - defined_extras() == {"gpu", "cuda12"}
    assert gpu_installs_off_paddles_index("python -m pip install 'paddlepaddle-gpu>=3.0'\n")
    assert not gpu_installs_off_paddles_index("python -m pip uninstall paddlepaddle-gpu\n")


# --- detection on this CPU build ----------------------------------------------------------------------


def test_detection_here_names_the_cpu_build_and_what_each_gpu_platform_needs() -> None:
    """The plugins' real detection, in this process: this machine has Paddle's CPU build and no plugin."""
    assert not paddle.is_compiled_with_cuda()  # what "the CPU build" claims
    assert paddle.device.get_all_custom_device_type() == []
    for name, plugin in (("cuda", cuda), ("iluvatar", iluvatar)):
        answer = plugin.fd_platform_detect()
        assert not answer.detected and answer.reason == REASONS[name]


def test_fd_plugins_says_why_cuda_and_iluvatar_are_not_detected() -> None:
    as_json = run_fd(["plugins", "--json"])
    assert as_json.returncode == 0, as_json.stderr
    report = {p["name"]: p for p in json.loads(as_json.stdout)["plugins"]}
    text = run_fd(["plugins"])
    assert text.returncode == 0, text.stderr
    rows = listing(text.stdout)["platform plugins"]
    for name, reason in REASONS.items():
        assert report[name]["detection"]["reason"] == reason
        assert f"not active: not detected: {reason} hooks:" in rows[name]


@pytest.mark.parametrize("platform", ["cuda", "iluvatar"])
def test_a_forced_platform_on_the_cpu_build_fails_in_one_line_with_the_same_advice(platform: str) -> None:
    done = run_fd(["run"], env={"FD_PLATFORM": platform})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"fd: error: platform {platform!r} is selected but its hardware is not here ({REASONS[platform]}); "
        "unset FD_PLATFORM or run on that hardware"
    ]
    assert done.stdout == ""


# --- what the page quotes -----------------------------------------------------------------------------


def sections(text: str) -> dict[str, str]:
    """Each `## ` section of the page by its title."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def quoted_runs(section: str) -> list[tuple[str, str]]:
    """(command, output) for each sh block the page follows directly with the text block it prints."""
    block = r"((?:(?!```).)*?)```"  # a block's body: never across a fence
    return re.findall(r"```sh\n" + block + r"\s*```text\n" + block, section, re.S)


def normal(text: str, paddle_version: str) -> str:
    """Whitespace collapsed (fd wraps at 100 columns), this machine's Paddle version and core count masked."""
    text = text.replace(paddle_version, "<paddle>")
    return " ".join(re.sub(r"\(\d+ cores\)", "(<n> cores)", text).split())


def assert_quoted(output: str, quoted: str, command: str) -> None:
    """Every run of lines the page quotes (runs are separated by '...') is in the real output."""
    got = normal(output, PADDLE_VERSION)
    for chunk in re.split(r"^\.\.\.$", quoted, flags=re.M):
        want = normal(chunk, DOC_PADDLE_VERSION)
        if want:
            assert want in got, f"$ {command}\nthe page quotes:\n{chunk}\nwhich it does not print:\n{output}"
    if quoted.startswith("platform:"):
        assert got.startswith(normal(quoted.split("\n")[0], DOC_PADDLE_VERSION)), output


def run_here(command: str) -> str:
    """`command` in bash, with this environment's `bin` first on PATH and no FD_ settings. Never an
    install: that would change the environment the other tests run in."""
    assert not re.search(r"\bpip3?\b", command), f"the page's quoted outputs must not come from pip: {command!r}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


def simulated_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """paddlepaddle-gpu installed and two H100s, as far as the cuda plugin can tell; no GPU is used."""
    monkeypatch.setattr(cuda, "installed", lambda name: {"paddlepaddle-gpu": "3.2.1"}.get(name))
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(paddle.device.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    # The memory each device reports (80 GiB, none reserved by this process).
    monkeypatch.setattr(paddle.device.cuda, "get_device_properties",
                        lambda index=0: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(paddle.device.cuda, "memory_reserved", lambda index=0: 0)


def simulated_iluvatar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Iluvatar plugin installed and two devices, as far as the iluvatar plugin can tell; none is used."""
    monkeypatch.setattr(iluvatar, "installed", lambda name: {"paddle-iluvatar-gpu": "3.1.1"}.get(name))
    monkeypatch.setattr(paddle, "is_compiled_with_custom_device", lambda kind: kind == "iluvatar_gpu")
    monkeypatch.setattr(paddle.device, "get_available_custom_device", lambda: ["iluvatar_gpu:0", "iluvatar_gpu:1"])
    monkeypatch.setattr(paddle.device.custom_device, "get_device_properties",
                        lambda name=None: types.SimpleNamespace(total_memory=32 * 2**30))
    monkeypatch.setattr(paddle.device.custom_device, "memory_reserved", lambda name=None: 0)


# How each section's quoted outputs are produced: run here for real, or `fd plugins` with a device simulated.
HOW: dict[str, Callable[[pytest.MonkeyPatch], None] | None] = {
    "CPU": None,
    "NVIDIA GPUs": simulated_cuda,
    "Iluvatar GPUs": simulated_iluvatar,
    "Another vendor's build": None,
    "When the build is the wrong one": None,
}


def test_every_quoted_output_has_a_way_to_check_it() -> None:
    quoting = {title for title, body in sections(DOC.read_text()).items() if quoted_runs(body)}
    assert quoting <= set(HOW), f"sections quoting output with no check in HOW: {sorted(quoting - set(HOW))}"
    assert sum(len(quoted_runs(body)) for body in sections(DOC.read_text()).values()) >= 8


@pytest.mark.parametrize("title", list(HOW))
def test_the_page_quotes_what_fd_and_paddle_print(
    title: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Sections without a simulation run for real here; NVIDIA and Iluvatar render `fd plugins` in this
    process with the device queries substituted (not on the hardware)."""
    runs = quoted_runs(sections(DOC.read_text())[title])
    assert runs, f"section {title!r} quotes no output"
    simulate = HOW[title]
    for command, quoted in runs:
        command = command.strip()
        if simulate is None:
            if "fd-checked-allreduce" in quoted:
                _require_example_plugin()
            assert_quoted(run_here(command), quoted, command)
            continue
        assert command == "fd plugins", f"only `fd plugins` can be simulated, not {command!r}"
        from fd_core.cli import main

        with monkeypatch.context() as patch:
            simulate(patch)
            assert main(["plugins"]) == 0
        assert_quoted(capsys.readouterr().out, quoted, command)


def _require_example_plugin() -> None:
    try:
        version("fd-checked-allreduce")
    except PackageNotFoundError:
        pytest.skip("fd-checked-allreduce is not installed: pip install ./examples/fd-checked-allreduce")


def _masked(reason: str) -> str:
    return re.sub(r"\b\d+\.\d+\.\d+\w*", "<version>", reason)


def _detected_by_state(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The reason for each wrong-build state the page's table lists, versions masked; metadata and
    device queries substituted, nothing runs on a device."""
    reasons = []
    real_find_spec = importlib.util.find_spec
    states: list[tuple[object, dict[str, str], Callable[[pytest.MonkeyPatch], None]]] = [
        (cuda, {"paddlepaddle-gpu": "3.2.1", "paddlepaddle": "3.3.1"}, lambda p: None),
        (cuda, {"paddlepaddle-gpu": "3.2.1"}, lambda p: p.setattr(paddle, "is_compiled_with_cuda", lambda: False)),
        (cuda, {"paddlepaddle-gpu": "3.2.1"}, lambda p: (p.setattr(paddle, "is_compiled_with_cuda", lambda: True),
                                                         p.setattr(paddle.device.cuda, "device_count", lambda: 0))),
        (cuda, {}, lambda p: (p.setattr(build, "installed", lambda name: None),
                              p.setattr(importlib.util, "find_spec",
                                        lambda name, *a: None if name == "paddle" else real_find_spec(name, *a)))),
        (iluvatar, {"paddle-iluvatar-gpu": "3.1.1"},
         lambda p: p.setattr(paddle, "is_compiled_with_custom_device", lambda kind: False)),
        (iluvatar, {"paddle-iluvatar-gpu": "3.1.1"},
         lambda p: (p.setattr(paddle, "is_compiled_with_custom_device", lambda kind: True),
                    p.setattr(paddle.device, "get_available_custom_device", lambda: []))),
    ]
    for plugin, installed, arrange in states:
        with monkeypatch.context() as patch:
            patch.setattr(plugin, "installed", lambda name, installed=installed: installed.get(name))
            arrange(patch)
            answer = plugin.fd_platform_detect()  # type: ignore[attr-defined]
        assert not answer.detected
        reasons.append(f"{plugin.__name__.split('.')[1]}: `{_masked(answer.reason)}`")
    return reasons


def test_the_wrong_build_table_says_what_detection_says(monkeypatch: pytest.MonkeyPatch) -> None:
    table = sections(DOC.read_text())["When the build is the wrong one"]
    for cell in _detected_by_state(monkeypatch):
        assert cell in table, f"docs/install.md's table lacks: {cell}"
