"""`fd check` is never a pass unless its checks ran and passed: interrupted (Ctrl-C, SIGTERM, a stop
signal while a check runs inside Paddle) it says so and exits 128 + the signal; without the platform's
hardware it is "not verified" (exit 3) unless --allow-unverified.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import fd_env, left_over, new_marker, run_fd, start_fd

# Notes, from inside the suite, that a check has started a rank (the suite's checks run in started ranks).
STARTED = """
import os

from fd_core import hookimpl


@hookimpl
def fd_rank_start(rank):
    open(os.environ["FDTEST_CHECK_STARTED"], "a").close()
"""


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_fd_check_is_never_a_pass(sig: signal.Signals, code: int, distribution, tmp_path: Path) -> None:
    site = distribution("fd-check-started", {"check_started": STARTED}, {"fd.plugins": {"check_started": "check_started"}})
    started = tmp_path / "started"
    proc, marker = start_fd(["check", "cpu"], site, {"FDTEST_CHECK_STARTED": str(started)})
    # Inside the suite, a check running: a fixed wait was too short on a busy machine (the signal came before the
    # suite, where fd says only that it was terminated).
    deadline = time.monotonic() + 120
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists(), proc.communicate(timeout=60)
    os.killpg(proc.pid, sig) if sig == signal.SIGINT else os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (out, err)
    assert "verdict: interrupted: only the checks listed ran; nothing is verified" in err
    assert "verdict: passed" not in out and "Traceback" not in err
    assert left_over(marker) == []


def test_fd_check_without_the_hardware_is_not_verified() -> None:
    done = run_fd(["check", "cuda"], timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    assert re.search(r"^verdict: not verified: \d+ check\(s\) need cuda's hardware, which is not here$", done.stdout, re.M)
    allowed = run_fd(["check", "cuda", "--allow-unverified"], timeout=300)
    assert allowed.returncode == 0


SIGNALLER = """
import os
import signal
from pathlib import Path

from fd_core import hookimpl
from fd_core.native_ops import silu_and_mul

_calls = 0


def signalling_silu_and_mul(gate, up):
    # The first call (inside a check, in fd check's own process) sends SIGTERM to this process, as a
    # process manager would while Paddle captures a graph; the call must then go on, not be interrupted.
    global _calls
    _calls += 1
    if _calls == 1 and os.getpid() == int(os.environ["FDTEST_CHECK_PID"] or "0"):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # a while of Python, where a raising handler would run
            pass
        Path(os.environ["FDTEST_SIGNALLED"]).write_text("went on")
    return silu_and_mul(gate, up)


@hookimpl
def fd_register_kernels(register):
    register("silu_and_mul", signalling_silu_and_mul)
"""

CHECK = "test_the_engine_generates_what_the_model_computes_without_a_cache"


def test_a_stop_signal_during_a_check_waits_for_the_check_to_end(distribution, tmp_path: Path) -> None:
    """Raised inside Paddle's C++ (a graph being captured in `fd check`'s process), a stop aborted with SIGABRT;
    it is raised between checks instead: the interrupted kernel goes on, and `fd check` exits 143."""
    path = distribution("fd-signaller", {"fd_signaller": SIGNALLER}, {"fd.plugins": {"signaller": "fd_signaller"}})
    flag = tmp_path / "signalled"
    marker = new_marker()
    # The kernel signals its own process only in fd check's (not in a rank): its pid is known once started.
    proc = subprocess.Popen(["sh", "-c", f"FDTEST_CHECK_PID=$$ exec {sys.executable} -m fd_core.cli check cpu -k {CHECK}"],
                            env=fd_env(marker, path, {"FDTEST_SIGNALLED": str(flag)}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, (out, err)
    assert flag.read_text() == "went on", err
    assert "verdict: interrupted: only the checks listed ran; nothing is verified" in err
    assert "Traceback" not in err and "Fatal Python error" not in err
    assert left_over(marker) == []


BROKEN_MODEL = """
from fd_core import Architecture, hookimpl

PRESET = {"architectures": ["BrokenForCausalLM"], "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "vocab_size": 128,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
          "hidden_act": "silu"}


def build(config, ctx):
    raise RuntimeError("a bug of the package's own")


@hookimpl
def fd_register_models(register):
    register(Architecture(name="broken", aliases=("BrokenForCausalLM",), build=build, preset=PRESET,
                          graph_capable=False, reference=""))
"""


def test_a_broken_model_package_fails_its_own_check_not_the_platforms(distribution) -> None:
    """The platform suite runs a third-party package's architectures in a check of their own: its failure names the
    package, and the verdict says the platform's own checks passed."""
    site = distribution("fd-broken-model", {"broken_model": BROKEN_MODEL}, {"fd.models": {"broken": "broken_model"}})
    done = run_fd(["check", "cpu", "-k", "installed_model_packages or kernel_in_use or votes", "--json"], site,
                  timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    rows = {c["check"]: c for c in report["checks"]}
    failed = rows.pop("test_installed_model_packages_run_on_this_platform")
    assert failed["outcome"] == "failed" and failed["third_party"]
    assert "model package 'broken' (architecture 'broken')" in failed["detail"]
    assert "a bug of the package's own" in failed["detail"]
    assert rows and all(r["outcome"] == "passed" and not r["third_party"] for r in rows.values()), rows
    assert report["verdict"] == (
        "failed (1 check(s)): only the checks of third-party model packages failed "
        "(test_installed_model_packages_run_on_this_platform); the platform's own checks passed"
    )


# A platform computing in bfloat16 only, with a kernel for `sample` (checked in float32 only): no case of it can run.
BF16_ONLY = """
from fd_core import Detection, hookimpl, native_ops
from fd_plugins.cpu import platform as _cpu
from fd_plugins.cpu.platform import fd_all_reduce, fd_clean_memory_fragments, fd_graph_backend, fd_graph_eligibility

FD_CAPABILITIES = _cpu.FD_CAPABILITIES


@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=-5, reason="bfloat16 only", device="cpu", dist_backend="gloo",
                     max_ranks=2, dtypes=("bfloat16",))


def sample(logits, temperature, top_k, top_p, uniform):
    return native_ops.sample(logits, temperature, top_k, top_p, uniform)


@hookimpl
def fd_register_kernels(register):
    register("sample", sample)
"""


def test_a_kernel_check_that_ran_no_case_is_not_verified(distribution) -> None:
    """A kernel registered for an op the platform's dtypes give no case of: the check ran nothing, and fd check says
    so and exits 3, never 0 (ggml's test-backend-ops lesson: a run of only unsupported cases must not print OK)."""
    site = distribution("fd-bf16-only", {"bf16_only": BF16_ONLY}, {"fd.platforms": {"bf16_only": "bf16_only"}})
    done = run_fd(["check", "bf16_only", "-k", "every_kernel"], site, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "not verified: bf16_only: no kernel case ran: the ops define no tolerance for sample in bfloat16" in \
        done.stdout, done.stdout
    assert ("verdict: not verified: 1 check(s) could not run here (bf16_only: no kernel case ran: the ops define no "
            "tolerance for sample in bfloat16)") in done.stdout, done.stdout
