"""`fd serve`'s one-line errors, before any model loads: the serve extra missing, a port already taken."""

from __future__ import annotations

import importlib.util
import socket
import time

import pytest

from fd_core import cli


def test_without_the_serve_extra_fd_serve_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("fastapi", "uvicorn") else real(name, *a))
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err == ("fd: error: fd serve needs the serve extra (fastapi and uvicorn not installed): pip install "
                   "'.[serve]' in a checkout of fd-backends (docs/install.md)\n")


def test_a_taken_port_is_one_line_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("fastapi", reason="fd serve needs the serve extra (pip install -e '.[cpu,test]' brings it)")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        assert cli.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (err[-1].startswith(f"fd: error: cannot listen on 127.0.0.1:{port} (")
            and err[-1].endswith("choose another --port or --host"))
    assert not any("loading" in line for line in err) and time.monotonic() - start < 5
