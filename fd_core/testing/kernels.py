"""Kernel conformance: every non-native kernel in use against the native op, on generated inputs (the shapes of
every registered architecture and odd sizes, in every dtype the platform computes in), at each count of compute
threads a run may give a kernel. A model run with the kernels against the native ops is the suite's native-path
check (suite.ModelTests)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from fd_core.detection import Detection
from fd_core.host.loading import PluginSet
from fd_core.kernels import OPS, compute_threads, set_compute_threads

ODD = 13  # a size no vector unit divides
# Compute threads each case runs at (fd_core.kernels.compute_threads): one, and counts a kernel that splits its
# work must divide among, an odd one too.
THREAD_COUNTS = (1, 2, 3)
# A decode step's one-row product at a published model's size: large enough for a kernel to split it across threads.
LARGE = 1024


def _sizes(plugins: PluginSet) -> list[dict[str, int]]:
    """hidden, intermediate, head_dim, heads and kv heads of every registered architecture's preset, then odd ones."""
    from fd_core.runtime.plan import model_config_for

    found = []
    for arch in plugins.registry:
        c = model_config_for(arch, None)
        found.append({"hidden": c.hidden_size, "inter": c.intermediate_size, "head_dim": c.resolved_head_dim,
                      "heads": c.num_attention_heads, "kv": c.num_key_value_heads})
    found.append({"hidden": ODD, "inter": 2 * ODD + 1, "head_dim": 6, "heads": 6, "kv": 2})
    return [dict(t) for t in {tuple(sorted(d.items())) for d in found}]


