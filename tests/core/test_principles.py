"""Design principles checked on the source: no platform words in fd_core, lazy paddle,
no direct collectives in models, no leaking to_tensor per request."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Not preceded by a letter, so `is_cuda` and `cuda_graph` match but `inputs` (i-npu-ts) does not.
PLATFORM_WORDS = re.compile(
    r"(?<![a-z])(cpu|cuda|iluvatar|nccl|gloo|gpu|xpu|npu|dcu|gcu|mlu|hpu|rocm|metax|maca|custom_device|ascend|corex)",
    re.IGNORECASE,
)


def test_fd_core_names_no_platform_or_device() -> None:
    hits = []
    for path in sorted((ROOT / "fd_core").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PLATFORM_WORDS.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "platform words in fd_core (make it a hook instead):\n" + "\n".join(hits)


def test_the_platform_word_check_can_fail() -> None:
    assert PLATFORM_WORDS.search('if current_platform.is_iluvatar():')
    assert PLATFORM_WORDS.search('backend="GLOO"')
    assert PLATFORM_WORDS.search("mode = 'cuda_graph'")
    assert PLATFORM_WORDS.search('DEFAULT_PLATFORM = "cpu"')
    assert not PLATFORM_WORDS.search("def prefill(self, input_ids)")


def test_fd_models_never_call_collectives_directly() -> None:
    direct = re.compile(r"paddle\.distributed|import paddle\.distributed|from paddle import distributed|\bdist\.")
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in sorted((ROOT / "fd_models").rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert not hits, "fd_models must reduce through the Backend:\n" + "\n".join(hits)


def _imports_paddle(code: str) -> tuple[bool, str]:
    done = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint('PADDLE' if 'paddle' in sys.modules else 'NO-PADDLE', file=sys.stderr)"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr.strip().endswith("PADDLE") and not done.stderr.strip().endswith("NO-PADDLE"), done.stdout


# paddle.to_tensor keeps about 100 bytes a call in Paddle 3.3.1 (fd_core.models.host_tensor): what the models and the
# engine build per request goes through host_tensor; only loading (once a weight) may call it.
TO_TENSOR = re.compile(r"paddle\.to_tensor\(")
LOADING = {"fd_models/layers/params.py"}


def test_models_and_the_engine_build_per_request_tensors_without_to_tensor() -> None:
    paths = [*(ROOT / "fd_models").rglob("*.py"), *(ROOT / "fd_core" / "runtime" / "engine").rglob("*.py")]
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in sorted(paths) if str(p.relative_to(ROOT)) not in LOADING
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if TO_TENSOR.search(line) and not line.lstrip().startswith("#")
    ]
    assert not hits, "paddle.to_tensor per request (use fd_core.models.host_tensor):\n" + "\n".join(hits)
    assert TO_TENSOR.search("x = paddle.to_tensor(patches)") and not TO_TENSOR.search("host_tensor(patches)")


def test_import_fd_core_does_not_import_paddle() -> None:
    imported, _ = _imports_paddle("import fd_core, fd_core.host, fd_core.host.loading, fd_core.host.backend, fd_core.hookspecs")
    assert not imported


def test_fd_plugins_command_does_not_import_paddle() -> None:
    imported, out = _imports_paddle("from fd_core.cli import main\nmain(['plugins'])")
    assert "platform: cpu" in out
    assert not imported


def test_the_lazy_check_can_fail() -> None:
    imported, _ = _imports_paddle("import paddle")
    assert imported


def test_packaging_installs_at_most_one_paddle_build() -> None:
    """Paddle comes only from the `cpu` extra; every other build is installed first, from its own index
    (docs/install.md). All builds ship `paddle`, so never two, never one by default."""
    from importlib.metadata import requires

    paddles = [r for r in requires("fd-backends") or [] if r.split(";")[0].strip().lower().startswith("paddle")]
    assert paddles, "no extra provides PaddlePaddle"
    assert all("extra ==" in r for r in paddles), f"an unconditional Paddle requirement: {paddles}"
    by_extra: dict[str, list[str]] = {}
    for r in paddles:
        by_extra.setdefault(r.split("extra ==")[1].strip().strip("'\""), []).append(r)
    # `gpu` is gone on purpose: PyPI's paddlepaddle-gpu stops at 2.6.2 and an extra cannot name Paddle's index.
    assert set(by_extra) == {"cpu"}, f"Paddle from extras {sorted(by_extra)}: only `cpu` resolves from PyPI"
    assert len(by_extra["cpu"]) == 1 and by_extra["cpu"][0].startswith("paddlepaddle>="), by_extra["cpu"]
