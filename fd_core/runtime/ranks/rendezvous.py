"""Where spawned ranks rendezvous: a key-value store bound to loopback, served from the process that spawns them.

Paddle's ranks meet through a TCPStore whose server rank 0 starts, and Paddle 3.3.1 binds that server to
every interface (INADDR_ANY) for the whole run, with no option to choose the address. For ranks on one
host fd serves the same store protocol itself, from the spawning process, on 127.0.0.1 only; every rank
joins it as a client (which binds nothing). Across hosts (paddle.distributed.launch) Paddle's own store
is used as the launcher sets it up.

The protocol is what Paddle's TCPStore client sends: a command (int32), a key (uint64 length, bytes), and
for ADD an int64, for SET a value (uint64 length, bytes); GET answers the value, ADD the new count, WAIT
a STOP_WAIT (int32) once the key exists, CHECK READY or NOT_READY.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
from typing import Any

LOOPBACK = "127.0.0.1"
# "host:port" of the store a spawned rank joins (set by spawn_ranks for its ranks).
STORE_ENV = "FD_RENDEZVOUS_STORE"
# Paddle's TCPStore client timeout (seconds), as paddle.distributed uses by default.
CLIENT_TIMEOUT_S = 900

_ADD, _GET, _CHECK, _SET, _WAIT = range(5)
_STOP_WAIT, _READY, _NOT_READY = 1, 2, 3


class _Closed(Exception):
    """The client closed its connection."""


def _receive(conn: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes from `conn`; _Closed if it closes first."""
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise _Closed()
        data += chunk
    return bytes(data)


def _receive_bytes(conn: socket.socket) -> bytes:
    """A length-prefixed byte string, as Paddle's client sends keys and values."""
    (size,) = struct.unpack("<Q", _receive(conn, 8))
    return _receive(conn, size)


class LoopbackStore:
    """A TCPStore server on `host` (loopback by default), a port the kernel picks; a thread per client."""

    def __init__(self, host: str = LOOPBACK, port: int = 0) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen(64)
        self.host, self.port = self.listener.getsockname()[:2]
        self.values: dict[bytes, bytes] = {}
        self.waiting: dict[bytes, list[socket.socket]] = {}
        self.lock = threading.Lock()
        self.clients: list[socket.socket] = []
        threading.Thread(target=self._accept, name="fd-rendezvous", daemon=True).start()

    @property
    def address(self) -> str:
        """"host:port", as a rank's STORE_ENV holds it."""
        return f"{self.host}:{self.port}"

    def _accept(self) -> None:
        """Accept clients until closed, each served by a thread of its own."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.clients.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="fd-rendezvous client", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Answer one client's commands until it closes its connection (or sends something else)."""
        try:
            while True:
                (command,) = struct.unpack("<i", _receive(conn, 4))
                key = _receive_bytes(conn)
                if command == _ADD:
                    (increment,) = struct.unpack("<q", _receive(conn, 8))
                    with self.lock:
                        value = int(self.values.get(key, b"0")) + increment
                        self.values[key] = str(value).encode()
                        conn.sendall(struct.pack("<q", value))
                        self._notify(key)
                elif command == _SET:
                    data = _receive_bytes(conn)
                    with self.lock:
                        self.values[key] = data
                        self._notify(key)
                elif command == _GET:  # Paddle's client waits for the key first
                    with self.lock:
                        data = self.values.get(key, b"")
                    conn.sendall(struct.pack("<Q", len(data)) + data)
                elif command == _CHECK:
                    with self.lock:
                        conn.sendall(struct.pack("<i", _READY if key in self.values else _NOT_READY))
                elif command == _WAIT:
                    with self.lock:
                        if key in self.values:
                            conn.sendall(struct.pack("<i", _STOP_WAIT))
                        else:
                            self.waiting.setdefault(key, []).append(conn)
                else:  # not Paddle's client: drop it
                    return
        except (_Closed, OSError, ValueError, struct.error):
            return
        finally:
            conn.close()

    def _notify(self, key: bytes) -> None:
        """Release the clients waiting for `key` (the lock is held)."""
        for waiter in self.waiting.pop(key, []):
            try:
                waiter.sendall(struct.pack("<i", _STOP_WAIT))
            except OSError:
                pass

    def close(self) -> None:
        """Stop listening and drop every client."""
        self.listener.close()
        with self.lock:
            for conn in self.clients:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()

    def __enter__(self) -> "LoopbackStore":
        """The store itself; closed on exit."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """Close the store."""
        self.close()


# Rank 0's store under a launcher, kept for the life of the process.
_served: list[LoopbackStore] = []


def master_address() -> str | None:
    """"host:port" where a launched job's rank 0 serves its store, as paddle.distributed reads it
    (MASTER_ADDR and MASTER_PORT, else PADDLE_MASTER, else the first trainer endpoint)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        return f"{host}:{port}"
    endpoints = os.environ.get("PADDLE_MASTER") or os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")[0]
    return endpoints or None


def _other_hosts() -> bool:
    """Whether the launched job's trainer endpoints name a host that is not loopback (ranks on other machines)."""
    hosts = {e.rpartition(":")[0] for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e}
    return any(not (h.startswith("127.") or h == "localhost") for h in hosts)


def serve_launched_store(rank: int) -> None:
    """Under paddle.distributed.launch: rank 0 serves the store bound to the master address the user gave
    (Paddle's own binds every interface), and every rank joins it there (STORE_ENV)."""
    address = master_address()
    if address is None or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if rank == 0:
        try:
            bound = socket.gethostbyname(host)
            if bound.startswith("127.") and _other_hosts():
                # A hostname that resolves to loopback here (Debian's 127.0.1.1) would bind where no other node can
                # reach.
                raise OSError(f"{host} resolves to {bound} on this host, which the job's other hosts cannot reach")
            _served.append(LoopbackStore(bound, int(port)))
        except (OSError, ValueError) as exc:
            # Not an address of this host (a NAT's, say): Paddle's own store, on every interface, still works.
            print(f"fd: warning: cannot serve the rendezvous store on {address} ({exc}); "
                  "Paddle's own store listens on every interface",
                  file=sys.stderr)
            return
    os.environ[STORE_ENV] = address


def join_store(world: int) -> None:
    """In a spawned rank: have paddle.distributed join the store STORE_ENV names, as a client, instead of
    rank 0 serving Paddle's own (which would listen on every interface); nothing when it is unset."""
    address = os.environ.get(STORE_ENV)
    if not address:
        return
    from paddle.base import core

    host, _, port = address.rpartition(":")
    store = core.TCPStore(host, int(port), False, world, CLIENT_TIMEOUT_S)
    # Paddle takes its default store from this function (init_parallel_env, new groups); one per process.
    core.create_or_get_global_tcp_store = lambda: store
