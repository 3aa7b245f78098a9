"""fd_register_kernels: rms_norm, add_rms_norm and silu_and_mul, each computed another way than fd's native ops, the
paged KV cache in a layout of its own (paged.py), matmul and quant_matmul on weights prepared once at load
(weights.py), moe_experts as dispatch, grouped experts and combine (moe.py), and the sampling penalties on the host
(apply_penalties, contract 1.3) and speculative decoding's acceptance (accept_draft, contract 1.7: speculative.py)."""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

from fd_core import hookimpl
from fd_example_kernels import moe, paged, speculative, weights

# The version of fd's plugin contract this plugin was written for (fd_core.contract).
FD_CONTRACT = "1.9"

_seen: set[str] = set()


def _note(op: str) -> None:
    """The first call of `op` in this process, noted in FD_EXAMPLE_KERNELS_TRACE (a directory) when it is set."""
    _seen.add(op)
    trace = os.environ.get("FD_EXAMPLE_KERNELS_TRACE")
    if trace:
        with open(os.path.join(trace, f"{op}.{os.getpid()}"), "w"):
            pass


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """x * (mean(x^2) + eps)^-1/2 in float32, cast back to x's dtype, times weight."""
    if "rms_norm" not in _seen:
        _note("rms_norm")
    return _normed(x, weight, eps)


def add_rms_norm(x: Any, residual: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """(the norm above of x + residual, x + residual), the sum in x's dtype.

    FD_EXAMPLE_KERNELS_BREAK=add_rms_norm normalises x instead of the sum (a fused kernel reading its input buffer
    before the add): the summed result is right, the normed one is not, and `fd check` fails naming add_rms_norm.
    """
    if "add_rms_norm" not in _seen:
        _note("add_rms_norm")
    summed = x + residual
    return _normed(x if os.environ.get("FD_EXAMPLE_KERNELS_BREAK") == "add_rms_norm" else summed, weight, eps), summed


def _normed(x: Any, weight: Any, eps: float) -> Any:
    import paddle

    x32 = x.astype("float32")
    scale = paddle.pow(paddle.mean(paddle.square(x32), axis=-1, keepdim=True) + eps, -0.5)
    return (x32 * scale).astype(x.dtype) * weight


def silu_and_mul(gate: Any, up: Any) -> Any:
    """Paddle's fused SwiGLU: silu(gate) * up in one kernel."""
    import paddle.nn.functional as F

    if "silu_and_mul" not in _seen:
        _note("silu_and_mul")
    return F.swiglu(gate, up)


def apply_penalties(logits: Any, prompt_mask: Any, output_counts: Any, presence: Any, frequency: Any,
                    repetition: Any) -> Any:
    """The penalties in numpy on the host, where the engine's other logits processing runs.

    FD_EXAMPLE_KERNELS_BREAK=apply_penalties counts the prompt's tokens for the presence penalty too (a kernel that
    reuses the repetition penalty's mask): `fd check` fails naming apply_penalties.
    """
    import numpy as np
    import paddle

    if "apply_penalties" not in _seen:
        _note("apply_penalties")
    x = logits.numpy().astype(np.float32)
    counts = output_counts.numpy()
    present = counts > 0
    seen = prompt_mask.numpy() | present
    if os.environ.get("FD_EXAMPLE_KERNELS_BREAK") == "apply_penalties":
        present = seen
    r = repetition.numpy()[:, None].astype(np.float32)
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x -= frequency.numpy()[:, None].astype(np.float32) * counts + presence.numpy()[:, None].astype(np.float32) * present
    return paddle.to_tensor(x.astype(np.float32))


@hookimpl
def fd_register_kernels(register: Callable[..., None]) -> None:
    register("rms_norm", rms_norm)
    register("add_rms_norm", add_rms_norm)
    register("silu_and_mul", silu_and_mul)
    # The cache's layout is this package's: the ops that make, write and read it come together.
    for op in ("allocate_kv_cache", "write_kv_cache", "read_kv_cache", "paged_attention", "paged_prefill_attention",
               "paged_packed_attention"):
        register(op, _traced(op, getattr(paged, op)))
    # Each weight prepared once when it loads (and again after a reload): the kernels read only the prepared form.
    register("matmul", _traced("matmul", weights.matmul), prepare=weights.prepare_matmul)
    register("quant_matmul", _traced("quant_matmul", weights.quant_matmul), prepare=weights.prepare_quant)
    register("moe_experts", _traced("moe_experts", moe.moe_experts), prepare=moe.prepare_moe)
    register("apply_penalties", apply_penalties)
    register("accept_draft", _traced("accept_draft", speculative.accept_draft))


def _traced(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, noting its first call (as the two kernels above do); the same arguments by name."""

    def kernel(*args: Any) -> Any:
        if op not in _seen:
            _note(op)
        return fn(*args)

    kernel.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    kernel.__name__ = kernel.__qualname__ = op
    kernel.__doc__ = fn.__doc__
    return kernel
