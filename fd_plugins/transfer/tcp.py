"""The `tcp` KV transport: instances on any hosts hand parts over through ZeroMQ (pyzmq, the `transfer` extra).

The instance listening at HOST:PORT has rank r bind a ROUTER socket at tcp://HOST:(PORT + r). A send goes from a
thread of the sender's own through one DEALER socket per peer: the key, a header (fd_core.transfer.pack) and the
parts as frames, sent without a copy; the receiver keeps them and acknowledges, and the acknowledgement is the
hand-over (DONE). A peer that accepts no connection within CONNECT_S (or the send's timeout, if shorter) is gone
(FAILED); a send that is not acknowledged within its timeout, or is aborted, is final only once the receiver has
said it dropped what arrived (or CONNECT_S has passed: the peer is gone). ZeroMQ's own I/O thread does the socket work.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from fd_core.errors import ConfigError
from fd_core.transfer import UNCLAIMED_S, TransferState, forget_oldest, pack, unpack

# Seconds a send waits for the peer to accept its connection before it fails.
CONNECT_S = 3.0


def endpoint(listen: str, rank: int) -> str:
    """The ZeroMQ address of rank `rank` of the instance listening at HOST:PORT."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) + rank < 65536:
        raise ConfigError(f"KV transport 'tcp': {listen!r} is not HOST:PORT; pass --kv-listen HOST:PORT (rank r "
                          f"listens at PORT + r)")
    return f"tcp://{host}:{int(port) + rank}"


