"""What each of two real ranks runs for the cpu platform's shared-memory all-reduce tests
(importable, as spawned ranks need)."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np

SHAPES: tuple[tuple[int, ...], ...] = ((0,), (1,), (1000,), (4, 5, 6), ())
REPEATS = 1000
SMALL_SLOT = 4096


def rank_input(dtype: str, shape: tuple[int, ...], rank: int, case: int) -> np.ndarray:
    """Rank `rank`'s input for one case; every rank can rebuild its peers' inputs for the reference."""
    rng = np.random.default_rng(1000 * case + rank)
    if dtype.startswith("int"):
        return rng.integers(-(1 << 20), 1 << 20, size=shape).astype(dtype)
    values = rng.standard_normal(size=shape) * 100
    return values.astype("float32" if dtype == "bfloat16" else dtype)


def _bits(tensor: Any) -> np.ndarray:
    """The tensor's raw bits (bfloat16 comes out of .numpy() as uint16 already)."""
    array = np.ascontiguousarray(tensor.numpy())
    return array.view(f"u{array.dtype.itemsize}") if array.dtype.kind == "f" else array


def _as_float64(tensor: Any) -> np.ndarray:
    import paddle

    if tensor.dtype == paddle.bfloat16:
        tensor = tensor.astype("float32")
    return tensor.numpy().astype("float64")


def _sums(
    rank: int, world: int, shm_reduce: Callable[[Any], Any], gloo_reduce: Callable[[Any], Any],
) -> list[dict[str, Any]]:
    import paddle

    from fd_plugins.cpu.platform import FD_CAPABILITIES

    cases = []
    for d, dtype in enumerate(FD_CAPABILITIES.dtypes):
        for s, shape in enumerate(SHAPES):
            case = 10 * d + s
            tensor = paddle.to_tensor(rank_input(dtype, shape, rank, case)).astype(dtype)
            twin = paddle.to_tensor(rank_input(dtype, shape, rank, case)).astype(dtype)
            out = shm_reduce(tensor)
            gloo_reduce(twin)
            # The reference sums every rank's input as the dtype holds it, in float64; the error is
            # relative to the sum of magnitudes, so cancellation does not inflate it.
            inputs = [
                _as_float64(paddle.to_tensor(rank_input(dtype, shape, r, case)).astype(dtype)) for r in range(world)
            ]
            want = sum(inputs)
            scale = np.maximum(sum(np.abs(x) for x in inputs), 1.0)
            got = _as_float64(out)
            cases.append(
                {
                    "dtype": dtype,
                    "shape": list(shape),
                    "out_shape": list(out.shape),
                    "out_dtype": str(out.dtype).replace("paddle.", ""),
                    "same_object": out is tensor,
                    "identical_to_gloo": bool(np.array_equal(_bits(out), _bits(twin))),
                    "max_rel_err": float(np.max(np.abs(got - want) / scale)) if got.size else 0.0,
                }
            )
    return cases


