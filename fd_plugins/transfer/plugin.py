"""Registers fd's own KV transports through the fd_kv_transports hook, as a third-party transport would."""

from __future__ import annotations

from fd_core import hookimpl
from fd_core.transfer import TransportRegistrar

# The version of fd's plugin contract this plugin was written for (fd_core.contract).
FD_CONTRACT = "1.9"


@hookimpl
def fd_kv_transports(register: TransportRegistrar) -> None:
    """`shm` (one host: files in shared memory), `tcp` (any hosts: ZeroMQ) and `local` (one process: a dictionary)."""
    from fd_plugins.transfer.local import LocalTransport
    from fd_plugins.transfer.shm import ShmTransport
    from fd_plugins.transfer.tcp import TcpTransport

    register("shm", ShmTransport)
    register("tcp", TcpTransport)
    register("local", LocalTransport)
