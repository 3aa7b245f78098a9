"""The kernel suite catches plausible near misses, each a kernel an honest vendor could ship by mistake: an RMSNorm
epsilon dropped, 10x or 0.1x off; a rotary table read one position late; attention's scale applied twice; silu
computed as a sigmoid. Each is registered by an extension in this process and must fail the suite's kernel check,
which names its op."""

from __future__ import annotations

import re

import pytest

from fd_core.host.loading import load_plugins
from fd_core.testing import KernelTests

NEAR_MISSES = {
    "rms_norm epsilon dropped": ("rms_norm", "def kernel(x, weight, eps):\n    return native_ops.rms_norm(x, weight, 0.0)"),
    "rms_norm epsilon 10x": ("rms_norm", "def kernel(x, weight, eps):\n    return native_ops.rms_norm(x, weight, eps * 10)"),
    "rms_norm epsilon 0.1x": ("rms_norm", "def kernel(x, weight, eps):\n    return native_ops.rms_norm(x, weight, eps / 10)"),
    "rotary one position late": (
        "rotary_embedding",
        "def kernel(x, cos, sin, layout):\n"
        "    import paddle\n"
        "    late = lambda t: paddle.concat([t[..., 1:, :], t[..., -1:, :]], axis=-2)\n"
        "    return native_ops.rotary_embedding(x, late(cos), late(sin), layout)",
    ),
    "attention scale applied twice": (
        "attention",
        "def kernel(q, k, v, mask):\n"
        "    return native_ops.attention(q / q.shape[-1] ** 0.5, k, v, mask)",
    ),
    "silu as a sigmoid": (
        "silu_and_mul",
        "def kernel(gate, up):\n    import paddle.nn.functional as F\n    return F.sigmoid(gate) * up",
    ),
}


@pytest.mark.parametrize("miss", list(NEAR_MISSES))
def test_a_near_miss_kernel_fails_the_kernel_check_naming_its_op(install_plugin, miss: str) -> None:
    op, body = NEAR_MISSES[miss]
    source = (f"from fd_core import hookimpl, native_ops\n\n\n{body}\n\n\n@hookimpl\ndef fd_register_kernels(register):\n"
              f"    register({op!r}, kernel)\n")
    install_plugin("near-miss", {"near_miss": source}, {"fd.plugins": {"near-miss": "near_miss"}})
    plugins = load_plugins({})
    assert plugins.kernels.chosen(op).plugin == "near-miss"
    with pytest.raises(AssertionError) as failed:
        KernelTests().test_every_kernel_in_use_matches_the_native_op(plugins, plugins.detection)
    assert str(failed.value).startswith(f"{op} (near-miss) float32 "), str(failed.value)[:300]


def test_a_failure_of_fds_own_reference_is_labelled_as_such(install_plugin) -> None:
    """Paddle's CPU build has no bfloat16 silu: checked as a platform computing in bfloat16, the case fails as fd's
    reference, naming the op, the shapes and the dtypes, not as the plugin's kernel."""
    from fd_core import Detection

    source = ("from fd_core import hookimpl, native_ops\n\n\n@hookimpl\ndef fd_register_kernels(register):\n"
              "    register('silu_and_mul', lambda gate, up: native_ops.silu_and_mul(gate, up))\n")
    install_plugin("honest-silu", {"honest_silu": source}, {"fd.plugins": {"honest-silu": "honest_silu"}})
    plugins = load_plugins({})
    bfloat16 = Detection(detected=True, reason="emulated", dtypes=("bfloat16",))
    with pytest.raises(AssertionError) as failed:
        KernelTests().test_every_kernel_in_use_matches_the_native_op(plugins, bfloat16)
    # (The cpu platform's own kernels have no bfloat16 path either: those cases fail as the kernels' own.)
    assert re.search(
        r"silu_and_mul bfloat16 gate\[[0-9, ]+\]: fd's native reference \(fd_core\.native_ops\.silu_and_mul, not the "
        r"plugin's kernel\) raised RuntimeError on \(gate=bfloat16\[[0-9, ]+\], up=bfloat16\[[0-9, ]+\]\): .*; the op "
        r"cannot be checked in bfloat16 on this Paddle build", str(failed.value)), str(failed.value)[:2000]