def cases(op: str, plugins: PluginSet, dtype: str, seed: int = 0) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """(description, arguments) for `op`: random values (not small integers), in `dtype`."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(seed)

    def t(*shape: int, kind: Any = dtype) -> Any:
        return paddle.to_tensor(rng.standard_normal(shape).astype("float32")).astype(kind)

    for s in _sizes(plugins):
        h, d, heads, kv = s["hidden"], s["head_dim"], s["heads"], s["kv"]
        if op == "rms_norm":
            norms: tuple[tuple[int, ...], ...] = ((1, 1, h), (2, 5, h), (3, heads, d))
            for shape in norms:
                yield f"x{list(shape)}", (t(*shape), t(shape[-1]), 1e-6)
        elif op == "silu_and_mul":
            shapes: tuple[tuple[int, ...], ...] = ((1, 1, s["inter"]), (2, 5, s["inter"]), (7, 1, 1, ODD))
            for shape in shapes:
                yield f"gate{list(shape)}", (t(*shape), t(*shape))
        elif op == "rotary_embedding":
            for layout in ("half", "interleaved"):
                for batch, length in ((1, 1), (2, 5)):
                    angles = rng.uniform(-20, 20, (length, d // 2)).astype("float32")
                    cos, sin = paddle.to_tensor(np.cos(angles)), paddle.to_tensor(np.sin(angles))
                    yield f"x[{batch}, {heads}, {length}, {d}] {layout}", (t(batch, heads, length, d), cos, sin, layout)
                    # As the attention layer passes it: a transpose of [B, S, heads, d].
                    yield (f"x[{batch}, {heads}, {length}, {d}] {layout} (a transposed view)",
                           (t(batch, length, heads, d).transpose([0, 2, 1, 3]), cos, sin, layout))
                    # As the decoder passes the tables: one per row [B, 1, S, d/2] (rows at their own positions).
                    rows = rng.uniform(-20, 20, (batch, 1, length, d // 2)).astype("float32")
                    yield (f"x[{batch}, {heads}, {length}, {d}] {layout}, "
                           f"tables per row [{batch}, 1, {length}, {d // 2}]",
                           (t(batch, heads, length, d), paddle.to_tensor(np.cos(rows)), paddle.to_tensor(np.sin(rows)),
                            layout))
        elif op == "attention":
            for batch, length, total in ((1, 5, 5), (2, 1, 9), (1, 3, 11), (2, 4, 4)):
                # Causal over the last `length` of `total` positions: what prefill (length == total) and decode pass.
                offset = total - length
                allowed = np.arange(total)[None, :] <= offset + np.arange(length)[:, None]
                mask = paddle.to_tensor(np.where(allowed, 0.0, -np.inf).astype("float32"))
                yield (f"q[{batch}, {heads}, {length}, {d}] kv[{batch}, {kv}, {total}, {d}]",
                       (t(batch, heads, length, d), t(batch, kv, total, d), t(batch, kv, total, d), mask))
                # k and v as the layer passes them: the first `total` positions of a head-major cache [B, kv, T, d].
                cache_k, cache_v = t(batch, kv, total + 3, d), t(batch, kv, total + 3, d)
                yield (f"q[{batch}, {heads}, {length}, {d}] kv views of a cache [{batch}, {kv}, {total + 3}, {d}]",
                       (t(batch, heads, length, d), cache_k[:, :, :total], cache_v[:, :, :total], mask))
                # The mask as the decoder passes it: each row's own [B, 1, 1, S, T], a large negative number where
                # masked, row b's first b slots masked too (its left padding in a batch of unequal prompts).
                padded = np.stack([allowed & (np.arange(total)[None, :] >= b) for b in range(batch)])[:, None, None]
                rows_mask = paddle.to_tensor(np.where(padded, 0.0, -1e9).astype("float32"))
                yield (f"q[{batch}, {heads}, {length}, {d}] kv[{batch}, {kv}, {total}, {d}], "
                       f"mask per row [{batch}, 1, 1, {length}, {total}]",
                       (t(batch, heads, length, d), t(batch, kv, total, d), t(batch, kv, total, d), rows_mask))
            yield f"q[1, {heads}, 4, {d}] no mask", (t(1, heads, 4, d), t(1, kv, 4, d), t(1, kv, 4, d), None)
        elif op == "matmul":
            inter = s["inter"]
            yield f"x[1, 1, {h}] @ w[{h}, {inter}]", (t(1, 1, h), t(h, inter), False)
            yield f"x[2, 5, {h}] @ w[{h}, {inter}]", (t(2, 5, h), t(h, inter), False)
            # The LM head's: hidden [B, H] @ [H, vocab / tp]
            yield f"x[1, {h}] @ w[{h}, {inter}]", (t(1, h), t(h, inter), False)
            yield f"x[1, {h}] @ w[{inter}, {h}]^T", (t(1, h), t(inter, h), True)
            yield f"x[3, 1, {inter}] @ w[{h}, {inter}]^T", (t(3, 1, inter), t(h, inter), True)
        elif op == "sample":
            vocab = 50 + s["hidden"]
            for temperature, top_k, top_p in (
                (0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.95)
            ):
                yield (f"logits[4, {vocab}] temperature={temperature} top_k={top_k} top_p={top_p}",
                       (t(4, vocab, kind="float32") * 3, temperature, top_k, top_p, rng.random(4).tolist()))
    if op == "matmul":
        # One row against a weight of the size a real model's decode step multiplies by (4.2 M elements: 8 MiB in a
        # 16-bit dtype, 16 MiB in float32), odd sizes.
        yield f"x[1, 1, {LARGE}] @ w[{LARGE}, {4 * LARGE + ODD}]", (t(1, 1, LARGE), t(LARGE, 4 * LARGE + ODD), False)
        yield (f"x[1, 1, {4 * LARGE + ODD}] @ w[{4 * LARGE + ODD}, {LARGE}]",
               (t(1, 1, 4 * LARGE + ODD), t(4 * LARGE + ODD, LARGE), False))
        yield f"x[1, {LARGE}] @ w[{LARGE}, {4 * LARGE + ODD}]", (t(1, LARGE), t(LARGE, 4 * LARGE + ODD), False)
        yield f"x[1, {LARGE}] @ w[{4 * LARGE + ODD}, {LARGE}]^T", (t(1, LARGE), t(4 * LARGE + ODD, LARGE), True)


def _numpy(value: Any) -> Any:
    import numpy as np

    return np.asarray(
        value.astype("float32").numpy() if hasattr(value, "astype") and hasattr(value, "numpy") else value,
        dtype=np.float64,
    )


def compare(op: str, got: Any, want: Any, dtype: str, args: tuple[Any, ...], native: Any) -> str | None:
    """None when `got` matches the native result `want` at the op's tolerance, else what differs."""
    import numpy as np

    if op == "sample":
        got, want = list(got), list(want)
        if got == want:
            return None
        # A draw exactly at a boundary of the cumulative distribution may fall either way.
        logits, temperature, top_k, top_p, uniform = args
        if len(got) != len(want):
            return f"returned {len(got)} tokens for {len(want)} rows"
        for b, (g, w) in enumerate(zip(got, want, strict=True)):
            if g != w:
                near = {native.sample(logits, temperature, top_k, top_p,
                                      [min(max(u + e, 0.0), 1.0 - 1e-12) for u in uniform])[b]
                        for e in (-1e-6, 1e-6)}
                if g not in near:
                    return f"row {b} chose token {g}, the native op {w}"
        return None
    if tuple(got.shape) != tuple(want.shape) or str(got.dtype) != str(want.dtype):
        return f"returned {got.dtype}{list(got.shape)}, the native op {want.dtype}{list(want.shape)}"
    rtol, atol = OPS[op].tolerances[dtype]
    a, b = _numpy(got), _numpy(want)
    bad = ~np.isclose(a, b, rtol=rtol, atol=atol) | (np.isfinite(a) != np.isfinite(b))
    if not bad.any():
        return None
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    error = float(np.nanmax(np.abs(a - b)))
    return (
        f"largest error {error:.3g} (rtol {rtol:g}, atol {atol:g}); "
        f"first difference at {list(index)}: {a[index]:.6g}, native {b[index]:.6g}"
    )


