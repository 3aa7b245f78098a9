"""The `local` KV transport: instances in one process hand parts over through a dictionary (the Python API's two
LLMs at tp=1, and the engine's tests, which need no other process)."""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

from fd_core.errors import ConfigError
from fd_core.transfer import UNCLAIMED_S, TransferState, forget_oldest

_LOCK = threading.Lock()
# (listen, rank) -> that rank's transport.
_ENDPOINTS: dict[tuple[str, int], "LocalTransport"] = {}


class LocalTransport:
    """One rank's end: a send copies the parts into the peer's inbox at once (DONE) or finds no peer (FAILED)."""

    def __init__(self, listen: str, rank: int) -> None:
        self.listen, self.rank = listen, rank
        self._inbox: dict[str, tuple[float, list[Any]]] = {}
        self._aborted: dict[str, None] = {}  # an ordered set: forget_oldest drops the oldest
        self._states: dict[str, TransferState] = {}
        with _LOCK:
            if (listen, rank) in _ENDPOINTS:
                raise ConfigError(f"KV transport 'local': address {listen!r} is in use in this process by another "
                                  f"instance; give each instance its own --kv-listen")
            _ENDPOINTS[(listen, rank)] = self

    def send(self, key: str, peer: str, parts: Sequence[Any], timeout: float) -> None:
        start = time.monotonic()
        with _LOCK:
            target = _ENDPOINTS.get((peer, self.rank))
        copied = [p.copy() for p in parts]
        # Past its timeout the copy is dropped: a send ends DONE or FAILED whole, as over any other transport.
        if target is None or time.monotonic() - start > timeout or not target._put(key, copied):
            self._states[key] = TransferState.FAILED
        else:
            self._states[key] = TransferState.DONE
        with _LOCK:
            forget_oldest(self._states, self._aborted)

    def _put(self, key: str, parts: list[Any]) -> bool:
        with _LOCK:
            if key in self._aborted or _ENDPOINTS.get((self.listen, self.rank)) is not self:
                return False
            self._inbox[key] = (time.monotonic(), parts)
            return True

    def state(self, key: str) -> TransferState:
        return self._states.get(key, TransferState.FAILED)

    def receive(self, key: str) -> list[Any] | None:
        with _LOCK:
            now = time.monotonic()
            for old in [k for k, (at, _) in self._inbox.items() if now - at > UNCLAIMED_S]:
                del self._inbox[old]  # never received: its request was not resumed
            held = self._inbox.pop(key, None)
        return None if held is None else held[1]

    def abort(self, key: str) -> None:
        with _LOCK:
            self._inbox.pop(key, None)
            self._aborted[key] = None
            forget_oldest(self._states, self._aborted)
            if self._states.get(key) is TransferState.PENDING:
                self._states[key] = TransferState.ABORTED

    def close(self) -> None:
        with _LOCK:
            if _ENDPOINTS.get((self.listen, self.rank)) is self:
                del _ENDPOINTS[(self.listen, self.rank)]
            self._inbox.clear()