class TcpTransport:
    """One rank's end of the `tcp` transport."""

    def __init__(self, listen: str, rank: int) -> None:
        try:
            import zmq
        except ImportError:
            raise ConfigError("KV transport 'tcp' needs pyzmq: pip install '.[transfer]' in a checkout of "
                              "fd-backends (docs/disaggregation.md)") from None
        self.zmq = zmq
        self.rank = rank
        self.address = endpoint(listen, rank)
        self.context = zmq.Context()
        self.inbox: dict[str, tuple[float, list[Any]]] = {}
        self.aborted: dict[str, None] = {}  # an ordered set: forget_oldest drops the oldest
        self.states: dict[str, TransferState] = {}
        self.lock = threading.Lock()
        self.server = self.context.socket(zmq.ROUTER)
        self.server.setsockopt(zmq.LINGER, 0)
        try:
            self.server.bind(self.address)
        except zmq.ZMQError as exc:
            self.context.destroy(linger=0)
            raise ConfigError(f"KV transport 'tcp': cannot listen at {self.address} ({exc}): the address is in use "
                              f"or not this host's; give each instance its own --kv-listen HOST:PORT") from None
        self.closing = threading.Event()
        self.listener = threading.Thread(target=self._listen, name="fd-kv-tcp-listen", daemon=True)
        self.listener.start()
        self.peers: dict[str, Any] = {}  # peer address -> DEALER socket, used on the sending thread only
        self.aborts: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()  # (peer, key) to tell
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fd-kv-tcp-send")
        self.stops: dict[str, threading.Event] = {}

    # -- receiving (the listener thread) -------------------------------------------------------
    def _listen(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.server, zmq.POLLIN)
        while not self.closing.is_set():
            if not dict(poller.poll(100)):
                continue
            frames = self.server.recv_multipart(copy=False)
            if len(frames) < 3:
                continue  # not a sender of this transport: no acknowledgement
            try:
                identity, key = frames[0].bytes, frames[1].bytes.decode()
            except UnicodeDecodeError:
                continue
            if len(frames) == 3 and frames[2].bytes == b"abort":
                with self.lock:
                    self.inbox.pop(key, None)
                self.server.send_multipart([identity, key.encode(), b"dropped"])
                continue
            with self.lock:
                keep = key not in self.aborted
            if keep:
                try:
                    parts = unpack(frames[2].bytes, b"".join(f.buffer for f in frames[3:]), copy=False)
                except Exception:  # noqa: BLE001 - a malformed payload: no acknowledgement, the sender fails it
                    continue
                with self.lock:
                    self.inbox[key] = (time.monotonic(), parts)
            self.server.send_multipart([identity, key.encode(), b"ok"])

    def receive(self, key: str) -> list[Any] | None:
        with self.lock:
            now = time.monotonic()
            for old in [k for k, (at, _) in self.inbox.items() if now - at > UNCLAIMED_S]:
                del self.inbox[old]  # never received: its request was not resumed
            held = self.inbox.pop(key, None)
        return None if held is None else held[1]

    # -- sending (the sending thread) ----------------------------------------------------------
    def send(self, key: str, peer: str, parts: Sequence[Any], timeout: float) -> None:
        target = endpoint(peer, self.rank)
        stop = threading.Event()
        with self.lock:
            self.states[key] = TransferState.PENDING
            self.stops[key] = stop
            forget_oldest(self.states, self.aborted)
        self.pool.submit(self._send, key, target, list(parts), timeout, stop)

    def _socket(self, target: str) -> Any:
        zmq = self.zmq
        socket = self.peers.get(target)
        if socket is None:
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected: tell it is gone
            socket.connect(target)
            self.peers[target] = socket
        return socket

    def _send(self, key: str, target: str, parts: list[Any], timeout: float, stop: threading.Event) -> None:
        zmq = self.zmq
        start = time.monotonic()
        state = TransferState.FAILED
        sent = False
        try:
            socket = self._socket(target)
            left = timeout - (time.monotonic() - start)
            if left > 0 and not stop.is_set() and socket.poll(int(1000 * min(left, CONNECT_S)), zmq.POLLOUT):
                header, buffers = pack(parts)
                socket.send_multipart([key.encode(), header, *buffers], copy=False)
                sent = True
                while not stop.is_set() and time.monotonic() - start < timeout:
                    if socket.poll(50, zmq.POLLIN):
                        reply = socket.recv_multipart()
                        if reply[0].decode() == key and reply[-1] == b"ok":
                            state = TransferState.DONE
                            break
                if stop.is_set() and state is not TransferState.DONE:
                    state = TransferState.ABORTED
        except zmq.ZMQError:
            state = TransferState.FAILED
        finally:
            if sent and state is not TransferState.DONE:
                self._tell_abort(target, key)  # what arrived there is dropped before the state is final
            with self.lock:
                self.states[key] = state
                self.stops.pop(key, None)

    def _tell_abort(self, target: str, key: str) -> None:
        """Have the peer drop what it holds under `key`, and wait (at most CONNECT_S) until it says it did: a send that
        ends FAILED or ABORTED leaves nothing there."""
        zmq = self.zmq
        try:
            socket = self._socket(target)
            socket.send_multipart([key.encode(), b"abort"], flags=zmq.NOBLOCK)
            deadline = time.monotonic() + CONNECT_S
            while time.monotonic() < deadline:
                if socket.poll(50, zmq.POLLIN):
                    reply = socket.recv_multipart()
                    if reply[0].decode() == key and reply[-1] == b"dropped":
                        return
        except zmq.ZMQError:
            pass  # the peer is gone: nothing of it to drop

    def state(self, key: str) -> TransferState:
        with self.lock:
            return self.states.get(key, TransferState.FAILED)

    def abort(self, key: str) -> None:
        with self.lock:
            self.aborted[key] = None
            forget_oldest(self.states, self.aborted)
            self.inbox.pop(key, None)
            stop = self.stops.get(key)
        if stop is not None:
            stop.set()

    def close(self) -> None:
        if self.closing.is_set():
            return
        self.closing.set()
        for stop in list(self.stops.values()):
            stop.set()
        self.pool.shutdown(wait=True)
        self.listener.join(5)
        with self.lock:
            self.inbox.clear()
        self.context.destroy(linger=0)
