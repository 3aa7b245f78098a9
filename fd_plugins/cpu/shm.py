"""The cpu platform's same-host all-reduce: one shared-memory segment per process group, numpy sums,
no collective on the hot path.

Layout of a group's segment (W ranks, S bytes a slot, every offset 64-byte aligned):

    header    line 0: creator's nonce (int64); line 1 + r: rank r's sequence counter (int64)
    set 0     W slots of S bytes: rank r copies its tensor into slot r
    set 1     the same again; call number `seq` uses set `seq % 2`

One call on rank r: copy the tensor into slot r of set seq % 2, publish counter[r] = seq, wait until
every counter is >= seq, sum the W slots of that set with numpy straight into the tensor's memory.

Why one wait per call is enough with two sets: a rank may run ahead to call seq + 1 while a peer still
reads set seq % 2; it writes set (seq + 1) % 2, which nobody is reading. It cannot get further: call
seq + 2 (which reuses set seq % 2) starts only after its wait in call seq + 1 returned, i.e. after every
rank published seq + 1, and a rank publishes seq + 1 only after it finished summing call seq. A single
set would need a second wait ("everyone finished reading") before anyone could write again.

Waiting yields the core (see Waiter): a rank spins briefly (its peer is usually a few microseconds
behind), then sleeps in the kernel on the late peer's counter (a futex on Linux) and is woken by
that peer's publish; a peer descheduled on a busy host then gets the core instead of a spinning
waiter. Each rank's header line also holds its "sleeping" flag, so a publish makes the wake system
call only when a peer may be asleep.
"""

from __future__ import annotations

import atexit
import ctypes
import math
import mmap
import os
import platform as _machine
import socket
import sys
import threading
import time
import warnings
from multiprocessing import shared_memory
from typing import Any, Callable

import numpy as np

DEFAULT_BUFFER_BYTES = 1 << 20
DEFAULT_TIMEOUT = 60.0
BUFFER_ENV = "FD_SHM_BUFFER_BYTES"
TIMEOUT_ENV = "FD_SHM_TIMEOUT"

_LINE = 64  # one counter per cache line, so ranks never write the same line
_PAGE = 4096
# Checks of the counters before the wait sleeps (together about the usual lag of a peer that is on a
# core; docs/benchmarks.md has the figures); then each sleep lasts until the peer's publish wakes it,
# or this long.
_BUSY_CHECKS = 256
_SLEEP_SLICE = 2e-3
# How many (address, size, dtype) views are kept: a 0.3B model's decode steps passed 88 to 124 distinct
# addresses per rank (the allocator rotates a few blocks per layer), which this holds; more are stale ones.
_MAX_VIEWS = 256
# Where the kernel's futex is not available: sleep this long between checks instead.
_SLEEP_SECONDS = 50e-6

AllReduce = Callable[[Any, Any], Any]

# A sum that overflows to inf is the IEEE answer and gloo gives it silently; numpy would warn from
# inside the decode loop. Filtering this module's RuntimeWarnings costs nothing per call, where
# `with np.errstate(...)` costs time on every call.
warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"fd_plugins\.cpu\.shm")

# x86 keeps stores in program order as seen by other cores (TSO) and loads likewise, so the counter
# store cannot overtake the data copy before it. Weakly ordered CPUs (aarch64, ppc64le) may reorder
# them; there, an uncontended lock release + acquire (atomic release / acquire operations in the C
# library) serves as the fence Python otherwise lacks.
_NEEDS_FENCE = _machine.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86")
_fence_lock = threading.Lock()



def _fence() -> None:
    # A lock's acquire and release are atomic read-modify-writes: a full fence on x86 (a store before
    # it is visible before a load after it) and acquire / release ordering elsewhere.
    _fence_lock.acquire()
    _fence_lock.release()


# --- sleeping until a peer publishes ---------------------------------------------------------------

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE) operations: the word lives in a shared mapping
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_call() -> Callable[..., int] | None:
    """libc's syscall() bound to futex, or None where there is none (not Linux, an unknown machine)."""
    number = _SYS_FUTEX.get(_machine.machine().lower())
    if number is None or not sys.platform.startswith("linux"):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long

    def futex(address: int, op: int, value: int, timeout: Any) -> int:
        return int(syscall(ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_int(op), ctypes.c_int(value),
                           timeout, None, ctypes.c_int(0)))

    return futex