class KernelTests:
    """Every kernel a plugin registered for fd's named ops, checked against the native op."""

    def test_every_kernel_in_use_matches_the_native_op(self, plugins: PluginSet, hardware: Detection) -> None:
        from fd_core import native_ops
        from fd_core.host.backend import Backend

        backend = Backend(plugins)
        ours = {op: p for op, p in backend.ops.providers.items() if not backend.ops.native(op)}
        if not ours:
            pytest.skip(f"{plugins.platform}: every op runs the native implementation (no kernel registered)")
        failures, unchecked, checked = [], [], 0
        for op, provider in ours.items():
            dtypes = [d for d in hardware.dtypes if d in OPS[op].dtypes]
            unchecked += [f"{op} in {d}" for d in hardware.dtypes if d not in OPS[op].dtypes]
            for dtype in dtypes:
                for what, args in cases(op, plugins, dtype):
                    # The reference first, on copies: a kernel that writes into its inputs must not change what it is
                    # compared with.
                    want = getattr(native_ops, op)(*_copies(args))
                    for threads in THREAD_COUNTS:
                        at = f" on {threads} compute threads" if threads > 1 else ""
                        before = _copies(args)
                        try:
                            got = _on_threads(threads, getattr(backend.ops, op), args)
                        except Exception as exc:  # noqa: BLE001 - the kernel's own error, reported with its case
                            failures.append(f"{op} ({provider}) {dtype} {what}{at}: raised {type(exc).__name__}: {exc}")
                            continue
                        checked += 1
                        problem = compare(op, got, want, dtype, args, native_ops) or _changed(args, before)
                        if problem:
                            failures.append(f"{op} ({provider}) {dtype} {what}{at}: {problem}")
        # The first line (what `fd check` shows) names each failing op with its first case; every case follows.
        first = {f.split(" ", 1)[0]: f for f in reversed(failures)}
        assert not failures, (
            "; ".join(reversed(first.values())) + f" ({len(failures)} case(s) in all)\n" + "\n".join(failures[:40])
        )
        if not checked:
            pytest.skip(
                f"{plugins.platform}: no kernel case could be checked: the ops define no tolerance for "
                f"{', '.join(unchecked)}"
            )


def _on_threads(threads: int, kernel: Any, args: tuple[Any, ...]) -> Any:
    """kernel(*args) with compute_threads() at `threads`, as the engine sets it for a phase."""
    held = compute_threads()
    set_compute_threads(threads)
    try:
        return kernel(*args)
    finally:
        set_compute_threads(held)


def _copies(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if hasattr(a, "clone") else a for a in args)


def _changed(args: tuple[Any, ...], before: tuple[Any, ...]) -> str | None:
    """Which input the kernel wrote into, if any (the ops are pure: inputs must come back as they were)."""
    import numpy as np

    for index, (now, then) in enumerate(zip(args, before, strict=True)):
        if hasattr(now, "numpy") and not np.array_equal(_numpy(now), _numpy(then), equal_nan=True):
            return f"the kernel wrote into its argument {index + 1}"
    return None