def _repeat(rank: int, world: int, reduce: Callable[[Any], Any]) -> dict[str, Any]:
    """Many calls with changing sizes, dtypes and values, ranks drifting apart now and then."""
    import paddle

    # float32[600] and int64[300] are the same bytes: a block freed by one is reused by the other at the
    # same address, which the all-reduce's views of each address must tell apart.
    sizes = (1, 300, 600, 4096)
    dtypes = ("float32", "int64")
    wrong: list[str] = []
    for i in range(REPEATS):
        n, dtype = sizes[i % 4], dtypes[(i // 4) % 2]
        base = np.arange(n) % 5
        value = lambda r, i=i, base=base: (i % 97 + 1) * (r + 1) + base  # noqa: E731 - exact in both dtypes
        if i % 100 == 50 * rank:
            # One rank falls ~1 ms behind: the other must wait in this call, then may run one call ahead.
            time.sleep(0.001)
        out = reduce(paddle.to_tensor(value(rank).astype(dtype)))
        want = sum(value(r) for r in range(world))
        if not np.array_equal(out.numpy(), want.astype(dtype)):
            wrong.append(f"call {i}: {dtype}[{n}] got {out.numpy()[:4].tolist()}..., want {want[:4].tolist()}...")
    from fd_plugins.cpu import shm

    state = shm.group_state(None)
    kept = len(state._views) if state is not None else 0
    return {"calls": REPEATS, "wrong": wrong[:5], "wrong_count": len(wrong), "views_kept": kept,
            "views_max": shm._MAX_VIEWS}


def battery() -> dict[str, Any]:
    """Everything the tests check, on one rank of a two-rank job (one spawn for the whole file)."""
    from fd_core.runtime.ranks.spawn import init_rank

    os.environ.pop("FD_SHM_BUFFER_BYTES", None)
    os.environ.pop("FD_SHM_TIMEOUT", None)
    rank, world = init_rank()
    import paddle
    import paddle.distributed as dist

    from fd_plugins.cpu import platform, shm

    result: dict[str, Any] = {"rank": rank, "world": world}
    shm_world = lambda t: platform.fd_all_reduce(t, None)  # noqa: E731
    gloo_world = lambda t: platform.gloo_all_reduce(t, None)  # noqa: E731

    # Through fd_core, as an engine uses it: selection, the bound all-reduce and the graph vote.
    os.environ["FD_PLATFORM"] = "cpu"
    from fd_core import ModelConfig, ParallelConfig
    from fd_core.host.backend import load_backend

    backend = load_backend(ParallelConfig(tp_size=world, tp_rank=rank))
    summed = backend.all_reduce(paddle.full([8], float(rank + 1)))
    decision = backend.graph_decision(ModelConfig(architecture="probe"))
    result["backend"] = {
        "platform": backend.platform,
        "binding": backend.all_reduce_binding,
        "sum": summed.numpy().tolist(),
        "graph_allowed": decision.allowed,
        "graph_summary": decision.summary(),
    }

    state = shm.group_state(None)
    result["world_group"] = {"usable": state.usable, "reason": state.reason, "slot_bytes": state.slot_bytes}
    result["sums"] = _sums(rank, world, shm_world, gloo_world)

    # Just above the slot: the gloo path, still correct.
    before = dict(state.calls)
    big = paddle.full([state.slot_bytes // 4 + 1], float(rank + 1))
    fits = paddle.full([state.slot_bytes // 4], float(rank + 1))
    shm_world(big)
    after_big = dict(state.calls)
    shm_world(fits)
    result["fallback"] = {
        "big_ok": bool(np.all(big.numpy() == 3.0)),
        "fits_ok": bool(np.all(fits.numpy() == 3.0)),
        "big_path": "fallback" if after_big["fallback"] == before["fallback"] + 1
        and after_big["shm"] == before["shm"] else "shm",
        "fits_path": "shm" if state.calls["shm"] == after_big["shm"] + 1 else "fallback",
    }

    result["repeat"] = _repeat(rank, world, shm_world)

    # A group of its own with a small slot, configured on rank 0 only (rank 0's value is the group's).
    os.environ["FD_SHM_BUFFER_BYTES"] = str(SMALL_SLOT) if rank == 0 else "1"
    small_group = dist.new_group(list(range(world)))
    small = lambda t: platform.fd_all_reduce(t, small_group)  # noqa: E731
    at_slot = small(paddle.full([SMALL_SLOT // 4], float(rank + 1)))
    over_slot = small(paddle.full([SMALL_SLOT // 4 + 1], float(rank + 1)))
    os.environ.pop("FD_SHM_BUFFER_BYTES")
    small_state = shm.group_state(small_group)
    result["small_group"] = {
        "slot_bytes": small_state.slot_bytes,
        "calls": dict(small_state.calls),
        "at_slot_ok": bool(np.all(at_slot.numpy() == 3.0)),
        "over_slot_ok": bool(np.all(over_slot.numpy() == 3.0)),
    }

    # Ranks that report different hosts never use shared memory, and still sum correctly.
    real_host_id = shm._host_id
    shm._host_id = lambda: f"test-host-{rank}"
    try:
        hosts_group = dist.new_group(list(range(world)))
        apart = platform.fd_all_reduce(paddle.full([16], float(rank + 1)), hosts_group)
    finally:
        shm._host_id = real_host_id
    hosts_state = shm.group_state(hosts_group)
    result["different_hosts"] = {
        "usable": hosts_state.usable,
        "reason": hosts_state.reason,
        "calls": dict(hosts_state.calls),
        "sum_ok": bool(np.all(apart.numpy() == 3.0)),
    }

    # FD_SHM_BUFFER_BYTES=0 on rank 0 turns the shared-memory path off for the group.
    os.environ["FD_SHM_BUFFER_BYTES"] = "0"
    off_group = dist.new_group(list(range(world)))
    off = platform.fd_all_reduce(paddle.full([16], float(rank + 1)), off_group)
    os.environ.pop("FD_SHM_BUFFER_BYTES")
    result["buffer_off"] = {"usable": shm.group_state(off_group).usable, "reason": shm.group_state(off_group).reason,
                            "sum_ok": bool(np.all(off.numpy() == 3.0))}

    # A bad setting on one rank raises on every rank, naming it, instead of leaving peers in a collective.
    if rank == 1:
        os.environ["FD_SHM_TIMEOUT"] = "soon"
    bad_group = dist.new_group(list(range(world)))
    try:
        platform.fd_all_reduce(paddle.ones([4]), bad_group)
        result["bad_setting"] = "no error"
    except ValueError as exc:
        result["bad_setting"] = str(exc)
    os.environ.pop("FD_SHM_TIMEOUT", None)


    # A late peer: rank 1 arrives 0.3 s after rank 0, which must sleep (not spin a core) and wake when rank 1 publishes.
    dist.barrier()
    stats = state.stats()
    cpu, wall = time.thread_time(), time.monotonic()
    if rank == 1:
        time.sleep(0.3)
    arrived = time.time()
    late_sum = shm_world(paddle.full([16], float(rank + 1)))
    returned = time.time()
    after = state.stats()
    result["late_peer"] = {
        "cpu_s": time.thread_time() - cpu, "wall_s": time.monotonic() - wall, "arrived": arrived, "returned": returned,
        "slept_s": after["slept_s"] - stats["slept_s"], "waits": after["waits"] - stats["waits"],
        "kernel_sleep": after["kernel_sleep"],
        "sum_ok": bool(np.all(late_sum.numpy() == 3.0)),
    }

    # Last, as it leaves its group out of step: rank 1 skips a call and rank 0 must time out, naming it.
    os.environ["FD_SHM_TIMEOUT"] = "0.3"
    late_group = dist.new_group(list(range(world)))
    platform.fd_all_reduce(paddle.ones([4]), late_group)
    errors: list[str] = []
    waits: list[float] = []
    if rank == 0:
        for _ in range(2):  # the second call must fail at once, not wait again
            start = time.monotonic()
            try:
                platform.fd_all_reduce(paddle.ones([4]), late_group)
                errors.append("no error")
            except RuntimeError as exc:
                errors.append(str(exc))
            waits.append(time.monotonic() - start)
    os.environ.pop("FD_SHM_TIMEOUT")
    dist.barrier()
    result["timeout"] = {"errors": errors, "waits_s": waits}
    return result

