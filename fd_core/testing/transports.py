"""KV transport conformance (contract 1.9): subclass TransportSuite in a transport plugin's tests and provide the
`transport_name` fixture (the name its fd_kv_transports registers), and `new_address` where its addresses have a form
of their own. Each check makes a sender and a receiver at the
same rank of two fresh instance addresses, as two instances' ranks would be."""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Iterator

import pytest

from fd_core.transfer import KVTransport, TransferState

Pair = tuple[KVTransport, KVTransport, str]


def settle(transport: KVTransport, key: str, within: float = 20.0) -> TransferState:
    """The send's state once it is final (or PENDING still, after `within` seconds)."""
    deadline = time.monotonic() + within
    state = transport.state(key)
    while not state.final and time.monotonic() < deadline:
        time.sleep(0.001)
        state = transport.state(key)
    return state


def parts_of(seed: int, tokens: int = 37, layers: int = 3) -> list[Any]:
    """A hand-over's parts as the engine sends them: a meta row, then a key and a value per layer, of several dtypes
    (float32, bfloat16's bits as uint16, float16) with NaN and infinity among them (sent as bits, not as numbers)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out: list[Any] = [np.asarray([tokens], dtype=np.int64)]
    for layer in range(layers):
        for _ in range(2):
            values = rng.standard_normal((tokens, 2, 16)).astype(np.float32)
            values[0, 0, layer] = (np.nan, np.inf, -np.inf)[layer % 3]
            out.append((values, values.view(np.uint32).astype(np.uint16), values.astype(np.float16))[layer % 3])
    return out


def same(got: Any, sent: list[Any]) -> str | None:
    """What differs between what arrived and what was sent (dtype, shape, bytes), or None."""
    if got is None:
        return "nothing arrived"
    if len(got) != len(sent):
        return f"{len(got)} parts arrived, {len(sent)} were sent"
    for i, (a, b) in enumerate(zip(got, sent, strict=True)):
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            return f"part {i} arrived as {a.dtype} {list(a.shape)}, sent {b.dtype} {list(b.shape)}, or its bytes differ"
    return None


class TransportSuite:
    """Every check of a KV transport: bit-exact parts, sends completed out of order, aborts on either side, a peer
    that closed, a send past its timeout, and addresses in use (free again after close)."""

    @pytest.fixture
    def transport_name(self) -> str:
        raise NotImplementedError("provide the transport_name fixture: the name your fd_kv_transports registers")

    @pytest.fixture
    def factory(self, transport_name: str) -> Callable[[str, int], KVTransport]:
        from fd_core.host.loading import load_plugins

        transports = load_plugins().transports
        assert transport_name in transports, (
            f"no plugin registers KV transport {transport_name!r} (registered: {', '.join(sorted(transports))})")
        return transports[transport_name][0]

    @pytest.fixture
    def new_address(self) -> Callable[[], str]:
        """Makes a fresh instance address nobody listens at (override it for a transport whose addresses have a form
        of their own: fd's `tcp` takes HOST:PORT)."""
        return lambda: f"a{uuid.uuid4().hex[:10]}"

    @pytest.fixture
    def pair(self, factory: Callable[[str, int], KVTransport], new_address: Callable[[], str]) -> Iterator[Pair]:
        """(sender, receiver, the receiver's address) at rank 1, closed afterwards."""
        made: list[KVTransport] = []
        try:
            sender = factory(new_address(), 1)
            made.append(sender)
            address = new_address()
            receiver = factory(address, 1)
            made.append(receiver)
            yield sender, receiver, address
        finally:
            for transport in made:
                transport.close()

    def test_parts_arrive_bit_exact_once(self, pair: Pair) -> None:
        """Every part arrives with its dtype, shape and bytes (NaN and infinity included), and only once."""
        sender, receiver, address = pair
        sent = parts_of(0)
        sender.send("k0", address, sent, 20.0)
        assert settle(sender, "k0") is TransferState.DONE
        assert same(receiver.receive("k0"), sent) is None
        assert receiver.receive("k0") is None, "a payload was received twice"

    def test_sends_complete_out_of_order(self, pair: Pair) -> None:
        """Several sends in flight, received in another order than sent, each whole and each its own."""
        sender, receiver, address = pair
        sent = {f"k{i}": parts_of(i, tokens=5 + 40 * i) for i in range(4)}
        for key, parts in sent.items():
            sender.send(key, address, parts, 20.0)
        for key in reversed(list(sent)):
            assert settle(sender, key) is TransferState.DONE, key
            assert same(receiver.receive(key), sent[key]) is None, key

    def test_a_receiver_abort_discards_what_arrived_and_arrives(self, pair: Pair) -> None:
        """abort on the receiving side: what arrived under the key is gone, and a later send under it is not kept."""
        sender, receiver, address = pair
        sender.send("gone", address, parts_of(1), 20.0)
        assert settle(sender, "gone") is TransferState.DONE
        receiver.abort("gone")
        assert receiver.receive("gone") is None
        sender.send("late", address, parts_of(2), 20.0)
        receiver.abort("late")
        settle(sender, "late")
        assert receiver.receive("late") is None

    def test_a_sender_abort_ends_the_send_and_leaves_all_or_nothing(self, pair: Pair) -> None:
        """abort on the sending side mid-send: the state is final, and the receiver has either every part (it was
        DONE first) or nothing."""
        sender, receiver, address = pair
        sent = parts_of(3, tokens=2000, layers=8)
        sender.send("mid", address, sent, 20.0)
        sender.abort("mid")
        state = settle(sender, "mid")
        assert state.final, "an aborted send stayed pending"
        got = receiver.receive("mid")
        if state is TransferState.DONE:
            assert same(got, sent) is None
        else:
            assert got is None, f"a send that ended {state.value} left parts at the receiver"

    def test_a_peer_that_closed_fails_the_send(
        self, factory: Callable[[str, int], KVTransport], new_address: Callable[[], str]
    ) -> None:
        """A send to an address whose receiver closed, or that nobody listens at, ends FAILED."""
        sender = factory(new_address(), 0)
        try:
            address = new_address()
            factory(address, 0).close()
            sender.send("k", address, parts_of(4), 5.0)
            assert settle(sender, "k") is TransferState.FAILED
            sender.send("k2", new_address(), parts_of(4), 5.0)
            assert settle(sender, "k2") is TransferState.FAILED
            assert sender.state("never-sent") is TransferState.FAILED
        finally:
            sender.close()

    def test_a_send_past_its_timeout_fails_and_leaves_nothing(self, pair: Pair) -> None:
        """12 MB given a microsecond (no memory moves that fast) ends FAILED, with nothing at the receiver; the next
        send under another key goes through."""
        sender, receiver, address = pair
        sent = parts_of(5, tokens=4000, layers=12)
        sender.send("slow", address, sent, 1e-6)
        assert settle(sender, "slow") is TransferState.FAILED
        assert receiver.receive("slow") is None, "a send that timed out left parts at the receiver"
        sender.send("next", address, parts_of(6), 20.0)
        assert settle(sender, "next") is TransferState.DONE
        assert same(receiver.receive("next"), parts_of(6)) is None

    def test_an_address_in_use_is_refused_and_free_after_close(
        self, factory: Callable[[str, int], KVTransport], new_address: Callable[[], str]
    ) -> None:
        """Two instances cannot listen at one address and rank (one line saying so); after close it is free."""
        from fd_core.errors import FdError

        address = new_address()
        first = factory(address, 0)
        try:
            with pytest.raises(FdError, match="in use"):
                factory(address, 0)
            factory(address, 1).close()  # another rank of the same instance is another endpoint
        finally:
            first.close()
        factory(address, 0).close()
