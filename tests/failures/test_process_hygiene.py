"""The processes of a run: what plugins print, signals and the temporary directories of a run, nothing
listening beyond loopback (the rendezvous store), a read-only or full /dev/shm, and where a run's clock
starts. Each case runs the real `fd` in a subprocess and checks its exit code and its one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kit
from conftest import fd_env, left_over, new_marker, play_concurrently, run_fd

PRINTER = """
import os
import sys

from fd_core import hookimpl

print("PRINTER-IMPORT")


@hookimpl
def fd_graph_eligibility(model_config, parallel_config):
    print("PRINTER-VOTE")
    return None


@hookimpl
def fd_clean_memory_fragments(state_dict):
    print("PRINTER-CLEAN", flush=True)
    sys.stdout.write("PRINTER-WRITE\\n")


@hookimpl
def fd_check_request(request, model_config, parallel_config, stream):
    print("PRINTER-GATE")
    return None
"""


@pytest.fixture(scope="module")
def printer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A distribution holding an extension plugin that prints at import and from hooks run in
    the parent and in the ranks."""
    from fakedist import make_distribution

    root = tmp_path_factory.mktemp("printer")
    return make_distribution(root, "fd-printer", {"fd_printer": PRINTER}, {"fd.plugins": {"printer": "fd_printer"}})


def _printed(stream: str) -> list[str]:
    return sorted({line for line in stream.splitlines() if line.startswith("PRINTER-")})


# At tp=1 (in fd's own process) the text test below covers `fd run`.
@pytest.mark.parametrize("args", [["explain", "--json"], ["run", "--tp", "2", "--steps", "2", "--json"]],
                         ids=["explain", "run-tp2"])
def test_what_a_plugin_prints_never_mixes_with_json(printer: Path, args: list[str]) -> None:
    """Prints at import, from a vote, the request gate and a rank's cleanup land on stderr; stdout is JSON alone."""
    run = run_fd(args, printer, timeout=120)
    assert run.returncode == 0, run.stderr
    json.loads(run.stdout)  # nothing but the JSON
    assert _printed(run.stdout) == []
    expected = {"PRINTER-IMPORT", "PRINTER-VOTE"} | (
        {"PRINTER-CLEAN", "PRINTER-WRITE", "PRINTER-GATE"} if args[0] == "run" else set()
    )
    assert expected <= set(_printed(run.stderr)), (expected - set(_printed(run.stderr)), run.stderr)


def test_what_a_plugin_prints_never_lands_in_the_text(printer: Path, tmp_path: Path) -> None:
    """`fd run --prompt ... > out.txt` keeps only the generated text."""
    checkpoint = tmp_path / "ckpt"
    saved = run_fd(["save-random", "--model", "ernie4_5", str(checkpoint)])
    assert saved.returncode == 0, saved.stderr
    kit.sentencepiece_tokenizer(checkpoint)
    plain = run_fd(["run", "--tp", "1", "--checkpoint", str(checkpoint), "--prompt", "hello", "--steps", "3"])
    printed = run_fd(["run", "--tp", "1", "--checkpoint", str(checkpoint), "--prompt", "hello", "--steps", "3"],
                     printer)
    assert plain.returncode == printed.returncode == 0, printed.stderr
    assert printed.stdout == plain.stdout, printed.stdout
    assert {"PRINTER-IMPORT", "PRINTER-CLEAN"} <= set(_printed(printed.stderr))


# --- signals, temporary directories and the rendezvous store during `fd run --tp 2` ---------------------

RUN = ["run", "--tp", "2", "--steps", "2000", "--graph", "off", "--rank-timeout", "3"]
LEFT_BEHIND = ("fd-ranks-", "fd-rank-errors-")


