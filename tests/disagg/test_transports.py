"""fd's own KV transports through the transport suite, and what only the shared-memory one can show: a peer killed
outright, a directory taken over from a dead owner, nothing left in shared memory after close."""

from __future__ import annotations

import multiprocessing
import os
import signal
import uuid
from typing import Any

import pytest

from fd_core.testing import TransportSuite
from fd_core.testing.transports import parts_of, same, settle
from fd_core.transfer import TransferState


class TestShm(TransportSuite):
    @pytest.fixture
    def transport_name(self) -> str:
        return "shm"


class TestTcp(TransportSuite):
    @pytest.fixture
    def transport_name(self) -> str:
        pytest.importorskip("zmq", reason="the tcp transport needs pyzmq (the transfer extra)")
        return "tcp"

    @pytest.fixture
    def new_address(self) -> Any:
        """127.0.0.1 and a port with the next few free (rank r listens at PORT + r)."""
        return free_ports


def free_ports() -> str:
    import socket

    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 65000 and all(_free(port + r) for r in range(1, 4)):
            return f"127.0.0.1:{port}"


def _free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class TestLocal(TransportSuite):
    @pytest.fixture
    def transport_name(self) -> str:
        return "local"


def _listen_then_wait(address: str, ready: "multiprocessing.synchronize.Event") -> None:
    from fd_plugins.transfer.shm import ShmTransport

    ShmTransport(address, 0)
    ready.set()
    signal.pause()


def test_a_killed_peer_fails_the_send_and_its_address_is_taken_over() -> None:
    """A receiver killed outright (no close) leaves its directory; a send to it ends FAILED (its owner is gone), and
    the next instance listening at its address takes the directory over."""
    from fd_plugins.transfer.shm import ShmTransport, endpoint

    address = f"k{uuid.uuid4().hex[:10]}"
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    peer = context.Process(target=_listen_then_wait, args=(address, ready))
    peer.start()
    try:
        assert ready.wait(60)
        sender = ShmTransport(f"s{uuid.uuid4().hex[:10]}", 0)
        try:
            sender.send("alive", address, parts_of(0), 5.0)
            assert settle(sender, "alive") is TransferState.DONE
            os.kill(peer.pid, signal.SIGKILL)
            peer.join(10)
            assert os.path.isdir(endpoint(address, 0)), "a killed owner cannot remove its directory"
            sender.send("dead", address, parts_of(1), 5.0)
            assert settle(sender, "dead") is TransferState.FAILED
            successor = ShmTransport(address, 0)
            assert successor.receive("alive") is None, "the dead instance's payload outlived it"
            sender.send("again", address, parts_of(2), 5.0)
            assert settle(sender, "again") is TransferState.DONE
            assert same(successor.receive("again"), parts_of(2)) is None
            successor.close()
        finally:
            sender.close()
    finally:
        if peer.is_alive():
            peer.kill()
        peer.join(10)


def test_close_leaves_nothing_in_shared_memory() -> None:
    """After both ends close (one with a payload never received, one mid-send), neither directory is left."""
    from fd_plugins.transfer.shm import ShmTransport, endpoint

    a, b = f"a{uuid.uuid4().hex[:10]}", f"b{uuid.uuid4().hex[:10]}"
    sender, receiver = ShmTransport(a, 3), ShmTransport(b, 3)
    sender.send("kept", b, parts_of(0), 5.0)
    assert settle(sender, "kept") is TransferState.DONE
    sender.send("big", b, parts_of(1, tokens=3000, layers=10), 5.0)
    sender.close()
    receiver.close()
    assert not os.path.exists(endpoint(a, 3)) and not os.path.exists(endpoint(b, 3))


def test_a_bad_name_is_refused_in_one_line() -> None:
    from fd_core.errors import ConfigError
    from fd_plugins.transfer.shm import ShmTransport

    with pytest.raises(ConfigError, match="not a name"):
        ShmTransport("../etc", 0)


COUNTING_TRANSPORT = '''
from fd_core import hookimpl
from fd_plugins.transfer.local import LocalTransport

FD_CONTRACT = "1.9"
SENT = []


class Counting(LocalTransport):
    def send(self, key, peer, parts, timeout):
        SENT.append((key, self.rank, sum(p.nbytes for p in parts)))
        super().send(key, peer, parts, timeout)


@hookimpl
def fd_kv_transports(register):
    register("counting", Counting)
'''

CLASHING_TRANSPORT = '''
from fd_core import hookimpl

@hookimpl
def fd_kv_transports(register):
    register("shm", object)
'''


def test_a_third_party_transport_carries_a_hand_over(install_plugin: Any) -> None:
    """A package's fd_kv_transports (an entry point in fd.plugins) is listed by `fd plugins` and carries a request from
    a prefill instance to a decode instance, with the same tokens."""
    from fd_core.host.loading import load_plugins
    from fd_core.runtime import LLM, SamplingParams

    install_plugin("fd-counting", {"counting_transport": COUNTING_TRANSPORT},
                   {"fd.plugins": {"counting": "counting_transport"}})
    assert load_plugins({}).transports["counting"][1] == "counting"
    import counting_transport

    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM(model="ernie4_5", kv_transport="counting") as prefill, \
            LLM(model="ernie4_5", kv_transport="counting") as decode:
        alone = decode.generate(list(range(4, 30)), sampling)[0]
        handoff = prefill.prefill(list(range(4, 30)), sampling, to=decode.kv_address)
        assert decode.resume(handoff, sampling).result().token_ids == alone.token_ids
    assert [(key, rank) for key, rank, _ in counting_transport.SENT] == [(handoff.key, 0)]


def test_a_transport_name_taken_twice_blames_the_newcomer(install_plugin: Any) -> None:
    from fd_core.errors import PluginError
    from fd_core.host.loading import load_plugins

    install_plugin("fd-clash", {"clash_transport": CLASHING_TRANSPORT}, {"fd.plugins": {"clash": "clash_transport"}})
    with pytest.raises(PluginError, match="plugin 'clash' adds KV transport 'shm', which 'transfer' already provides; "
                                          "rename it in 'clash'"):
        load_plugins({})


def test_a_dead_instances_directory_is_removed_by_the_next_one() -> None:
    """A directory whose owner exited (killed, it could not remove it) is removed when another instance starts, once it
    is a minute old; a live instance's, however old, stays."""
    from fd_plugins.transfer.shm import ShmTransport, endpoint

    dead, live = endpoint(f"d{uuid.uuid4().hex[:10]}", 0), ShmTransport(f"l{uuid.uuid4().hex[:10]}", 0)
    try:
        os.mkdir(dead)
        with open(os.path.join(dead, "owner"), "w") as f:
            f.write("999999999")  # no such process
        for directory in (dead, live.directory):
            os.utime(directory, (0, 0))
        ShmTransport(f"n{uuid.uuid4().hex[:10]}", 0).close()
        assert not os.path.exists(dead) and os.path.isdir(live.directory)
    finally:
        live.close()
