"""The KV transfer contract (contract 1.9): how a prefill instance hands a request's keys and values to a decode
instance, through a transport a plugin provides (`fd_kv_transports`).

The runtime reads a prompt's keys and values out of its cache with the `read_kv_cache` op, so what a transport moves
is host arrays: per rank, one key array and one value array per layer, [tokens, kv_heads, head_dim] each. It never
sees a cache's layout or its blocks, and the two instances' block sizes may differ. Rank r of the prefill instance
sends to rank r of the decode instance: both sides' tp must be equal.

A transport is made once per rank by `factory(listen, rank)`. `listen` is the instance's transfer address, one
string a peer sends to (what it means is the transport's: a shared-memory name, host:port, ...); the transport maps
it and the rank to its own endpoint.

A send's states, on the sending side:

    send() -> PENDING -> DONE      the peer holds every part: its receive(key) returns them
                      -> FAILED    the peer is gone, refused it, or `timeout` seconds passed first
                      -> ABORTED   abort(key) here before DONE

A state once DONE, FAILED or ABORTED stays so; a key never sent is FAILED. FAILED and ABORTED leave nothing behind
on either side: a transport discards a part-sent payload itself. A receiver keeps what arrived until it is received
or aborted, and may drop it once it is older than UNCLAIMED_S (its request was never resumed: a router gone between
the two halves, say).
"""

from __future__ import annotations

import enum
import json
import struct
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

if TYPE_CHECKING:
    import numpy as np


# Seconds a receiver must keep an arrived payload nobody has received yet; after that it may drop it.
UNCLAIMED_S = 600.0


class TransferState(str, enum.Enum):
    """Where one send is (see the module's state machine)."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def final(self) -> bool:
        """Whether the send can change no more."""
        return self is not TransferState.PENDING


class KVTransport(Protocol):
    """One rank's end of a transport: it sends to the same rank of other instances and receives what they send."""

    def send(self, key: str, peer: str, parts: Sequence["np.ndarray"], timeout: float) -> None:
        """Start sending `parts` (C-contiguous arrays) under `key` to instance address `peer`; return at once."""

    def state(self, key: str) -> TransferState:
        """Where the send of `key` is (FAILED for a key never sent here)."""

    def receive(self, key: str) -> list["np.ndarray"] | None:
        """The parts sent here under `key`, equal in dtype, shape and bytes, once (None while they have not arrived)."""

    def abort(self, key: str) -> None:
        """Stop a send of `key` and discard what arrived or arrives here under it."""

    def close(self) -> None:
        """Stop listening and free everything held; sends still pending become FAILED at their peer."""


# factory(listen, rank): the transport of one rank of the instance whose transfer address is `listen`.
TransportFactory = Callable[[str, int], KVTransport]
# register(name, factory): `--kv-transport NAME` (LLM(kv_transport=NAME)) makes each rank's transport with it.
TransportRegistrar = Callable[[str, TransportFactory], None]


# How many finished sends' states, and aborted keys, a transport keeps (the oldest are forgotten past it).
REMEMBERED = 4096


def forget_oldest(states: dict[str, TransferState], aborted: dict[str, None]) -> None:
    """Keep a transport's records bounded: the oldest final states and aborted keys past REMEMBERED go (a state
    forgotten reads FAILED, as a key never sent does)."""
    if len(states) > REMEMBERED:
        for key in [k for k, v in states.items() if v.final][: len(states) - REMEMBERED]:
            del states[key]
    while len(aborted) > REMEMBERED:
        del aborted[next(iter(aborted))]


def pack(parts: Sequence["np.ndarray"]) -> tuple[bytes, list[memoryview]]:
    """A header describing `parts` (dtype, shape, byte count each) and their bytes, for a transport that moves bytes:
    `unpack(header, payload)` gives the arrays back."""
    import numpy as np

    arrays = [np.ascontiguousarray(p) for p in parts]
    described = [{"dtype": str(p.dtype), "shape": list(p.shape), "bytes": int(p.nbytes)} for p in arrays]
    text = json.dumps(described).encode()
    return struct.pack("<Q", len(text)) + text, [p.data.cast("B") for p in arrays]


def header_size(prefix: bytes) -> int:
    """The size of a header from its first 8 bytes."""
    return 8 + struct.unpack("<Q", prefix[:8])[0]


def unpack(header: bytes, payload: Any, copy: bool = True) -> list["np.ndarray"]:
    """The arrays `pack` described, read from `payload` (bytes-like, the parts end to end): each a copy, or views of
    `payload` when `copy` is False (a buffer the caller owns and gives away)."""
    import numpy as np

    described = json.loads(bytes(header[8:]).decode())
    out, offset = [], 0
    view = memoryview(payload).cast("B")
    for d in described:
        end = offset + int(d["bytes"])
        if end > len(view):
            raise ValueError(f"a KV payload is {len(view)} bytes, and its header describes at least {end}")
        array = np.frombuffer(view[offset:end], dtype=np.dtype(d["dtype"])).reshape(d["shape"])
        out.append(array.copy() if copy else array)
        offset = end
    return out
