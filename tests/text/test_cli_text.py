"""`fd run` with text: prompts from flags or a file, text on stdout (streamed on a terminal), the report
and progress on stderr, --json per prompt, sampling and tp=2."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from fd_core.runtime import LLM, SamplingParams
from kit import text_checkpoint

PROMPTS = ["Hello world", "Привет, мир! Как дела?"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_checkpoint(tmp_path_factory.mktemp("cli-text"), "qwen3_vl")


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[str]:
    with LLM(checkpoint) as llm:
        return [c.text or "" for c in llm.generate(PROMPTS, SamplingParams(max_new_tokens=6))]


def fd(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:  # noqa: ANN003
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    return subprocess.run([sys.executable, "-m", "fd_core.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env, **kwargs)


def test_text_prompts_print_their_text(checkpoint: Path, expected: list[str], tmp_path: Path) -> None:
    done = fd("run", "--checkpoint", str(checkpoint), "--tp", "1", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
              "--max-new-tokens", "6")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "\n\n".join(expected) + "\n"
    # The report and one line per phase go to stderr, so stdout holds only the text.
    for line in ("fd: loading qwen3_vl", "fd: capturing the decode step for batch size 2", "graph: static on",
                 "tokens [2]: "):
        assert line in done.stderr
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(PROMPTS) + "\n\n", encoding="utf-8")
    again = fd("run", "--checkpoint", str(checkpoint), "--tp", "1", "--prompts", str(file), "--steps", "6")
    assert again.returncode == 0 and again.stdout == done.stdout


def test_json_gives_text_and_ids_per_prompt(checkpoint: Path, expected: list[str]) -> None:
    done = fd("run", "--checkpoint", str(checkpoint), "--tp", "1", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
              "--max-new-tokens", "6", "--json")
    assert done.returncode == 0, done.stderr
    outputs = json.loads(done.stdout)["outputs"]
    assert [o["text"] for o in outputs] == expected and all(
        len(o["ids"]) == 6 and o["finish_reason"] == "length" for o in outputs
    )


def test_sampling_at_tp2_equals_tp1_and_follows_the_seed(checkpoint: Path) -> None:
    def outputs(tp: int, seed: int) -> list[dict]:
        args = ["run", "--checkpoint", str(checkpoint), "--tp", str(tp), "--json", "--max-new-tokens", "8",
                "--temperature", "1.2", "--top-k", "50"]
        done = fd(*args, "--seed", str(seed), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1])
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["outputs"]

    first = outputs(2, 7)
    assert first == outputs(1, 7)
    assert first != outputs(1, 8)


def test_text_streams_to_a_terminal(checkpoint: Path, expected: list[str]) -> None:
    ours, theirs = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    proc = subprocess.Popen([sys.executable, "-m", "fd_core.cli", "run", "--checkpoint", str(checkpoint), "--tp", "1",
                             "--prompt", PROMPTS[0], "--max-new-tokens", "6"], stdout=theirs, stderr=subprocess.PIPE,
                             env=env)
    os.close(theirs)
    chunks = []
    while True:
        try:
            data = os.read(ours, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    os.close(ours)
    assert b"".join(chunks).decode().replace("\r\n", "\n") == expected[0] + "\n"
