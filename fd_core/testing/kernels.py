"""Kernel conformance: every non-native kernel in use against the native op, on generated inputs (the shapes of
every registered architecture and odd sizes, in every dtype the platform computes in), at each count of compute
threads a run may give a kernel. A model run with the kernels against the native ops is the suite's native-path
check (suite.ModelTests). The cases, the comparison and the cache scenarios are the runtime's
(fd_core.runtime.kernel_checks), which the kernel canary of every run goes through too."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from fd_core.detection import Detection
from fd_core.host.loading import PluginSet
from fd_core.kernels import OPS
from fd_core.quantization import quantize
from fd_core.runtime import kernel_checks
from fd_core.runtime.kernel_checks import (
    CACHE_CASES,
    CACHE_OPS,
    ODD_SIZES,
    cache_suspects,
    changed,
    compare,
    copies,
    first_line,
    on_threads,
    read_back_blame,
    read_back_problem,
    run_cache_case,
)

# Compute threads each case runs at (fd_core.kernels.compute_threads): one, and counts a kernel that splits its
# work must divide among, an odd one too.
THREAD_COUNTS = (1, 2, 3)


def _sizes(plugins: PluginSet) -> list[dict[str, int]]:
    """hidden, intermediate, head_dim, heads and kv heads of every registered architecture's preset, then odd ones."""
    from fd_core.runtime.plan import model_config_for

    found = []
    for arch in plugins.registry:
        c = model_config_for(arch, None)
        found.append({"hidden": c.hidden_size, "inter": c.intermediate_size, "head_dim": c.resolved_head_dim,
                      "heads": c.num_attention_heads, "kv": c.num_key_value_heads})
    found.append(dict(ODD_SIZES))
    return [dict(t) for t in {tuple(sorted(d.items())) for d in found}]


def cases(
    op: str, plugins: PluginSet, dtype: str, seed: int = 0, *, grouped: bool = True
) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """(description, arguments) for `op` at every registered architecture's sizes and odd ones, the large cases too:
    random values (not small integers), in `dtype`; `grouped` as kernel_checks.cases'."""
    return kernel_checks.cases(op, _sizes(plugins), dtype, seed, grouped=grouped)


