"""Multi-host glue: two single-process nodes started by `python -m paddle.distributed.launch` on loopback."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from fakedist import run_fd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launched_nodes_run_the_same_job_as_one_process(tmp_path: Path) -> None:
    fd = str(Path(sys.executable).with_name("fd"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FD_", "PADDLE_"))}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "paddle.distributed.launch", "--log_level", "WARNING", "--nnodes", "2",
             "--nproc_per_node", "1", "--master", f"127.0.0.1:{port}", "--rank", str(rank),
             "--log_dir", str(tmp_path / f"log{rank}"), fd, "run", "--steps", "5", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    # As the README starts them, the launcher's LAUNCH INFO chatter stays off the terminal, and fd's own
    # process (the worker log) shows nothing of Paddle's: no warning, no glog line.
    assert not [line for out in outputs for line in out.splitlines() if "LAUNCH INFO" in line], outputs
    log = (tmp_path / "log0" / "workerlog.0").read_text()
    assert not re.search(r"Warning|^[IWE]\d{4} ", log, re.M), log
    summary = json.loads(log[log.index("{\n"):])
    assert summary["tp"] == 2 and summary["platform"] == "cpu"
    single = run_fd(["run", "--tp", "1", "--steps", "5", "--json"])
    assert single.returncode == 0, single.stderr
    assert summary["tokens"] == json.loads(single.stdout)["tokens"]
