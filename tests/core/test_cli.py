"""The `fd` command as a user runs it: listing, explaining, usage errors, and the console script itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from fakedist import run_fd


def test_plugins_lists_cpu_active_and_the_others_not_detected_with_the_reason() -> None:
    done = run_fd(["plugins"])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("platform: cpu (")
    row = {line.split()[0]: line for line in lines if line.startswith("  ") and not line.strip().startswith(("hooks:", "error:"))}
    assert "active: " in row["cpu"] and "fd-backends 0.1.0" in row["cpu"]
    assert "not active: not detected: paddlepaddle-gpu is not installed" in row["cuda"]
    assert "not active: not detected: paddle-iluvatar-gpu is not installed" in row["iluvatar"]
    assert "hooks: fd_all_reduce, fd_clean_memory_fragments, fd_graph_backend, fd_graph_eligibility, fd_platform_detect" in done.stdout
    assert "architectures: ernie4_5 (ernie4_5), ernie4_5_vl (ernie4_5_vl), qwen3_vl (qwen3_vl)" in done.stdout


def test_plugins_json_has_every_field() -> None:
    done = run_fd(["plugins", "--json"])
    data = json.loads(done.stdout)
    assert data["platform"] == "cpu"
    by_name = {p["name"]: p for p in data["plugins"]}
    assert {"cpu", "cuda", "iluvatar", "ernie4_5", "ernie4_5_vl", "qwen3_vl"} <= set(by_name)
    cuda = by_name["cuda"]
    assert set(cuda) == {"name", "kind", "module", "distribution", "version", "builtin", "allowed", "hooks", "detection", "error", "active", "status"}
    assert cuda["kind"] == "platform" and cuda["builtin"] and not cuda["active"] and cuda["detection"]["detected"] is False
    assert by_name["qwen3_vl"]["hooks"] == ["fd_clear_graphs", "fd_register_models"]


def test_explain_prints_platform_binding_and_votes() -> None:
    done = run_fd(["explain", "--model", "qwen3_vl", "--tp", "2"])
    assert done.returncode == 0, done.stderr
    assert "platform: cpu (" in done.stdout
    assert "model: qwen3_vl (registered by qwen3_vl), tp=2" in done.stdout
    assert "all-reduce: direct: cpu.fd_all_reduce" in done.stdout
    # At tp=2 the cpu platform's vote is advisory: auto skips capture and says why; --graph on captures.
    assert "graph: static off: cpu skipped (no gain; --graph on captures anyway): " in done.stdout
    assert "\n  cpu skips (no gain): a static program would trace the gloo all-reduce" in done.stdout
    on = run_fd(["explain", "--model", "qwen3_vl", "--tp", "2", "--graph", "on"])
    assert "graph: static on: requested (--graph on) over cpu's no-gain vote" in on.stdout
    one = run_fd(["explain", "--model", "qwen3_vl", "--tp", "1"])
    assert "graph: static on: no plugin vetoed (1 vote)\n  cpu allows: paddle static graph traces" in one.stdout
    off = run_fd(["explain", "--graph", "off"])
    assert "graph: static off: disabled by request (--graph off)" in off.stdout


def test_explain_json() -> None:
    data = json.loads(run_fd(["explain", "--json", "--tp", "2"]).stdout)
    assert data["platform"] == "cpu" and data["tp"] == 2 and data["graph"]["allowed"] is False
    assert data["graph"]["votes"][0] == {"plugin": "cpu", "allow": False, "advisory": True, "reason": data["graph"]["votes"][0]["reason"]}


def test_usage_errors_are_one_line_with_exit_2() -> None:
    for args, message in [
        (["run", "--tp", "0"], "fd: error: argument --tp: must be >= 1, got 0 (see fd run --help)"),
        (["run", "--steps", "x"], "fd: error: argument --max-new-tokens/--steps: 'x' is not an integer (see fd run --help)"),
        (["explain", "--model", "llama"], "fd: error: unknown architecture 'llama'; registered: ernie4_5 (Ernie4_5ForCausalLM), ernie4_5_vl (Ernie4_5_VLMoeForConditionalGeneration), qwen3_vl (Qwen3VLForConditionalGeneration)"),
        (["frobnicate"], None),
    ]:
        done = run_fd(args)
        assert done.returncode == 2, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        if message:
            assert done.stderr.strip() == message


def test_the_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("fd")
    assert script.exists(), "pip install should put an `fd` script beside python"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
    done = subprocess.run([str(script), "plugins", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["platform"] == "cpu"


def test_run_json_for_each_model_and_a_checkpoint_round_trip(tmp_path: Path) -> None:
    """`fd run` at tp=2 as the README runs it; then the same weights written and read back as safetensors."""
    first = run_fd(["run", "--steps", "6", "--json", "--graph", "on"])
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout)
    assert summary["platform"] == "cpu" and summary["tp"] == 2 and summary["graph"]["allowed"]
    assert len(summary["tokens"]) == 6 and set(summary["timings_s"]) >= {"load", "cleanup", "capture", "prefill", "decode"}
    # Start-up is measured as phases too, from process start to teardown, and the first token's time.
    assert set(summary["timings_s"]) >= {"start", "spawn", "rendezvous", "setup", "teardown"}
    assert 0 < summary["time_to_first_token_s"] < summary["wall_s"]
    assert sum(summary["timings_s"].values()) <= summary["wall_s"] * 1.05
    assert all(w > 0 for w in summary["weight_bytes_by_rank"]) and all(c > 0 for c in summary["kv_cache_bytes_by_rank"])
    saved = run_fd(["save-random", "--model", "ernie4_5", str(tmp_path / "ckpt")])
    assert saved.returncode == 0, saved.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    loaded = run_fd(["run", "--steps", "6", "--json", "--checkpoint", str(tmp_path / "ckpt")])
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout)["tokens"] == summary["tokens"]
    for model in ("ernie4_5_vl", "qwen3_vl"):
        done = run_fd(["run", "--model", model, "--steps", "4", "--tp", "1", "--json"])
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["model"] == model


def test_tp_that_contradicts_the_launcher_is_refused() -> None:
    done = run_fd(["run", "--tp", "4"], env={"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "2"})
    assert done.returncode == 2
    assert done.stderr.strip() == "fd: error: --tp 4 does not match the launcher's 2 processes; drop --tp under a launcher"


def test_without_paddle_the_commands_that_need_it_say_which_extra_to_install(monkeypatch, capsys) -> None:
    import importlib.util

    from fd_core.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "paddle" else real(name, *a))
    assert main(["run", "--tp", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "fd: error: PaddlePaddle is not installed; pip install 'fd-backends[cpu]' or pip install 'fd-backends[gpu]' "
        "(one build only: each provides the same paddle package)"
    )
def test_run_prints_time_to_first_token_and_what_the_phases_cover() -> None:
    done = run_fd(["run", "--steps", "3"])
    assert done.returncode == 0, done.stderr
    assert re.search(r"^time to first token: \d+\.\d\ds after fd run started$", done.stdout, re.M), done.stdout
    assert re.search(r"^phases: start [\d.]+s, spawn [\d.]+s, rendezvous [\d.]+s, setup ", done.stdout, re.M), done.stdout
    assert re.search(r"^wall: [\d.]+s, \d+% of it in the phases above$", done.stdout, re.M), done.stdout
    # The default run skips capture at tp=2 and says why.
    assert "graph: static off: cpu skipped (no gain; --graph on captures anyway)" in done.stdout