@pytest.mark.usefixtures("started_rank")
class KernelTests:
    """Every kernel a plugin registered for fd's named ops, checked against the native op."""

    def test_the_paged_kv_cache_ops_match_the_native_ones(self, plugins: PluginSet, hardware: Detection) -> None:
        """The platform's (or an extension's) cache ops, in whatever layout its allocate_kv_cache makes, give the native
        ops' attention on random block tables: non-contiguous and shared blocks, partial last blocks, rows of different
        lengths, decode and prefill, every dtype it computes in, eagerly and inside a graph its backend captures."""
        import numpy as np

        from fd_core import native_ops
        from fd_core.host.backend import Backend
        from fd_core.host.kernel_table import KernelTable, Ops

        backend = Backend(plugins)
        ours = {op: backend.ops.providers[op] for op in CACHE_OPS if not backend.ops.native(op)}
        if not ours:
            pytest.skip(f"{plugins.platform}: the paged KV cache runs the native ops (no cache kernel registered)")
        native = Ops(KernelTable(), native_ops)
        who = ", ".join(f"{op} ({p})" for op, p in ours.items())
        failures = []
        kinds: set[str] = set()  # of the failing cases: which op reads them
        graphs = None
        if backend.graph_mode is not None and not any(backend.kernels.uncapturable().get(op) for op in CACHE_OPS):
            graphs = backend.graph_backend()
        dtypes = [d for d in hardware.dtypes if d in OPS["paged_attention"].dtypes]
        if not dtypes:
            pytest.skip(_none_ran(plugins.platform, ours, hardware))
        for dtype in dtypes:
            rtol, atol = OPS["paged_attention"].tolerances[dtype]
            for index, case in enumerate(CACHE_CASES):
                for kv_heads, heads, dim in ((2, 4, 16), (1, 3, 8)):
                    want = run_cache_case(native, case, dtype, kv_heads, heads, dim, seed=index)
                    for where, through in (("eagerly", None), ("in a captured graph", graphs)):
                        # A packed step is never captured (the engine mixes rows only into eager prefill calls).
                        if where != "eagerly" and (through is None or case.packed):
                            continue
                        try:
                            got = run_cache_case(backend.ops, case, dtype, kv_heads, heads, dim, seed=index,
                                                 graphs=through)
                        except Exception as exc:  # noqa: BLE001 - the kernels' own error, reported with its case
                            failures.append(f"{dtype} {case.name}, {heads} heads over {kv_heads}, {where}: raised "
                                            f"{type(exc).__name__}: {exc}")
                            kinds.add(case.kind)
                            continue
                        bad = ~np.isclose(got, want, rtol=rtol, atol=atol) if got.shape == want.shape else None
                        if bad is not None and not bad.any():
                            continue
                        kinds.add(case.kind)
                        if bad is None:
                            failures.append(f"{dtype} {case.name}, {where}: returned {list(got.shape)}, the native "
                                            f"ops {list(want.shape)}")
                        else:
                            error = float(np.nanmax(np.abs(got - want)))
                            failures.append(f"{dtype} {case.name}, {heads} heads over {kv_heads}, {where}: largest "
                                            f"error {error:.3g} (rtol {rtol:g}, atol {atol:g})")
        if failures:
            named = cache_suspects(kinds)
            suspect = named[0] if len(named) == 1 else f"{' or '.join(named)} (every kind of case fails)"
            raise AssertionError(
                f"{suspect}: the paged KV cache ops {who} differ from the native ones: {failures[0]} "
                f"({len(failures)} case(s) in all)\n" + "\n".join(failures[:20])
            )

    def test_read_kv_cache_gives_back_what_write_kv_cache_wrote(self, plugins: PluginSet, hardware: Detection) -> None:
        """The platform's read_kv_cache (contract 1.9), in its cache's layout: every slot of a pool written in a random
        order (its last block and a partial block included) comes back bit for bit, read in another order, in every
        dtype it computes in, reading writes nothing, and writing a few slots again (in calls of one, two and more
        tokens) changes no other slot. A layout of its own without read_kv_cache is skipped: its
        requests cannot be handed to another instance (disaggregation), which nothing else needs."""
        from fd_core.errors import PluginError
        from fd_core.host.backend import Backend

        backend = Backend(plugins)
        ops = backend.ops
        if ops.native("read_kv_cache") and ops.native("allocate_kv_cache") and ops.native("write_kv_cache"):
            pytest.skip(f"{plugins.platform}: the KV cache is read and written by the native ops")
        problems: list[str] = []
        blamed = "read_kv_cache"
        dtypes = [d for d in hardware.dtypes if d in OPS["read_kv_cache"].tolerances]
        if not dtypes:
            pytest.skip(_none_ran(plugins.platform, {"read_kv_cache": ops.providers["read_kv_cache"]}, hardware))
        for dtype in dtypes:
            for index, (kv_heads, dim, blocks, block_size) in enumerate(((2, 16, 9, 4), (1, 8, 4, 16), (3, 64, 3, 64))):
                try:
                    problem = read_back_problem(ops, dtype, kv_heads, dim, blocks, block_size, seed=index)
                except PluginError as exc:
                    pytest.skip(str(exc))
                except Exception as exc:  # noqa: BLE001 - the kernel's own error, reported with its case
                    problem = f"raised {type(exc).__name__}: {first_line(exc)}"
                if problem:
                    blamed = blamed if problems else read_back_blame(problem)  # the first problem's op is named
                    problems.append(f"{dtype}, {kv_heads} kv heads of {dim}, {blocks} blocks of {block_size}: "
                                    f"{problem}")
        who = ops.providers[blamed] if not ops.native(blamed) else ops.providers["allocate_kv_cache"]
        assert not problems, f"{blamed} ({who}): {problems[0]} ({len(problems)} case(s) in all)"

    def test_every_kernel_in_use_matches_the_native_op(self, plugins: PluginSet, hardware: Detection) -> None:
        from fd_core import native_ops
        from fd_core.host.backend import Backend

        backend = Backend(plugins)
        ours = {op: p for op, p in backend.ops.providers.items() if not backend.ops.native(op) and op not in CACHE_OPS}
        if not ours:
            pytest.skip(f"{plugins.platform}: every op runs the native implementation (no kernel registered)")
        failures, unchecked, checked = [], [], 0
        for op, provider in ours.items():
            dtypes = [d for d in hardware.dtypes if d in OPS[op].dtypes]
            unchecked += [f"{op} in {d}" for d in hardware.dtypes if d not in OPS[op].dtypes]
            for dtype in dtypes:
                for what, args in cases(op, plugins, dtype, grouped=backend.ops.written_for(op, "1.6")):
                    # The reference first, on copies: a kernel that writes into its inputs must not change what it is
                    # compared with.
                    try:
                        want = getattr(native_ops, op)(*copies(args))
                    except Exception as exc:  # noqa: BLE001 - fd's own reference failed: said so, with the case
                        failures.append(_reference_failed(op, dtype, what, args, exc))
                        continue
                    for threads in THREAD_COUNTS:
                        at = f" on {threads} compute threads" if threads > 1 else ""
                        before = copies(args)
                        try:
                            got = on_threads(threads, getattr(backend.ops, op), args)
                        except Exception as exc:  # noqa: BLE001 - the kernel's own error, reported with its case
                            failures.append(f"{op} ({provider}) {dtype} {what}{at}: raised {type(exc).__name__}: "
                                            f"{first_line(exc)}")
                            continue
                        checked += 1
                        problem = compare(op, got, want, dtype, args, native_ops) or changed(args, before)
                        if problem:
                            failures.append(f"{op} ({provider}) {dtype} {what}{at}: {problem}")
        # The first line (what `fd check` shows) names each failing op with its first case; every case follows.
        first = {f.split(" ", 1)[0]: f for f in reversed(failures)}
        assert not failures, (
            "; ".join(reversed(first.values())) + f" ({len(failures)} case(s) in all)\n" + "\n".join(failures[:40])
        )
        if not checked:
            # A run of no case is no verdict: fd check exits 3 for it (not 0), as for hardware it does not see.
            pytest.skip(
                f"not verified: {plugins.platform}: no kernel case ran: the ops define no tolerance for "
                f"{', '.join(unchecked)}"
            )


    def test_prepared_weights_give_the_native_results_and_follow_a_reload(
        self, plugins: PluginSet, hardware: Detection
    ) -> None:
        """A kernel with a prepare function, called as the shared layers call it (its weights prepared once), against
        the native op; then the same weight tensors refilled in place with new values (a reload) and prepared
        again: the result must follow the new values (a preparation cached by the tensor's identity does not)."""
        from fd_core import native_ops
        from fd_core.host.backend import Backend

        backend = Backend(plugins)
        ops = backend.ops
        ours = {op: p for op, p in ops.providers.items() if ops.prepares(op)}
        if not ours:
            pytest.skip(f"{plugins.platform}: no kernel in use prepares its weights")
        failures, ran = [], 0
        for op, provider in ours.items():
            for dtype in [d for d in hardware.dtypes if d in OPS[op].dtypes]:
                for what, shared in cases(op, plugins, dtype, grouped=ops.written_for(op, "1.6")):
                    ran += 1
                    # A case's own copies: its reload refills them, and cases share weights (the experts' do).
                    args = copies(shared)
                    for when in ("prepared at load", "after a reload (the same tensors refilled, prepared again)"):
                        if when.startswith("after"):
                            _reload(op, args)
                        try:
                            got = ops.prepared(op)(args[0], *ops.prepare(op, *args[1:]))
                        except Exception as exc:  # noqa: BLE001 - the kernel's own error, reported with its case
                            failures.append(f"{op} ({provider}) {dtype} {what}, {when}: raised "
                                            f"{type(exc).__name__}: {exc}")
                            break
                        try:
                            want = getattr(native_ops, op)(*copies(args))
                        except Exception as exc:  # noqa: BLE001 - fd's own reference failed: said so, with the case
                            failures.append(_reference_failed(op, dtype, what, args, exc))
                            break
                        problem = compare(op, got, want, dtype, args, native_ops)
                        if problem:
                            failures.append(f"{op} ({provider}) {dtype} {what}, {when}: {problem}")
                            break
        assert not failures, failures[0] + f" ({len(failures)} case(s) in all)\n" + "\n".join(failures[:40])
        if not ran:
            pytest.skip(_none_ran(plugins.platform, ours, hardware))


