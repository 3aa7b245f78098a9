"""`fd serve` started as a real subprocess on 127.0.0.1 (port 0), its address read from stderr, and every
process it started found by a marker in their environment (to prove none is left)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest

import leftovers

pytest.importorskip("fastapi", reason="fd serve needs the serve extra (pip install -e '.[cpu,test]' brings it)")

MARKER = "FDTEST_SERVE_MARKER"
# The ready line (docs/serving.md): once the model is loaded and requests are served, exactly this.
ADDRESS = re.compile(r"^fd serve: ready at (http://127\.0\.0\.1:\d+)$")
# The line printed once connections are accepted, before the model loads (/health answers 503 until ready).
LISTENING = re.compile(r"^fd serve: listening on (http://127\.0\.0\.1:\d+); GET /health answers 503 until the model "
                       r"is loaded$")
# A gate that refuses one request shape (13 new tokens), so that everything else is served.
GATE = """
from fd_core import hookimpl

@hookimpl
def fd_check_request(request):
    if request.sampling.max_new_tokens == 13:
        return "this device cannot generate 13 tokens"
    return None
"""


@dataclass
class Served:
    """A running `fd serve`: its process, base URL, the marker its processes carry, and its stderr so far."""

    process: subprocess.Popen[str]
    url: str
    marker: str
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None  # reads its stderr into `lines`

    def wait(self, timeout: float) -> int:
        """Its exit code, once its stderr is read to the end (so `lines` holds its last line)."""
        code = self.process.wait(timeout)
        if self.reader is not None:
            self.reader.join(10)
        return code

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60, group: bool = False) -> int:
        """Send `signum` (to its whole process group with `group`, as Ctrl-C in a terminal does), wait for the exit code
        (killed, and the test failed, if it does not come)."""
        if self.process.poll() is None:
            if group:
                os.killpg(self.process.pid, signum)
            else:
                self.process.send_signal(signum)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"fd serve did not exit within {timeout} s of signal {signum}:\n{self.stderr}") from None


def processes_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment carries `marker`."""
    return leftovers.processes_with(MARKER, marker)


def left_over(marker: str, wait: float = 3.0) -> list[int]:
    """Processes of the server still alive after `wait` seconds; they are killed, then returned."""
    return leftovers.left_over(MARKER, marker, wait)


def start_server(args: Sequence[str], site: Path | None = None, env: Mapping[str, str] | None = None,
                 timeout: float = 120, until: re.Pattern[str] | None = None) -> Served:
    """`fd serve ARGS --port 0` as a user starts it; returns once it prints its address, or a line matching `until`
    (fails with its stderr if it exits first)."""
    marker = uuid.uuid4().hex
    full = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    if site is not None:
        full["PYTHONPATH"] = os.pathsep.join([str(site), full.get("PYTHONPATH", "")])
    full.update({MARKER: marker, **(env or {})})
    process = subprocess.Popen([sys.executable, "-m", "fd_core.cli", "serve", *args, "--port", "0"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=full, start_new_session=True)  # its own process group, as a terminal gives a command
    served = Served(process, "", marker)
    found = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            served.lines.append(line.rstrip("\n"))
            match = ADDRESS.search(line.rstrip("\n"))
            if match and not served.url:
                served.url = match.group(1)
                found.set()
            if until is not None and until.search(line):
                found.set()
        found.set()

    served.reader = threading.Thread(target=read, daemon=True)
    served.reader.start()
    if not found.wait(timeout) or not (served.url or until is not None and any(until.search(x) for x in served.lines)):
        process.kill()
        process.wait()
        raise AssertionError(f"fd serve did not start (exit code {process.returncode}):\n{served.stderr}")
    return served


def finish(served: Served, interrupt: bool = False) -> None:
    """End a module's server: SIGTERM to it (exit 143), or with `interrupt` SIGINT to its whole process group, ranks
    included, as Ctrl-C does (exit 130); either way nothing may be left running."""
    code = served.stop(signal.SIGINT, group=True) if interrupt else served.stop()
    assert code == (130 if interrupt else 143), served.stderr
    assert left_over(served.marker) == []


def metric(text: str, name: str) -> float:
    """One unlabelled sample of Prometheus' text format."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics:\n{text}"
    return float(match.group(1))


def wait_for(predicate: Any, timeout: float, what: str) -> float:
    """Poll `predicate` until true; the seconds it took (fails naming `what` after `timeout`)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start
