"""A rank's step failing inside Paddle, as `fd run` shows it in one line: the informative line of Paddle's multi-line
static-graph message (not its first, "In transformed code:"), and for a dtype failure the likely kernel or the
platform's claim with the fix, instead of Paddle's raw words alone.

The kernels misbehave only while a graph is captured (Paddle's static mode), as a kernel with a traced path of its
own can: eager checks before the run (the kernel canary) see a correct kernel."""

from __future__ import annotations

import re

from conftest import assert_one_line_error, run_fd

KERNEL = """
import paddle
from fd_core import hookimpl, native_ops


def rms_norm(x, weight, eps):
    out = native_ops.rms_norm(x, weight, eps)
    if paddle.in_dynamic_mode():
        return out
    {captured}


@hookimpl
def fd_register_kernels(register):
    register("rms_norm", rms_norm)
"""

CLAIMS_BFLOAT16 = """
from fd_core import Detection, hookimpl


@hookimpl
def fd_platform_detect():
    return Detection(detected=True, priority=-1, reason="claims bfloat16", device="cpu", dist_backend="gloo",
                     dtypes=("bfloat16", "float32"))


@hookimpl
def fd_all_reduce(tensor, group):
    return tensor
"""


def _kernel(distribution, captured: str):  # type: ignore[no-untyped-def]
    source = KERNEL.format(captured=captured)
    return distribution("fd-traced", {"traced_kernel": source}, {"fd.plugins": {"traced": "traced_kernel"}})


def test_a_kernel_failing_inside_a_capture_is_named_by_its_error_not_paddles_first_line(distribution) -> None:
    site = _kernel(distribution, 'raise ValueError("the traced path cannot run here")')
    done = run_fd(["run", "--tp", "1", "--graph", "on", "--steps", "3"], path=site)
    assert_one_line_error(done, "rank 0 failed: ValueError: the traced path cannot run here; its traceback is in ",
                          exact=False)
    assert "In transformed code" not in done.stderr


def test_a_kernel_returning_another_dtype_is_named_with_the_fix(distribution) -> None:
    site = _kernel(distribution, 'return out.astype("float64")')
    done = run_fd(["run", "--tp", "1", "--graph", "on", "--steps", "3"], path=site)
    assert_one_line_error(done, "rank 0 failed: ", exact=False)
    line = done.error_lines[0]
    assert re.search(r"reached the native \w+ in a float32 run: likely a kernel returning another dtype than it was "
                     r"given \(kernels of plugins in use: rms_norm from 'traced'; [^)]* from 'cpu'\); run fd check cpu; "
                     r"its traceback is in ", line), line


def test_a_platform_claiming_a_dtype_paddle_cannot_run_is_named_with_the_fix(distribution) -> None:
    site = distribution("fd-claims", {"claims_bf16": CLAIMS_BFLOAT16}, {"fd.platforms": {"claims": "claims_bf16"}})
    done = run_fd(["run", "--tp", "1", "--steps", "2"], path=site, env={"FD_PLATFORM": "claims"})
    assert_one_line_error(
        done,
        "Paddle has no bfloat16 matmul here, yet platform 'claims' claims bfloat16 (Detection.dtypes=('bfloat16', "
        "'float32')); pass --dtype float32, or run fd check claims and drop from its Detection.dtypes what it cannot "
        "run; its traceback is in ",
        exact=False,
    )
