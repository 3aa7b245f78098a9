"""The cpu platform's shared-memory all-reduce on two real ranks (paddle.distributed spawn
over gloo, nothing mocked)."""

from __future__ import annotations

from typing import Any

import pytest

import shm_workers
from fd_plugins.cpu import platform


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    """Both ranks' results of `shm_workers.battery`, from one spawn shared by every test here."""
    from fd_core.runtime.ranks.spawn import spawn_ranks

    return spawn_ranks(shm_workers.battery, (), 2, "gloo")


# --- without ranks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_sums_round_like_paddle(dtype: str) -> None:
    """The float32 sum is rounded to the half type exactly as paddle casts it, special values included."""
    import numpy as np
    import paddle

    from fd_plugins.cpu import shm

    rng = np.random.default_rng(7)
    special = np.array(
        [0.0, -0.0, 1.0, 1.00390625, 1.01171875, 65504.0, 65520.0, 1e-8, 3.0e38, np.inf, -np.inf, np.nan],
        dtype=np.float32
    )
    a = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 1000, special])
    b = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 1000, np.zeros_like(special)])
    halves = [paddle.to_tensor(x).astype(dtype) for x in (a, b)]
    want = (halves[0].astype("float32") + halves[1].astype("float32")).astype(dtype).numpy()
    bits = np.stack([h.numpy() for h in halves])  # bfloat16 comes out as its uint16 bits
    if dtype == "float16":
        out = np.empty(len(a), np.float16)
        shm._sum_half(bits, out)
        got, ref = out.astype(np.float32), want.astype(np.float32)
    else:
        out = np.empty(len(a), np.uint16)
        shm._sum_bf16(bits, out)
        got, ref = shm._bf16_to_f32(out), shm._bf16_to_f32(want)
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    keep = ~np.isnan(ref)
    assert np.array_equal(got[keep], ref[keep]), np.flatnonzero(got[keep] != ref[keep])[:5]


# --- two ranks ----------------------------------------------------------------------------------------


def test_through_fd_core_backend(ranks: list[dict[str, Any]]) -> None:
    for run in ranks:
        b = run["backend"]
        assert b["platform"] == "cpu"
        assert b["binding"] == "direct: cpu.fd_all_reduce", b["binding"]
        assert b["sum"] == [3.0] * 8
        # Static graphs would trace gloo: auto skips them, saying why (--graph on captures anyway).
        assert not b["graph_allowed"] and "cpu skipped (no gain" in b["graph_summary"], b["graph_summary"]
        assert run["world_group"]["usable"], run["world_group"]["reason"]
        assert run["world_group"]["slot_bytes"] == 1 << 20


@pytest.mark.parametrize("dtype", platform.FD_CAPABILITIES.dtypes)
def test_sums_every_shape_identical_to_gloo(ranks: list[dict[str, Any]], dtype: str) -> None:
    tolerance = {"float16": 1e-3, "bfloat16": 1e-2}.get(dtype, 1e-6)
    for run in ranks:
        cases = [c for c in run["sums"] if c["dtype"] == dtype]
        assert [c["shape"] for c in cases] == [list(s) for s in shm_workers.SHAPES]
        for c in cases:
            where = f"rank {run['rank']}: {dtype}{c['shape']}"
            assert c["out_shape"] == c["shape"] and c["out_dtype"] == dtype, where
            assert c["same_object"], f"{where}: not summed in place"
            assert c["identical_to_gloo"], f"{where}: differs from the gloo path"
            assert c["max_rel_err"] <= tolerance, f"{where}: relative error {c['max_rel_err']}"


def test_above_the_slot_falls_back_to_gloo(ranks: list[dict[str, Any]]) -> None:
    for run in ranks:
        f = run["fallback"]
        assert f == {"big_ok": True, "fits_ok": True, "big_path": "fallback", "fits_path": "shm"}, f
        small = run["small_group"]
        # Rank 1 asked for a 1-byte slot; rank 0's 4096 is the group's.
        assert small["slot_bytes"] == shm_workers.SMALL_SLOT
        assert small["calls"] == {"shm": 1, "fallback": 1}
        assert small["at_slot_ok"] and small["over_slot_ok"]


