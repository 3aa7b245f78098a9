"""A rank of `fd serve --tp 2` that dies: the next request gets 503 naming the rank, the server ends with the
rank named in its one error line (exit 2), and no process is left; never a hang. And SIGTERM while the ranks load."""

from __future__ import annotations

import os
import re
import signal
import tempfile
from pathlib import Path

import pytest

from serving import left_over, processes_with, start_server

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx (pip install -e '.[cpu,test]')")


def ranks_of(marker: str, server_pid: int) -> list[int]:
    """The server's rank processes: multiprocessing's spawned children (not its resource tracker)."""
    found = []
    for pid in processes_with(marker):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if pid != server_pid and "spawn_main" in command:
            found.append(pid)
    return sorted(found)


def test_a_rank_that_dies_ends_the_server_naming_it() -> None:
    served = start_server(["--tp", "2", "--rank-timeout", "5", "--stall-timeout", "20"])
    try:
        ranks = ranks_of(served.marker, served.process.pid)
        assert len(ranks) == 2, ranks
        ok = httpx.post(f"{served.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200, ok.text
        os.kill(ranks[-1], signal.SIGKILL)
        try:
            reply = httpx.post(f"{served.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        except httpx.HTTPError:
            reply = None  # the server may already have ended on its own: also not a hang
        if reply is not None:
            assert reply.status_code == 503, reply.text
            assert "rank" in reply.json()["error"]["message"], reply.text
        code = served.wait(60)
    finally:
        if served.process.poll() is None:
            served.stop(signal.SIGKILL)
    assert code == 2, served.stderr
    last = served.lines[-1]
    assert last.startswith("fd: error: rank ") and "Traceback" not in served.stderr, served.stderr
    assert left_over(served.marker) == []


def test_sigterm_while_the_ranks_load_stops_them_and_removes_the_tiny_preset() -> None:
    before = set(Path(tempfile.gettempdir()).glob("fd-serve-tiny-*"))
    served = start_server(["--tp", "2"], until=re.compile(r"loading .* on 2 rank"))
    code = served.stop(signal.SIGTERM, timeout=45)
    assert code == 143, served.stderr
    assert served.lines[-1] == "fd serve: terminated while loading; every rank was stopped", served.stderr
    assert "Traceback" not in served.stderr
    assert left_over(served.marker) == []
    assert set(Path(tempfile.gettempdir()).glob("fd-serve-tiny-*")) <= before  # its directory is gone
