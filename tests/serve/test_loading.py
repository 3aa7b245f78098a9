"""`fd serve` before its model is loaded: the HTTP server answers /health 503 "loading" and the API 503 until the
ready line; a stop signal while loading stops everything; a load that fails ends the server with its error; and the
warning for a server anyone can reach without a key."""

from __future__ import annotations

import re
import signal
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from fakedist import make_distribution
from serving import ADDRESS, LISTENING, Served, finish, left_over, start_server, wait_for

httpx = pytest.importorskip("httpx", reason="the serve tests need httpx (pip install -e '.[cpu,test]')")

GATE_FILE = "FDTEST_LOAD_GATE"
# Holds the model's loading (the rank's start, in the server's process at tp=1) until the test creates a file.
SLOW_LOAD = f"""
import os
import time

from fd_core import hookimpl


@hookimpl
def fd_rank_start(rank):
    gate = os.environ.get("{GATE_FILE}")
    if gate:
        open(gate + ".waiting", "w").close()  # the test signals once the load is held here
    deadline = time.monotonic() + 120
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
"""
LOADING = re.compile(r"^fd serve: loading .* on 1 rank\(s\)$")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_distribution(tmp_path_factory.mktemp("site"), "fd-slow-load", {"slow_load": SLOW_LOAD},
                             {"fd.plugins": {"slow_load": "slow_load"}})


@pytest.fixture
def gate(tmp_path: Path) -> Path:
    return tmp_path / "loaded"


@pytest.fixture
def held(site: Path, gate: Path) -> Iterator[Served]:
    """`fd serve` (the tiny preset, tp=1) whose model is still loading: its rank waits for `gate`."""
    served = start_server(["--tp", "1"], site=site, env={GATE_FILE: str(gate)}, until=LOADING)
    yield served
    gate.touch()
    if served.process.poll() is None:  # the test failed before it ended the server
        served.stop(signal.SIGKILL)
    left_over(served.marker)


def listening(served: Served) -> str:
    """The address of the listening line, printed before the model loads."""
    found = [m.group(1) for m in map(LISTENING.match, served.lines) if m]
    assert len(found) == 1, served.stderr
    return found[0]


def test_health_says_loading_until_the_ready_line_which_comes_once(held: Served, gate: Path) -> None:
    url = listening(held)
    assert not url.endswith(":0")
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.headers["retry-after"] == "5", health.text
    assert health.json()["status"] == "loading" and health.json()["model"] == "ernie4_5-tiny"
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        refused = httpx.request(method, f"{url}{path}", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
        error = refused.json()["error"]
        assert error["code"] == "loading" and set(error) == {"message", "type", "param", "code"}, error
    assert not held.url and not any(ADDRESS.match(line) for line in held.lines), held.stderr
    gate.touch()
    wait_for(lambda: bool(held.url), 120, "the ready line")
    assert held.url == url
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200, reply.text
    finish(held)
    ready = [line for line in held.lines if "ready" in line]
    assert ready == [f"fd serve: ready at {url}"], held.stderr
    # After every other line of the start, the address included, and before the drain's.
    start = [i for i, line in enumerate(held.lines) if "serving 'ernie4_5-tiny'" in line or "listening on" in line]
    assert max(start) < held.lines.index(ready[0]), held.stderr
    assert "Traceback" not in held.stderr


@pytest.mark.parametrize("signum, code, last", [
    (signal.SIGTERM, 143, "fd serve: terminated while loading; every rank was stopped"),
    pytest.param(signal.SIGINT, 130, "fd serve: interrupted while loading; every rank was stopped", marks=pytest.mark.xfail(
        strict=False, reason="a known, intermittent bug, cause not yet found: in two CI runs with the suite's workers "
        "side by side, Ctrl-C to the process group while a plugin's fd_rank_start held the load did not end fd serve "
        "within 45 s (it ends in under a second alone, and SIGTERM always does)")),
], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_loading_ends_everything(held: Served, gate: Path, signum: int, code: int,
                                                    last: str) -> None:
    url = listening(held)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503  # the HTTP server runs meanwhile
    scratch = {p for p in Path(tempfile.gettempdir()).glob("fd-serve-tiny-*") if str(p) in held.stderr}
    assert len(scratch) == 1, held.stderr  # the tiny preset's directory, named in its log line
    # Inside the rank's start (a plugin's hook), as a load that takes long is: not still importing or planning.
    wait_for(lambda: Path(f"{gate}.waiting").exists(), 120, "the load to reach the rank's start")
    assert held.stop(signum, timeout=45, group=signum == signal.SIGINT) == code, held.stderr
    assert held.lines[-1] == last, held.stderr
    assert "Traceback" not in held.stderr and not held.url, held.stderr
    assert left_over(held.marker) == []
    assert not any(p.exists() for p in scratch)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


def test_a_load_that_fails_ends_the_server_with_its_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    served = start_server(["--checkpoint", str(empty)], until=re.compile(r"^fd: error: "))
    try:
        code = served.wait(60)
    finally:
        if served.process.poll() is None:
            served.stop(signal.SIGKILL)
    assert code == 2, served.stderr
    listening(served)  # it had been listening
    assert served.lines[-1].startswith("fd: error: ") and "Traceback" not in served.stderr, served.stderr
    assert not any("ready" in line or "warning" in line for line in served.lines), served.stderr
    assert left_over(served.marker) == []


@pytest.mark.parametrize("key", [False, True], ids=["without-key", "with-key"])
def test_listening_beyond_this_machine_without_a_key_warns_once(tmp_path: Path, key: bool) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["--host", "0.0.0.0", "--checkpoint", str(empty), *(["--api-key", "k"] if key else [])]
    served = start_server(args, until=re.compile(r"^fd: error: "))
    assert served.wait(60) == 2, served.stderr
    warnings = [line for line in served.lines if "warning" in line]
    if key:
        assert warnings == [], served.stderr
        return
    assert len(warnings) == 1, served.stderr
    assert re.fullmatch(r"fd serve: warning: listening on 0\.0\.0\.0 without an API key: anyone who can reach port "
                        r"[1-9]\d* can use the server; set one with --api-key KEY \(or \$FD_API_KEY\)",
                        warnings[0]), warnings[0]
