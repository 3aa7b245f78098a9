"""The `shm` KV transport: instances on one host hand parts over as files in shared memory (/dev/shm, a tmpfs: the
bytes never touch a disk).

Rank r of the instance listening at NAME owns the directory `fd-kv-NAME-rR` there, with its process id in `owner`.
A send writes `.KEY.part` into the peer's directory from a thread of its own, then renames it to `KEY`: the rename is
the hand-over (DONE), so a receiver never reads a part-written file. The receiver maps `KEY` once (its parts are views
of the file's pages, no copy) and unlinks it.
A peer whose directory is missing or whose owner has exited is gone (FAILED); a directory left by an owner that
died is taken over by the next instance that listens at its name, or removed by the next instance that starts a
minute or more later. Closing removes the directory and what it holds.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from fd_core.errors import ConfigError
from fd_core.transfer import UNCLAIMED_S, TransferState, forget_oldest, header_size, pack, unpack

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
# Received files kept for reuse at most, per rank: a send into one writes into pages allocated and mapped already
# (a fresh file's pages cost tmpfs an allocation and a zeroing each, half the transfer's time).
MAX_SPARES = 4


def _claim_spare(target: str, partial: str) -> bool:
    """Take one of the receiver's spare files as `partial` (a rename: two senders never take the same one)."""
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(target)):
            if name.startswith(".spare-"):
                with contextlib.suppress(FileNotFoundError):
                    os.rename(os.path.join(target, name), partial)
                    return True
    return False