class Waiter:
    """How a rank sleeps until a 64-bit counter in shared memory changes, and how a publisher wakes it.

    `sleep(address, seen, seconds)` returns at once if the counter's low 32 bits are no longer `seen`,
    else when `wake(address)` is called on it or after `seconds`; spurious returns are allowed (the
    caller re-checks). With the kernel's futex the sleeper holds no core; without it, a short sleep.
    """

    def __init__(self, futex: Callable[..., int] | None = None) -> None:
        self._futex = futex
        self.kernel = futex is not None

    def sleep(self, address: int, seen: int, seconds: float) -> None:
        if self._futex is None:
            time.sleep(min(seconds, _SLEEP_SECONDS))
            return
        whole = int(seconds)
        timeout = _Timespec(whole, int((seconds - whole) * 1e9))
        # The value compared is the word's low half (x86 and aarch64 are little-endian): a counter
        # that moved on by any amount no longer matches, so the kernel returns at once.
        self._futex(address, _FUTEX_WAIT, ctypes.c_int32(seen & 0xFFFFFFFF).value, ctypes.byref(timeout))

    def wake(self, address: int) -> None:
        if self._futex is not None:
            self._futex(address, _FUTEX_WAKE, 0x7FFFFFFF, None)


def default_waiter() -> Waiter:
    """The kernel's futex where this machine has one, else short sleeps (little-endian
    machines only: see Waiter.sleep)."""
    return Waiter(_futex_call() if sys.byteorder == "little" else None)