def _none_ran(platform: str, ours: dict[str, str], hardware: Detection) -> str:
    """Why a check of these kernels ran no case: the platform's dtypes are none the ops are checked in. The skip
    reads "not verified", so fd check exits 3 for it, never 0."""
    return (f"not verified: {platform}: no case ran for {', '.join(ours)}: it computes in "
            f"{', '.join(hardware.dtypes)}, and the ops are checked in "
            f"{', '.join(sorted({d for op in ours for d in OPS[op].tolerances}))} only")


def _reference_failed(op: str, dtype: str, what: str, args: tuple[Any, ...], exc: Exception) -> str:
    """A failure of fd's own native op on a case, labelled as such (not the plugin's kernel), with the arguments'
    shapes and dtypes."""
    shown = ", ".join(f"{n}={a.dtype}{list(a.shape)}".replace("paddle.", "") if hasattr(a, "shape") else f"{n}={a!r}"
                      for n, a in zip(OPS[op].args, args, strict=True))
    return (f"{op} {dtype} {what}: fd's native reference (fd_core.native_ops.{op}, not the plugin's kernel) raised "
            f"{type(exc).__name__} on ({shown}): {first_line(exc)}; the op cannot be checked in {dtype} on this "
            f"Paddle build")


def _reload(op: str, args: tuple[Any, ...]) -> None:
    """Refill the op's prepared tensors among `args` in place with other values, as a weight reload does: the same
    tensor objects, new contents."""
    import numpy as np
    import paddle

    given = dict(zip(OPS[op].args, args, strict=True))
    if op == "quant_matmul":
        weight, scales = given["weight"], given["scales"]
        fresh = np.random.default_rng(7).standard_normal((weight.shape[0], args[0].shape[-1])).astype("float32")
        # The case's own grouping kept: scales [N] are per channel, [N, groups] one scale per group of a row.
        group = fresh.shape[1] // scales.shape[1] if len(scales.shape) == 2 else 0
        values, new_scales = quantize(paddle.to_tensor(fresh), given["bits"], group=group)
        paddle.assign(values, output=weight)
        paddle.assign(new_scales, output=scales)
        return
    for name in OPS[op].prepared:
        tensor = given[name]
        # Another sign and scale, the case's conditioning kept: a shift (all weights off zero together) would make the
        # experts' sums cancel, where any two orders of summing differ by more than the tolerance.
        paddle.assign((-1.5 * tensor.astype("float32")).astype(tensor.dtype), output=tensor)