def root() -> str:
    """Where the directories live: /dev/shm where it is writable, else the temporary directory."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def endpoint(listen: str, rank: int) -> str:
    """The directory of rank `rank` of the instance listening at `listen`."""
    return os.path.join(root(), f"fd-kv-{listen}-r{rank}")


def _alive(directory: str) -> bool:
    """Whether the process that owns `directory` is running."""
    try:
        with open(os.path.join(directory, "owner")) as f:
            pid = int(f.read().strip() or 0)
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


def _word(what: str, value: str) -> str:
    if not (isinstance(value, str) and _NAME.match(value)):
        raise ConfigError(f"KV transport 'shm': {what} {value!r} is not a name of letters, digits, '_', '.' and '-'")
    return value


def sweep_dead(older_than: float = 60.0) -> None:
    """Remove the directories of instances whose owner has exited (killed: it could not remove its own), once they are
    `older_than` seconds old (a directory just made may not name its owner yet)."""
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(root()) as entries:
        for entry in entries:
            if entry.name.startswith("fd-kv-") and entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    if now - entry.stat().st_mtime > older_than and not _alive(entry.path):
                        shutil.rmtree(entry.path, ignore_errors=True)


class ShmTransport:
    """One rank's end of the `shm` transport."""

    def __init__(self, listen: str, rank: int) -> None:
        self.rank = rank
        sweep_dead()
        self.directory = endpoint(_word("address", listen), rank)
        try:
            os.mkdir(self.directory)
        except FileExistsError:
            if _alive(self.directory):
                raise ConfigError(f"KV transport 'shm': address {listen!r} is in use by a running instance "
                                  f"({self.directory}); give each instance its own --kv-listen") from None
            shutil.rmtree(self.directory, ignore_errors=True)  # an instance that died left it
            os.mkdir(self.directory)
        with open(os.path.join(self.directory, "owner"), "w") as f:
            f.write(str(os.getpid()))
        self._states: dict[str, TransferState] = {}
        self._stops: dict[str, threading.Event] = {}
        self._aborted: dict[str, None] = {}  # an ordered set: forget_oldest drops the oldest
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fd-kv-shm")
        self._closed = False
        self._swept = 0.0
        self._maps: dict[int, mmap.mmap] = {}  # inode -> its mapping, kept while its file is held or spare
        self._send_maps: dict[int, mmap.mmap] = {}  # a peer's spare file's inode -> this sender's mapping of it
        atexit.register(self.close)

    # -- sending -------------------------------------------------------------------------------
    def send(self, key: str, peer: str, parts: Sequence[Any], timeout: float) -> None:
        _word("key", key)
        target = endpoint(_word("address", peer), self.rank)
        stop = threading.Event()
        with self._lock:
            self._states[key] = TransferState.PENDING
            self._stops[key] = stop
            forget_oldest(self._states, self._aborted)
        self._pool.submit(self._write, key, target, list(parts), timeout, stop)

    def _write(self, key: str, target: str, parts: list[Any], timeout: float, stop: threading.Event) -> None:
        start = time.monotonic()
        partial = os.path.join(target, f".{key}.part")
        state = TransferState.FAILED
        try:
            if _alive(target):
                header, buffers = pack(parts)
                if _claim_spare(target, partial):
                    state = self._fill(partial, header, buffers,
                                       lambda: stop.is_set() or time.monotonic() - start > timeout)
                else:
                    with open(partial, "wb") as f:
                        f.write(header)
                        for buffer in buffers:
                            if stop.is_set() or time.monotonic() - start > timeout:
                                break
                            f.write(buffer)
                        else:
                            state = TransferState.DONE
                if state is TransferState.DONE and not stop.is_set() and time.monotonic() - start <= timeout:
                    os.rename(partial, os.path.join(target, key))
                else:
                    state = TransferState.ABORTED if stop.is_set() else TransferState.FAILED
        except OSError:
            state = TransferState.FAILED  # the peer's directory went away under us: it closed or died
        finally:
            if state is not TransferState.DONE:
                with contextlib.suppress(OSError):
                    os.unlink(partial)
            with self._lock:
                self._states[key] = state
                self._stops.pop(key, None)

    def _fill(self, path: str, header: bytes, buffers: list[memoryview], late: Callable[[], bool]) -> TransferState:
        """The payload copied into a spare file through a mapping of it (kept by inode: its pages mapped already, the
        copy is a memory copy); DONE, or FAILED when `late` says to stop."""
        total = len(header) + sum(len(b) for b in buffers)
        with open(path, "r+b") as f:
            info = os.fstat(f.fileno())
            if info.st_size < total:
                os.ftruncate(f.fileno(), total)
            # By inode: a mapping holds its file, so no other file can have that inode while it is kept.
            mapped = self._send_maps.pop(info.st_ino, None)
            if mapped is None or len(mapped) < total:
                mapped = mmap.mmap(f.fileno(), max(total, info.st_size))
            self._send_maps[info.st_ino] = mapped
            while len(self._send_maps) > 2 * MAX_SPARES:  # the oldest: files the receiver has likely let go
                self._send_maps.pop(next(iter(self._send_maps))).close()
        mapped[:len(header)] = header
        offset = len(header)
        for buffer in buffers:
            if late():
                return TransferState.FAILED
            mapped[offset:offset + len(buffer)] = buffer
            offset += len(buffer)
        return TransferState.DONE

    def state(self, key: str) -> TransferState:
        with self._lock:
            return self._states.get(key, TransferState.FAILED)

    # -- receiving -----------------------------------------------------------------------------
    def receive(self, key: str) -> list[Any] | None:
        self._sweep()
        import numpy as np

        path = os.path.join(self.directory, _word("key", key))
        if key in self._aborted:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        try:
            # Mapped, not read: the parts are views of the file's pages (no copy here; the engine's write into its
            # cache is the one copy). The file is held under another name while any view lives, then recycled.
            mapped = self._map(path)
            inode = os.stat(path).st_ino
            held = os.path.join(self.directory, f".held-{inode}")
            os.rename(path, held)
        except FileNotFoundError:
            return None
        whole = np.frombuffer(mapped, dtype=np.uint8)
        size = header_size(whole[:8].tobytes())
        parts = unpack(whole[:size].tobytes(), whole[size:], copy=False)
        weakref.finalize(whole, self._release, inode, held)
        return parts

    def _map(self, path: str) -> mmap.mmap:
        """A mapping of the file at `path`: the one kept for its inode when the file is a recycled one (its pages mapped
        already: no fault on reading), else a new one, kept while the file is."""
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            kept = self._maps.get(info.st_ino)
            if kept is not None and len(kept) >= info.st_size:
                return kept
            mapped = mmap.mmap(f.fileno(), info.st_size, access=mmap.ACCESS_READ)
        self._maps[info.st_ino] = mapped
        return mapped

    def _release(self, inode: int, held: str) -> None:
        """The last view of a received payload is gone: its file becomes a spare a sender writes the next one into (its
        pages allocated and mapped already), or goes when MAX_SPARES are kept."""
        spares = [e for e in os.listdir(self.directory) if e.startswith(".spare-")] if not self._closed else []
        try:
            if len(spares) < MAX_SPARES and not self._closed:
                os.rename(held, os.path.join(self.directory, f".spare-{inode}"))
                return
            os.unlink(held)
        except OSError:
            pass
        self._maps.pop(inode, None)

    def _sweep(self) -> None:
        """Drop payloads nobody received within UNCLAIMED_S (at most once a minute)."""
        now = time.time()
        if now - self._swept < 60:
            return
        self._swept = now
        with contextlib.suppress(OSError), os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name != "owner" and now - entry.stat().st_mtime > UNCLAIMED_S:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)

    def abort(self, key: str) -> None:
        with self._lock:
            self._aborted[key] = None
            forget_oldest(self._states, self._aborted)
            stop = self._stops.get(key)
        if stop is not None:
            stop.set()
        for name in (key, f".{key}.part"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, name))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stop in list(self._stops.values()):
            stop.set()
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.directory, ignore_errors=True)
        atexit.unregister(self.close)