def listening(pid: int) -> list[str]:
    """"address:port" of every TCP socket process `pid` listens on (from /proc,
    as failprobe_plugin.py reads its own)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            host = ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)) if len(address) == 8 else address
            found.append(f"{host}:{int(port, 16)}")
    return sorted(found)


def _left_behind(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith(LEFT_BEHIND))


class Scenario:
    """One `fd run --tp 2` in its own TMPDIR, signalled once both ranks decode."""

    def __init__(self, name: str, probe_root: Path, work: Path, target: str, sig: signal.Signals) -> None:
        self.name, self.target, self.sig = name, target, sig
        self.tmpdir = work / f"{name}-tmp"
        self.probe = work / f"{name}-probe"
        self.tmpdir.mkdir()
        self.probe.mkdir()
        self.marker = new_marker()
        env = fd_env(self.marker, probe_root, {"FDTEST_PROBE_DIR": str(self.probe), "FDTEST_PROBE_AT": "20",
                                               "TMPDIR": str(self.tmpdir)})
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-m", "fd_core.cli", *RUN], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.listening: dict[str, list[str]] = {}
        self.during: list[str] = []

    def play(self) -> None:
        deadline = time.monotonic() + 90
        while not all((self.probe / f"rank{r}.json").exists() for r in (0, 1)):
            assert self.proc.poll() is None and time.monotonic() < deadline, (
                f"{self.name}: the ranks never reached decoding")
            time.sleep(0.05)
        self.listening["parent"] = listening(self.proc.pid)
        for r in (0, 1):
            self.listening[f"rank {r}"] = json.loads((self.probe / f"rank{r}.json").read_text())["listening"]
        self.during = _left_behind(self.tmpdir)
        self.signalled_at = time.monotonic()
        if self.target == "group":
            os.killpg(self.proc.pid, self.sig)
        else:
            os.kill(self.proc.pid, self.sig)
        try:
            self.out, self.err = self.proc.communicate(timeout=60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.out, self.err = self.proc.communicate()
        self.seconds = time.monotonic() - self.signalled_at
        self.survivors = left_over(self.marker)
        self.after = _left_behind(self.tmpdir)


SCENARIOS = {
    "sighup": ("parent", signal.SIGHUP),
    "sighup-group": ("group", signal.SIGHUP),  # a closed terminal signals the whole job
    "sigquit": ("parent", signal.SIGQUIT),
    "sigkill": ("parent", signal.SIGKILL),
}


@pytest.fixture(scope="module")
def played(probe_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Scenario | BaseException]:
    work = tmp_path_factory.mktemp("signals")

    def play(name: str) -> Scenario:
        scenario = Scenario(name, probe_root, work, *SCENARIOS[name])
        scenario.play()
        return scenario

    return play_concurrently(list(SCENARIOS), play)  # type: ignore[return-value]


def scenario(played: dict, name: str) -> Scenario:
    result = played[name]
    if isinstance(result, BaseException):
        raise result
    return result


@pytest.mark.parametrize(("name", "code", "line"), [
    ("sighup", 129, "fd: terminated by SIGHUP; every rank was stopped"),
    ("sighup-group", 129, "fd: terminated by SIGHUP; every rank was stopped"),
    ("sigquit", 131, "fd: terminated by SIGQUIT; every rank was stopped"),
])
def test_sighup_and_sigquit_stop_every_rank_like_sigterm(played: dict, name: str, code: int, line: str) -> None:
    """Exit 128 + the signal, one line, no process and no temporary directory left (SIGTERM's
    own test is in test_ranks.py)."""
    s = scenario(played, name)
    assert s.proc.returncode == code, s.err
    assert s.err.strip().splitlines()[-1] == line, s.err
    assert "Traceback" not in s.err and s.out == "", s.err
    assert s.seconds < 10
    assert s.survivors == []
    assert s.during, "the run's directories should exist while it runs (else this test checks nothing)"
    assert s.after == [], s.after


def test_what_a_killed_run_left_behind_is_removed_by_the_next_run(played: dict) -> None:
    """SIGKILL runs no code of fd's: its directories stay until the next run, which removes those of dead processes."""
    s = scenario(played, "sigkill")
    assert s.proc.returncode == -signal.SIGKILL
    assert s.after, "SIGKILL leaves the run's directories (else this test checks nothing)"
    for name in s.after:  # as if killed a while ago (a live run's directory is never touched)
        os.utime(s.tmpdir / name, (time.time() - 3600, time.time() - 3600))
    live = s.tmpdir / f"fd-ranks-{os.getpid()}-live"  # a live process's: kept
    live.mkdir()
    os.utime(live, (time.time() - 3600, time.time() - 3600))
    again = run_fd(["run", "--tp", "2", "--steps", "1"], env={"TMPDIR": str(s.tmpdir)})
    assert again.returncode == 0, again.stderr
    assert _left_behind(s.tmpdir) == [live.name]


def test_the_rendezvous_store_listens_on_loopback_only(played: dict) -> None:
    """The spawning process serves the store on 127.0.0.1; no rank listens beyond loopback
    (Paddle's store would, on 0.0.0.0)."""
    s = scenario(played, "sighup")
    assert len(s.listening["parent"]) == 1 and s.listening["parent"][0].startswith("127.0.0.1:"), s.listening
    assert all(a.startswith("127.") for addresses in s.listening.values() for a in addresses), s.listening



# --- the clock, /dev/shm and the rendezvous store under a launcher --------------------------------------


