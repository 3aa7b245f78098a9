"""The kernel suite catches plausible near misses, each a kernel an honest vendor could ship by mistake: an RMSNorm
epsilon dropped, 10x or 0.1x off; a rotary table read one position late; attention's scale applied twice; silu
computed as a sigmoid; a fused add-and-norm returning the un-added residual or normalising before the add; GELU's
tanh form for erf's; a mixture of experts ignoring its routing weights, summing one expert, swapping gate and up or
running tokens given weight 0; penalties that forget the prompt, count it for presence, raise a negative logit
or ignore the counts. Each is registered by an extension in this process and must fail the suite's kernel
check, which names its op; honest kernels computed another way pass it."""

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
    "add_rms_norm returning the un-added residual": (
        "add_rms_norm",
        "def kernel(x, residual, weight, eps):\n"
        "    return native_ops.rms_norm(x + residual, weight, eps), residual",
    ),
    "add_rms_norm normalising before the add": (
        "add_rms_norm",
        "def kernel(x, residual, weight, eps):\n"
        "    return native_ops.rms_norm(x, weight, eps), x + residual",
    ),
    "add_rms_norm epsilon dropped": (
        "add_rms_norm",
        "def kernel(x, residual, weight, eps):\n"
        "    return native_ops.add_rms_norm(x, residual, weight, 0.0)",
    ),
    "gelu's tanh form when erf's is asked": (
        "gelu",
        "def kernel(x, approximate):\n"
        "    return native_ops.gelu(x, 'tanh' if approximate == 'none' else approximate)",
    ),
    "quick gelu without its 1.702 (a silu)": (
        "gelu",
        "def kernel(x, approximate):\n"
        "    import paddle.nn.functional as F\n"
        "    return F.silu(x) if approximate == 'sigmoid' else native_ops.gelu(x, approximate)",
    ),
    "moe ignoring the routing weights": (
        "moe_experts",
        "def kernel(x, gate, up, down, chosen, weights):\n"
        "    import paddle\n"
        "    even = paddle.full_like(weights, 1.0 / weights.shape[1])\n"
        "    return native_ops.moe_experts(x, gate, up, down, chosen, even)",
    ),
    "moe summing only each token's first expert": (
        "moe_experts",
        "def kernel(x, gate, up, down, chosen, weights):\n"
        "    return native_ops.moe_experts(x, gate, up, down, chosen[:, :1], weights[:, :1])",
    ),
    "moe with gate and up swapped": (
        "moe_experts",
        "def kernel(x, gate, up, down, chosen, weights):\n"
        "    return native_ops.moe_experts(x, up, gate, down, chosen, weights)",
    ),
    "moe renormalising the weights it is given (zero weights no longer zero)": (
        "moe_experts",
        "def kernel(x, gate, up, down, chosen, weights):\n"
        "    import paddle\n"
        "    total = paddle.clip(paddle.sum(weights, axis=-1, keepdim=True), min=1e-6)\n"
        "    live = (weights != 0).astype(weights.dtype)\n"
        "    # a token whose every weight is 0 is run at even weights: the masked modality's rows come out nonzero\n"
        "    even = (1.0 - live.max(axis=-1, keepdim=True)) / weights.shape[1]\n"
        "    return native_ops.moe_experts(x, gate, up, down, chosen, weights / total + even)",
    ),
    "penalties: repetition on the output's tokens only (the prompt's forgotten)": (
        "apply_penalties",
        "def kernel(logits, prompt_mask, output_counts, presence, frequency, repetition):\n"
        "    return native_ops.apply_penalties(logits, output_counts > 0, output_counts, presence, frequency,\n"
        "                                      repetition)",
    ),
    "penalties: presence counted on the prompt too": (
        "apply_penalties",
        "def kernel(logits, prompt_mask, output_counts, presence, frequency, repetition):\n"
        "    import paddle\n"
        "    out = native_ops.apply_penalties(logits, prompt_mask, output_counts, presence, frequency, repetition)\n"
        "    only_prompt = paddle.logical_and(prompt_mask, output_counts == 0).astype('float32')\n"
        "    return out - presence.reshape([-1, 1]) * only_prompt",
    ),
    "penalties: repetition always dividing (a negative logit raised)": (
        "apply_penalties",
        "def kernel(logits, prompt_mask, output_counts, presence, frequency, repetition):\n"
        "    import paddle\n"
        "    seen = paddle.logical_or(prompt_mask, output_counts > 0)\n"
        "    x = paddle.where(seen, logits / repetition.reshape([-1, 1]), logits)\n"
        "    zero = paddle.ones_like(repetition)\n"
        "    return native_ops.apply_penalties(x, prompt_mask, output_counts, presence, frequency, zero)",
    ),
    "penalties: frequency as a presence (counts ignored)": (
        "apply_penalties",
        "def kernel(logits, prompt_mask, output_counts, presence, frequency, repetition):\n"
        "    return native_ops.apply_penalties(logits, prompt_mask, output_counts, presence + frequency,\n"
        "                                      frequency * 0, repetition)",
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


HONEST = {
    # The add in x's dtype, the norm written out: the op's semantics, not the native code.
    "add_rms_norm": "def kernel(x, residual, weight, eps):\n"
                    "    import paddle\n"
                    "    summed = paddle.add(residual, x)\n"
                    "    s32 = summed.astype('float32')\n"
                    "    scale = paddle.pow(paddle.mean(paddle.square(s32), axis=-1, keepdim=True) + eps, -0.5)\n"
                    "    return (s32 * scale).astype(x.dtype) * weight, summed",
    "gelu": "def kernel(x, approximate):\n"
            "    import math\n"
            "    import paddle\n"
            "    v = x.astype('float32')\n"
            "    if approximate == 'none':\n"
            "        out = 0.5 * v * (1.0 + paddle.erf(v / math.sqrt(2.0)))\n"
            "    elif approximate == 'tanh':\n"
            "        out = 0.5 * v * (1.0 + paddle.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v * v * v)))\n"
            "    else:\n"
            "        out = v / (1.0 + paddle.exp(-1.702 * v))\n"
            "    return out.astype(x.dtype)",
    # Never skips a term of weight 0, always one strategy: each (token, choice) pair as one expert product, summed.
    "moe_experts": "def kernel(x, gate, up, down, chosen, weights):\n"
                   "    import paddle\n"
                   "    import paddle.nn.functional as F\n"
                   "    out = paddle.zeros_like(x)\n"
                   "    for j in range(chosen.shape[1]):\n"
                   "        e = chosen[:, j]\n"
                   "        xs = x.unsqueeze(1)\n"
                   "        g = paddle.matmul(xs, paddle.gather(gate, e), transpose_y=True)\n"
                   "        u = paddle.matmul(xs, paddle.gather(up, e), transpose_y=True)\n"
                   "        y = paddle.matmul(F.silu(g) * u, paddle.gather(down, e), transpose_y=True).squeeze(1)\n"
                   "        out = out + y * weights[:, j:j + 1]\n"
                   "    return out",
    # On the host, one token at a time, as the semantics text reads.
    "apply_penalties": "def kernel(logits, prompt_mask, output_counts, presence, frequency, repetition):\n"
                       "    import numpy as np\n"
                       "    import paddle\n"
                       "    x, mask, counts = logits.numpy().copy(), prompt_mask.numpy(), output_counts.numpy()\n"
                       "    for b in range(x.shape[0]):\n"
                       "        r, f, p = (float(a.numpy()[b]) for a in (repetition, frequency, presence))\n"
                       "        for v in range(x.shape[1]):\n"
                       "            n = int(counts[b, v])\n"
                       "            if mask[b, v] or n:\n"
                       "                x[b, v] = x[b, v] / r if x[b, v] > 0 else x[b, v] * r\n"
                       "            if n:\n"
                       "                x[b, v] = x[b, v] - f * n - p\n"
                       "    return paddle.to_tensor(x.astype(np.float32))",
}


@pytest.mark.parametrize("op", list(HONEST))
def test_an_honest_kernel_computed_another_way_passes_the_kernel_check(install_plugin, op: str) -> None:
    """The suite's cases hold the op to its semantics, not to the native code: a kernel written from the semantics
    text alone, with its own order of operations (and, for moe_experts, no skipping of weight-0 terms), passes."""
    source = (f"from fd_core import hookimpl\n\n\n{HONEST[op]}\n\n\n@hookimpl\ndef fd_register_kernels(register):\n"
              f"    register({op!r}, kernel)\n")
    install_plugin("honest", {"honest_kernels": source}, {"fd.plugins": {"honest": "honest_kernels"}})
    plugins = load_plugins({})
    assert plugins.kernels.chosen(op).plugin == "honest"
    KernelTests().test_every_kernel_in_use_matches_the_native_op(plugins, plugins.detection)


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