def test_a_thousand_calls_stay_correct(ranks: list[dict[str, Any]]) -> None:
    for run in ranks:
        r = run["repeat"]
        assert r["calls"] == shm_workers.REPEATS
        assert r["wrong_count"] == 0, r["wrong"]
        # The views kept per address stay bounded however many addresses a run passes through.
        assert 0 < r["views_kept"] <= r["views_max"]


def test_ranks_on_different_hosts_always_use_gloo(ranks: list[dict[str, Any]]) -> None:
    for run in ranks:
        d = run["different_hosts"]
        assert not d["usable"] and "different hosts" in d["reason"], d["reason"]
        assert d["calls"] == {"shm": 0, "fallback": 1}
        assert d["sum_ok"]


def test_settings_are_checked_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for run in ranks:
        off = run["buffer_off"]
        assert not off["usable"] and "FD_SHM_BUFFER_BYTES=0" in off["reason"] and off["sum_ok"], off
        assert "rank 1: FD_SHM_TIMEOUT='soon'" in run["bad_setting"], run["bad_setting"]


def test_a_missing_peer_times_out_naming_it(ranks: list[dict[str, Any]]) -> None:
    t = ranks[0]["timeout"]
    assert len(t["errors"]) == 2
    for message in t["errors"]:
        assert "rank(s) 1 " in message and "FD_SHM_TIMEOUT" in message, message
    first, second = t["waits_s"]
    assert 0.25 <= first < 5, first
    assert second < 0.1, "after a timeout the group must fail at once, not wait again"


def test_a_late_peer_is_waited_for_asleep(ranks: list[dict[str, Any]]) -> None:
    """Rank 0 waits 0.3 s for rank 1 without spinning its core, and returns as soon as rank 1 publishes."""
    waiting, late = ranks[0]["late_peer"], ranks[1]["late_peer"]
    assert waiting["sum_ok"] and late["sum_ok"]
    assert waiting["wall_s"] >= 0.25 and waiting["waits"] == 1, waiting
    assert waiting["cpu_s"] < 0.3 * waiting["wall_s"], f"the wait used {waiting['cpu_s']:.3f} s of CPU in {waiting['wall_s']:.3f} s: it spins"
    if waiting["kernel_sleep"]:
        assert waiting["slept_s"] >= 0.2, waiting
    # Woken by the publish (plus scheduling on a busy machine), not by a long timer.
    assert waiting["returned"] - late["arrived"] < 0.2, (waiting, late)


def test_waiter_wakes_at_the_publish_and_returns_at_once_on_a_stale_value() -> None:
    import ctypes
    import threading
    import time

    from fd_plugins.cpu.shm import default_waiter

    waiter = default_waiter()
    if not waiter.kernel:
        pytest.skip("no futex on this machine: the wait sleeps in short slices instead")
    word = ctypes.c_int64(5)
    address = ctypes.addressof(word)
    start = time.monotonic()
    waiter.sleep(address, 4, 5.0)  # the value is no longer 4: no sleep at all
    assert time.monotonic() - start < 0.5

    def publish() -> None:
        time.sleep(0.2)
        word.value = 6
        waiter.wake(address)

    thread = threading.Thread(target=publish)
    start = time.monotonic()
    cpu = time.thread_time()
    thread.start()
    while word.value == 5:  # spurious returns are allowed; the caller re-checks
        waiter.sleep(address, 5, 5.0)
    took, used = time.monotonic() - start, time.thread_time() - cpu
    thread.join()
    assert 0.15 <= took < 2.0, f"woke after {took:.3f} s: the wake did not reach the sleeper (timeout 5 s)"
    assert used < 0.1, f"the sleeper used {used:.3f} s of CPU: it spins"