def test_the_clock_starts_when_fd_starts_not_when_its_process_was_created() -> None:
    """`bash -c 'sleep 3 && exec fd run'`: the process was created 3 s before fd; none of those 3 s is fd's."""
    marker = new_marker()
    script = f"sleep 3 && exec {sys.executable} -m fd_core.cli run --tp 1 --steps 2 --json"
    began = time.monotonic()
    done = subprocess.run(["bash", "-c", script], env=fd_env(marker), capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - began
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # Had the 3 s counted, fd's start (and its wall time) would hold them: all of this run's wall time but the steps
    # (a fraction of a second). Against the measured wall time, not a fixed bound: a loaded machine imports slowly.
    assert result["timings_s"]["start"] <= wall - 2.7, (wall, result["timings_s"])
    assert result["wall_s"] <= wall - 2.7, (wall, result)



def _in_private_shm(mount: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """`fd args` in a mount namespace of its own whose /dev/shm is `mount` (a shell
    fragment); the host's is untouched."""
    script = f"{mount} && exec {sys.executable} -m fd_core.cli {' '.join(args)}"
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], env=fd_env(new_marker()),
                          capture_output=True, text=True, timeout=120)


def _can_mount() -> bool:
    if os.geteuid() != 0 or not Path("/dev/shm").is_dir():
        return False
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_mount(), reason="needs root and unshare to give a run a /dev/shm of its own")
@pytest.mark.parametrize(("mount", "problem"), [
    ("mount -t tmpfs -o ro,size=1m tmpfs /dev/shm", "Read-only file system: /dev/shm is not writable"),
    ("mount -t tmpfs -o size=64k tmpfs /dev/shm && dd if=/dev/zero of=/dev/shm/fill bs=4k count=100 2>/dev/null; true",
     "No space left on device: /dev/shm is full (0 bytes free)"),
], ids=["read-only", "full"])
def test_a_read_only_or_full_dev_shm_is_named_with_the_fix(mount: str, problem: str) -> None:
    done = _in_private_shm(mount, ["run", "--tp", "2", "--steps", "2"])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"fd: error: starting the ranks failed: {problem}; the ranks' locks and shared memory live there: "
        "make it writable with free space (docker run --shm-size), or run with --tp 1"), done.stderr


def test_the_loopback_store_speaks_paddles_store_protocol() -> None:
    """Paddle's own TCPStore client (the independent oracle: what every rank runs) against fd's server."""
    import threading

    from paddle.base import core

    from fd_core.runtime.ranks.rendezvous import LoopbackStore

    with LoopbackStore() as server:
        assert server.host == "127.0.0.1"
        assert [a for a in listening(os.getpid()) if a.endswith(f":{server.port}")] == [server.address]
        first = core.TCPStore("127.0.0.1", server.port, False, 2, 30)
        second = core.TCPStore("127.0.0.1", server.port, False, 2, 30)
        first.set("key", "a value")
        assert second.get("key") == b"a value"
        assert first.add("count", 2) == 2 and second.add("count", 3) == 5
        got: list[bytes] = []
        waiter = threading.Thread(target=lambda: got.append(second.get("later")))  # blocks until it is set
        waiter.start()
        time.sleep(0.3)
        assert got == []
        first.set("later", "now")
        waiter.join(10)
        assert got == [b"now"]
        second.wait("later")


def test_under_a_launcher_rank_0_serves_the_store_on_the_master_address_only(probe_root: Path, tmp_path: Path) -> None:
    """Two single-process nodes (`paddle.distributed.launch --master 127.0.0.1:PORT`):
    no rank listens beyond the address given."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    probe = tmp_path / "probe"
    probe.mkdir()
    marker = new_marker()
    env = fd_env(marker, probe_root, {"FDTEST_PROBE_DIR": str(probe), "FDTEST_PROBE_AT": "1"})
    env = {k: v for k, v in env.items() if not k.startswith("PADDLE_")}
    fd = str(Path(sys.executable).with_name("fd"))
    nodes = [
        subprocess.Popen([sys.executable, "-m", "paddle.distributed.launch", "--log_level", "WARNING", "--nnodes", "2",
                          "--nproc_per_node", "1", "--master", f"127.0.0.1:{port}", "--rank", str(rank),
                          "--log_dir", str(tmp_path / f"log{rank}"), fd, "run", "--steps", "2", "--graph", "off"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    records = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    master = records[0]["env"]["PADDLE_MASTER"]
    assert master and master.startswith("127.0.0.1:"), records
    assert master in records[0]["listening"], records  # rank 0 serves the store where the launcher said
    assert all(a.startswith("127.0.0.1:") for r in records for a in r["listening"]), records
    assert left_over(marker) == []