def _host_id() -> str:
    """Two ranks can share memory only on the same machine: same host name and same boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _shm_free_bytes() -> int | None:
    """Free bytes of the tmpfs POSIX shared memory lives on, None where that is not /dev/shm."""
    try:
        stats = os.statvfs("/dev/shm")
    except (OSError, AttributeError):
        return None
    return stats.f_bavail * stats.f_frsize


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer number of bytes") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be >= 0 (0 turns the shared-memory path off)")
    return value


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# --- dtypes -------------------------------------------------------------------------------------


def _sum_plain(parts: np.ndarray, out: np.ndarray) -> None:
    if len(parts) == 2:
        np.add(parts[0], parts[1], out=out)
    else:
        np.add.reduce(parts, axis=0, out=out)


def _sum_half(parts: np.ndarray, out: np.ndarray) -> None:
    # float16 in float32: a float16 partial sum overflows (or loses bits) long before the result does.
    acc = parts[0].astype(np.float32)
    for part in parts[1:]:
        np.add(acc, part, out=acc)
    np.copyto(out, acc, casting="same_kind")


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    # bfloat16 is the high half of a float32.
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _sum_bf16(parts: np.ndarray, out: np.ndarray) -> None:
    # numpy has no bfloat16: the slots hold its bits as uint16; sum in float32, round to nearest even.
    acc = _bf16_to_f32(parts[0])
    for part in parts[1:]:
        np.add(acc, _bf16_to_f32(part), out=acc)
    bits = acc.view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(acc)
    if nan.any():
        # Rounding could carry a NaN's payload into the exponent (-> inf); keep a quiet NaN instead.
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    np.copyto(out, rounded)


def _dtype_table() -> dict[Any, tuple[np.dtype, Callable[[np.ndarray, np.ndarray], None]]]:
    import paddle

    return {
        paddle.float32: (np.dtype(np.float32), _sum_plain),
        paddle.float64: (np.dtype(np.float64), _sum_plain),
        paddle.int32: (np.dtype(np.int32), _sum_plain),
        paddle.int64: (np.dtype(np.int64), _sum_plain),
        paddle.float16: (np.dtype(np.float16), _sum_half),
        paddle.bfloat16: (np.dtype(np.uint16), _sum_bf16),
    }


def _eager_tensor_type() -> type:
    import paddle

    return paddle.Tensor


# --- the segment ----------------------------------------------------------------------------------


class _Segment:
    """A mapped shared-memory segment; only its creator ever unlinks the name."""

    def __init__(self, size: int = 0, name: str | None = None) -> None:
        self.creator = name is None
        self._shm: shared_memory.SharedMemory | None = None
        self._map: mmap.mmap | None = None
        if self.creator:
            # Registered with multiprocessing's resource tracker: if this process dies before the
            # name is unlinked, the tracker removes the segment.
            self._shm = shared_memory.SharedMemory(create=True, size=size)
            self.name = self._shm.name
            self.buf: Any = self._shm.buf
        else:
            assert name is not None
            self.name = name
            self.buf = self._attach(name)
        self.size = len(self.buf)

    def _attach(self, name: str) -> Any:
        # Python < 3.13 registers attaching processes with the resource tracker too, which then
        # unlinks the segment (and warns of a "leak") when that process exits, or, when the tracker
        # is shared with the creator (multiprocessing spawn), makes the creator's unlink report a
        # KeyError. Unregistering afterwards has the second problem, so never register: 3.13's
        # track=False, else map the POSIX segment directly, as SharedMemory itself does.
        if sys.version_info >= (3, 13):
            self._shm = shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
            return self._shm.buf
        try:
            import _posixshmem  # type: ignore[import-not-found]  # CPython's own module; no stub
        except ImportError:  # Windows: named mappings, never tracked
            self._shm = shared_memory.SharedMemory(name=name)
            return self._shm.buf
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._map = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return self._map

    def unlink(self) -> None:
        """Remove the name (mappings stay valid); once every rank has mapped it, nothing can leak."""
        if self.creator and self._shm is not None:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
            self.creator = False

    def close(self) -> None:
        """Unmap; every numpy view of `buf` must be gone first."""
        self.buf = None
        try:
            if self._shm is not None:
                self._shm.close()
            if self._map is not None:
                self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process


# --- one process group ----------------------------------------------------------------------------


class ShmGroup:
    """One process group's shared-memory all-reduce on this rank; `all_reduce` is the hot path."""

    def __init__(self, group: Any, rank: int, world: int, fallback: AllReduce) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self._fallback = fallback
        self.usable = False
        self.reason = "not set up"
        self.slot_bytes = 0
        self.timeout = DEFAULT_TIMEOUT
        self.seq = 0
        # Ranks of the group on this host, this one included (known after setup).
        self.local_ranks = 1
        self.calls = {"shm": 0, "fallback": 0}
        # Time in _wait (calls whose peers had not all arrived), of it asleep, and how many such calls.
        self.wait_s = 0.0
        self.slept_s = 0.0
        self.waits = 0
        self.waiter = default_waiter()
        self._segment: _Segment | None = None
        self._broken: str | None = None
        self._dtypes: dict[Any, Any] = {}
        self._eager: Any = object
        # (address, bytes, dtype) -> numpy views of that memory and of the two slot sets (see _remember).
        self._views: dict[tuple[int, int, np.dtype], tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]] = {}

    # -- setup, once, on every rank together --

    def setup(self) -> "ShmGroup":
        """Create (group rank 0) or attach the segment; all ranks agree whether it is usable."""
        import paddle.distributed as dist

        if self.world <= 1 or self.rank < 0:
            self.reason = "one rank" if self.world == 1 else "this process is not in the group"
            return self
        # A bad setting raises on every rank after the first gather, never on one rank before it
        # (its peers would wait in the collective).
        error = None
        slot = 0
        try:
            self.timeout = _env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT)
            if self.rank == 0:
                slot = _round_up(_env_int(BUFFER_ENV, DEFAULT_BUFFER_BYTES), _LINE)
        except ValueError as exc:
            error = str(exc)
        header = _round_up((1 + self.world) * _LINE, _PAGE)
        size = header + 2 * self.world * slot
        offer = None
        if self.rank == 0 and error is None:
            if slot == 0:
                self.reason = f"{BUFFER_ENV}=0 turns the shared-memory path off"
            elif (free := _shm_free_bytes()) is not None and free < size:
                # tmpfs lets the segment be created larger than it can hold, then kills the process
                # with SIGBUS on first touch of a missing page: refuse up front instead.
                self.reason = (f"/dev/shm has {free} bytes free, the segment needs {size}; "
                               f"enlarge /dev/shm (docker --shm-size) or lower {BUFFER_ENV}")
            else:
                try:
                    self._segment = _Segment(size=size)
                    atexit.register(self.close)
                    nonce = int.from_bytes(os.urandom(7), "little")
                    memoryview(self._segment.buf).cast("q")[0] = nonce
                    offer = (self._segment.name, slot, nonce)
                except OSError as exc:
                    self.reason = f"could not create a {size}-byte segment: {exc}"
        # One-time gloo cost: every rank's host and settings error; rank 0's segment name, slot size and nonce.
        seen: list[Any] = []
        dist.all_gather_object(seen, (_host_id(), error, offer), group=self.group)
        errors = [f"rank {r}: {e}" for r, (_, e, _) in enumerate(seen) if e]
        if errors:
            self.close()
            raise ValueError("cpu all-reduce: bad settings: " + "; ".join(errors))
        hosts = [h for h, _, _ in seen]
        self.local_ranks = hosts.count(hosts[self.rank])
        offer = seen[0][2]
        ok, why = True, ""
        if offer is None:
            ok, why = False, (self.reason if self.rank == 0 else "rank 0 offered no segment")
        elif len(set(hosts)) != 1:
            ok, why = False, "ranks are on different hosts: " + ", ".join(f"{r}={h.split('/')[0]}"
                                                                          for r, h in enumerate(hosts))
        elif self.rank != 0:
            name, slot, nonce = offer
            try:
                self._segment = _Segment(name=name)
                atexit.register(self.close)
                if memoryview(self._segment.buf).cast("q")[0] != nonce:
                    ok, why = False, f"segment {name} is not rank 0's (same host name, different machine?)"
            except OSError as exc:
                ok, why = False, f"could not attach segment {name}: {exc}"
        # Every rank must take the same path on every call, so one rank's failure turns it off for all.
        verdicts: list[Any] = []
        dist.all_gather_object(verdicts, (ok, why), group=self.group)
        if self._segment is not None and self._segment.creator:
            # Every rank that could map the segment has: remove the name now rather than at exit.
            self._segment.unlink()
        failed = [(r, w) for r, (good, w) in enumerate(verdicts) if not good]
        if failed:
            self.reason = "gloo fallback: " + "; ".join(f"rank {r}: {w}" for r, w in failed)
            self.close()
            return self
        self.slot_bytes = offer[1]
        self._map_views(header)
        self._dtypes = _dtype_table()
        self._eager = _eager_tensor_type()
        self.usable = True
        self.reason = f"shared memory ({self.world} ranks, {self.slot_bytes} bytes a slot)"
        return self

    def _map_views(self, header: int) -> None:
        buf = self._segment.buf  # type: ignore[union-attr]
        words = memoryview(buf).cast("q")
        step = _LINE // 8
        self._words = words
        self._mine = (1 + self.rank) * step
        # A strided memoryview of the W counters: min() over it measured faster than numpy's
        # (docs/benchmarks.md has the figures).
        self._counters = words[step : (1 + self.world) * step : step]
        # Each rank's "asleep in _wait" flag, the second word of its line (written by that rank only).
        self._sleeping = words[step + 1 : (1 + self.world) * step + 1 : step]
        self._my_flag = self._mine + 1
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        self._addresses = [base + (1 + r) * _LINE for r in range(self.world)]
        self._others = [r for r in range(self.world) if r != self.rank]
        w, s = self.world, self.slot_bytes
        self._sets = [np.ndarray((w, s), np.uint8, buffer=buf, offset=header + k * w * s) for k in (0, 1)]

    def close(self) -> None:
        """Drop every view of the segment, then unmap it (and unlink it if this rank still owns the name)."""
        self.usable = False
        self._views.clear()  # they hold views of the segment, which must all be gone before it is unmapped
        self._sets = []
        for attr in ("_counters", "_sleeping", "_words"):
            view = self.__dict__.pop(attr, None)
            if view is not None:
                view.release()
        if self._segment is not None:
            self._segment.unlink()
            self._segment.close()
            self._segment = None

    def reducer(self) -> Callable[[Any], Any]:
        """The per-call function: the identity over one rank, else `all_reduce`."""
        return _identity if self.world == 1 else self.all_reduce

    # -- the hot path --

    def all_reduce(self, tensor: Any) -> Any:
        """Sum `tensor` over the group in place and return it."""
        if self._broken:
            raise RuntimeError(self._broken)
        shape = tensor.shape
        if 0 in shape:
            return tensor
        spec = self._dtypes.get(tensor.dtype) if self.usable else None
        # Not an eager tensor (traced into a static program): only the gloo path can be traced.
        if spec is None or not isinstance(tensor, self._eager):
            return self._gloo(tensor)
        dtype, summer = spec
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.slot_bytes:  # every rank decides alike: the same dtype, shape and layout reach each rank
            return self._gloo(tensor)
        if not tensor.is_contiguous():
            # A strided view (a slice, a transpose): its elements are not one run of memory. Sum a dense
            # copy, then write the sum back through the view (never into the memory around it).
            return _write_back(tensor, self.all_reduce(tensor.contiguous()))
        # A decode step's partial sums come back at the same hundred or so addresses step after step (the
        # allocator reuses its blocks), so the numpy views of them and of the slots are made once per address:
        # right after a product evicted the caches, making them on every call was measurably costly
        # (docs/benchmarks.md has the figures).
        key = (tensor.data_ptr(), nbytes, dtype)
        views = self._views.get(key)
        if views is None:
            if not tensor.place.is_cpu_place():
                return self._gloo(tensor)
            views = self._remember(key)
        own, sets = views
        seq = self.seq = self.seq + 1
        parts = sets[seq & 1]
        np.copyto(parts[self.rank], own)
        if _NEEDS_FENCE:
            _fence()
        self._words[self._mine] = seq
        if self.waiter.kernel:
            # A peer asleep on this counter is woken; the fence orders the store above before the
            # flag's load (else both sides could miss each other and the peer would sleep a slice).
            _fence()
            if any(self._sleeping):
                self.waiter.wake(self._addresses[self.rank])
        if min(self._counters) < seq:
            self._wait(seq)
        if _NEEDS_FENCE:
            _fence()
        summer(parts, own)
        self.calls["shm"] += 1
        return tensor

    def _remember(self, key: tuple[int, int, np.dtype]) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """Numpy views of the memory at key's address (the tensor's own: read the input from it, write the sum into
        it, no copy) and of both slot sets at its size and dtype; kept for the next call at the same address."""
        address, nbytes, dtype = key
        if len(self._views) >= _MAX_VIEWS:  # addresses a long run no longer uses
            self._views.clear()
        # a buffer numpy reads; its stub lists no ctypes arrays
        memory: Any = (ctypes.c_char * nbytes).from_address(address)
        own = np.frombuffer(memory, dtype)
        views = self._views[key] = (own, (self._sets[0][:, :nbytes].view(dtype), self._sets[1][:, :nbytes].view(dtype)))
        return views

    def _gloo(self, tensor: Any) -> Any:
        self.calls["fallback"] += 1
        return self._fallback(tensor, self.group)

    def _wait(self, seq: int) -> None:
        """Spin briefly, then sleep until woken by the late peer's publish, until every rank published `seq`;
        bounded."""
        counters = self._counters
        start = time.monotonic()
        self.waits += 1
        try:
            for _ in range(_BUSY_CHECKS):
                if min(counters) >= seq:
                    return
            self._sleep_until(seq, start)
        finally:
            self.wait_s += time.monotonic() - start

    def _sleep_until(self, seq: int, start: float) -> None:
        counters, flags = self._counters, self._words
        deadline = start + self.timeout
        flags[self._my_flag] = 1
        try:
            while True:
                late = next((r for r in self._others if counters[r] < seq), None)
                if late is None:
                    return
                now = time.monotonic()
                if now > deadline:
                    missing = [r for r, c in enumerate(counters) if c < seq]
                    self._broken = (
                        f"cpu all-reduce (shared memory): rank(s) {', '.join(map(str, missing))} of the group "
                        f"did not arrive at call {seq} within {self.timeout:g} s ({TIMEOUT_ENV}); "
                        f"they crashed, hang, or took another code path. The group's ranks are out of step; "
                        f"restart them."
                    )
                    raise RuntimeError(self._broken)
                # The flag is set before this read of the counter (the kernel re-reads it under its own
                # barrier), so a publish after the read sees the flag and wakes this rank.
                self.waiter.sleep(self._addresses[late], counters[late], min(_SLEEP_SLICE, deadline - now + 1e-3))
                self.slept_s += time.monotonic() - now
        finally:
            flags[self._my_flag] = 0

    def stats(self) -> dict[str, Any]:
        """Calls, and the time spent waiting for peers (and of it asleep) since setup: for per-step breakdowns."""
        return {"calls": self.calls["shm"], "fallback_calls": self.calls["fallback"], "waits": self.waits,
                "wait_s": self.wait_s, "slept_s": self.slept_s, "kernel_sleep": self.waiter.kernel}


def _identity(tensor: Any) -> Any:
    return tensor


def _write_back(view: Any, dense: Any) -> Any:
    """Copy `dense` into the strided `view` it was made from (paddle.assign writes through
    a view) and return the view."""
    import paddle

    paddle.assign(dense, output=view)
    return view


# Every group set up in this process, by group object (None: the default group); read through group_state.
_GROUPS: dict[Any, ShmGroup] = {}


def group_state(group: Any) -> ShmGroup | None:
    """The shared-memory state of `group` set up in this process (usable, slot size, call counts), None if none was."""
    return _GROUPS.get(group)


def setup_group(group: Any, fallback: AllReduce) -> ShmGroup:
    """Set up `group`'s shared-memory all-reduce; collective: every rank of `group` calls it together."""
    import paddle.distributed as dist

    if group is None:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = group.rank, group.nranks
    state = _GROUPS[group] = ShmGroup(group, rank, world, fallback).setup()
    return state
