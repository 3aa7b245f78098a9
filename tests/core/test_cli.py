"""The `fd` command as a user runs it: listing, explaining, usage errors, and the console script itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from fakedist import listing, run_fd
from fd_core import CONTRACT_VERSION


def test_plugins_lists_cpu_active_and_the_others_not_detected_with_the_reason() -> None:
    done = run_fd(["plugins"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("platform: cpu (")
    assert max(map(len, done.stdout.splitlines())) <= 100  # wrapped for a terminal
    row = listing(done.stdout)["platform plugins"]
    assert row["cpu"].startswith(f"cpu fd-backends 0.1.0, contract {CONTRACT_VERSION} active: ")
    # exact: tests/docs/test_install.py
    assert "not active: not detected: paddle is the CPU build (paddlepaddle " in row["cuda"]
    assert "not active: not detected: paddle-iluvatar-gpu is not installed" in row["iluvatar"]
    assert row["cpu"].endswith(
        "hooks: fd_all_reduce, fd_before_step, fd_clean_memory_fragments, fd_graph_backend, fd_graph_eligibility, "
        "fd_platform_detect, fd_rank_start, fd_register_kernels "
        "kernels: add_rms_norm, matmul, paged_attention, paged_packed_attention, paged_prefill_attention, "
        "quant_matmul, rms_norm, rotary_embedding, write_kv_cache"
    )
    # Each architecture with the names checkpoints use for it (aliases) and, named as such, the plugin it came from.
    archs = listing(done.stdout)["architectures"]
    assert archs["ernie4_5"].startswith("ernie4_5 aliases: Ernie4_5ForCausalLM; from plugin ernie4_5 ERNIE-4.5 dense decoder")
    assert archs["qwen3_vl"].startswith("qwen3_vl aliases: Qwen3VLForConditionalGeneration; from plugin qwen3_vl ")
    assert set(archs) == {"ernie4_5", "ernie4_5_vl", "qwen3_vl"}


def test_plugins_json_has_every_field() -> None:
    done = run_fd(["plugins", "--json"])
    data = json.loads(done.stdout)
    assert data["platform"] == "cpu"
    by_name = {p["name"]: p for p in data["plugins"]}
    assert {"cpu", "cuda", "iluvatar", "ernie4_5", "ernie4_5_vl", "qwen3_vl"} <= set(by_name)
    cuda = by_name["cuda"]
    assert set(cuda) == {"name", "kind", "module", "distribution", "version", "builtin", "allowed", "hooks",
                         "detection", "error", "incompatible", "active", "status", "kernels", "kv_transports",
                         "contract", "contract_declared"}
    assert data["contract_version"] == CONTRACT_VERSION and (cuda["contract"], cuda["contract_declared"]) == ("1.6", True)
    assert by_name["cpu"]["kernels"] == ["add_rms_norm", "matmul", "paged_attention", "paged_packed_attention",
                                         "paged_prefill_attention", "quant_matmul", "rms_norm", "rotary_embedding",
                                         "write_kv_cache"] and cuda["kernels"] == []
    assert (cuda["kind"] == "platform" and cuda["builtin"] and not cuda["active"]
            and cuda["detection"]["detected"] is False)
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
    assert "cpu allows" not in off.stdout and "cpu skips" not in off.stdout  # no vote is shown as if it mattered


def test_explain_defaults_to_run_tp_and_refuses_what_run_refuses() -> None:
    assert "model: ernie4_5 (registered by ernie4_5), tp=2" in run_fd(["explain"]).stdout
    explained, ran = run_fd(["explain", "--tp", "3"]), run_fd(["run", "--tp", "3"])
    assert explained.returncode == ran.returncode == 2 and explained.stdout == ""
    assert explained.stderr == ran.stderr and "tp=3 does not divide num_attention_heads=4" in explained.stderr


def test_explain_json() -> None:
    data = json.loads(run_fd(["explain", "--json", "--tp", "2"]).stdout)
    assert data["platform"] == "cpu" and data["tp"] == 2 and data["graph"]["allowed"] is False
    assert data["graph"]["votes"][0] == {"plugin": "cpu", "allow": False, "advisory": True,
                                         "reason": data["graph"]["votes"][0]["reason"]}


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
    assert (len(summary["tokens"]) == 6
            and set(summary["timings_s"]) >= {"load", "cleanup", "capture", "prefill", "decode"})
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
        "fd: error: PaddlePaddle is not installed; pip install '.[cpu]' in a checkout, or a device build as docs/install.md says "
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


def test_run_labels_phase_totals_after_reload_cycles_and_shows_no_vote_under_graph_off() -> None:
    done = run_fd(["run", "--tp", "1", "--steps", "2", "--graph", "off", "--reload-cycles", "2"])
    assert done.returncode == 0, done.stderr
    assert re.search(r"^phases \(totals over the first run and 2 reload cycles\): start [\d.]+s", done.stdout, re.M), done.stdout
    assert "graph: static off: disabled by request (--graph off)\ntokens: " in done.stdout  # no vote line between
    plain = run_fd(["run", "--tp", "1", "--steps", "2", "--graph", "off"])
    assert re.search(r"^phases: start ", plain.stdout, re.M), plain.stdout
    # One speed: the request's, on stderr and in the report alike (issue 49: the report gave the cycles' too).
    logged = re.search(r"generated \d+ tokens at ([\d.]+) tokens/s", done.stderr)
    reported = re.search(r"^speed: ([\d.]+) tokens/s", done.stdout, re.M)
    assert logged and reported and abs(float(logged.group(1)) - float(reported.group(1))) <= 0.06, (
        done.stderr, done.stdout)


NOISE = re.compile(r"Warning|ccache|^[IWE]\d{4} \d\d:\d\d", re.M)  # a Python warning or a glog line


def test_no_paddle_warning_or_glog_line_reaches_the_terminal_unless_asked_for(tmp_path: Path) -> None:
    # The user's environment as a fresh shell has it: no glog or warning settings of its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FD_", "GLOG_", "PYTHONWARNINGS"))}
    api = (
        "from fd_core import ParallelConfig, load_backend\n"
        "from fd_core.runtime import LLM, SamplingParams\n"
        "load_backend(ParallelConfig(tp_size=1))\n"
        "import paddle\n"
        f"with LLM({str(tmp_path / 'ckpt')!r}, tp=2) as llm:\n"
        "    print(llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].token_ids)\n"
    )
    commands = [
        ["-m", "fd_core.cli", "save-random", str(tmp_path / "ckpt")],
        ["-m", "fd_core.cli", "run", "--tp", "2", "--steps", "2", "--checkpoint", str(tmp_path / "ckpt")],
        ["-c", api],
    ]
    for command in commands:
        done = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        assert not NOISE.search(done.stdout + done.stderr), (command, done.stdout + done.stderr)
    # Asked for: --verbose lets Paddle's own lines through (the gloo rendezvous logs at info level).
    loud = subprocess.run([sys.executable, "-m", "fd_core.cli", "--verbose", "run", "--tp", "2", "--steps", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert loud.returncode == 0 and NOISE.search(loud.stderr), loud.stderr


def test_every_option_of_every_command_says_what_it_does_and_its_default() -> None:
    import argparse

    from fd_core.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            where = f"fd {name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{where} has no help text"
            takes_value = action.nargs != 0 and action.option_strings
            if takes_value and not action.choices:
                assert "(default: " in action.help or "default: " in action.help, f"{where} does not state its default"
                assert action.metavar, f"{where} shows its dest as its value name"
            if action.choices:
                assert "default" in action.help, f"{where} does not state its default"


def test_help_lists_the_architectures_with_their_aliases() -> None:
    done = run_fd(["help", "run"])
    assert done.returncode == 0, done.stderr
    tail = done.stdout.split("architectures (--model takes a name or an alias):\n", 1)[1]
    assert tail.split() == ["ernie4_5", "Ernie4_5ForCausalLM", "ernie4_5_vl", "Ernie4_5_VLMoeForConditionalGeneration",
                            "(vision-language)", "qwen3_vl", "Qwen3VLForConditionalGeneration", "(vision-language)"]
    assert "--max-new-tokens N, --steps N" in done.stdout and "(default: 1,2,3,4)" in done.stdout
    assert "architectures (--model" in run_fd(["explain", "--help"]).stdout


def test_human_reports_fit_100_columns() -> None:
    for args in (["plugins"], ["explain"], ["run", "--steps", "40"], ["help", "run"]):
        done = run_fd(args, env={"COLUMNS": "100"})
        assert done.returncode == 0, done.stderr
        assert max(map(len, done.stdout.splitlines())) <= 100, (args, done.stdout)


def test_check_json_is_the_whole_of_stdout_with_the_verdict_and_exit_code() -> None:
    done = run_fd(["check", "cuda", "--json", "-k", "two_ranks_sum"], timeout=300)
    data = json.loads(done.stdout)
    assert done.returncode == data["exit_code"] == 3
    assert data["verdict"].startswith("not verified: ") and data["counts"]["skipped"] == len(data["checks"]) > 0
    assert all(
        c["outcome"] == "skipped" and c["detail"].startswith("cuda: hardware not detected here") for c in data["checks"]
    )
    none = run_fd(["check", "cpu", "-k", "nosuchcheck"], timeout=300)
    assert (none.returncode, none.stdout) == (2, "")
    assert none.stderr.strip() == "fd: error: no check of the conformance suite matches -k 'nosuchcheck'; run fd check cpu without -k to see them all"


def test_explain_plans_a_checkpoint_from_its_config_as_run_does(tmp_path: Path) -> None:
    """`fd explain --checkpoint` sizes the plan from the directory's config.json (no weight is read): ERNIE-4.5-0.3B's
    published config is 360.7 M parameters, whose products the cpu platform runs on MLAS, so its graph vote vetoes."""
    directory = tmp_path / "ernie-0.3b"
    directory.mkdir()
    config = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "ernie-4.5-0.3b.json"
    (directory / "config.json").write_text(config.read_text())
    (directory / "model.safetensors").write_bytes(b"")
    done = run_fd(["explain", "--checkpoint", str(directory), "--tp", "1", "--json"])
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["model"] == "ernie4_5" and plan["memory"]["weights_per_rank"] == 360_748_032 * 4
    assert not plan["graph"]["allowed"] and "ONNX Runtime's MLAS" in plan["graph"]["votes"][0]["reason"]
    wrong = run_fd(["explain", "--checkpoint", str(directory), "--model", "qwen3_vl"])
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.strip() == (
        "fd: error: --model qwen3_vl does not match the checkpoint's architecture Ernie4_5ForCausalLM; drop --model or pick the right checkpoint"
    )


def test_explain_and_run_take_the_paged_cache_options() -> None:
    """--kv-block-size and --kv-cache-blocks size the pool fd explain shows (and fd run allocates); chunked prefill
    and no prefix caching give the same tokens; a request that could never fit the pool is refused before a rank."""
    explained = run_fd(["explain", "--tp", "1", "--kv-block-size", "32", "--kv-cache-blocks", "5", "--json"])
    assert explained.returncode == 0, explained.stderr
    kv = json.loads(explained.stdout)["kv_cache"]
    assert (kv["block_size"], kv["blocks"], kv["tokens"], kv["from"], kv["prefix_caching"]) == (32, 5, 160,
                                                                                                "--kv-cache-blocks 5", True)
    assert kv["layout"] == "[kv_heads, num_blocks, block_size, head_dim] (native)"
    base = ["run", "--tp", "1", "--max-new-tokens", "6", "--prompt-ids", "5,6,7,8,9,10,11,12,13,14,15,16,17", "--json"]
    plain = json.loads(run_fd(base).stdout)
    tuned = run_fd([*base, "--max-prefill-tokens", "3", "--no-prefix-caching", "--kv-cache-blocks", "8"])
    assert tuned.returncode == 0, tuned.stderr
    assert json.loads(tuned.stdout)["tokens"] == plain["tokens"]
    refused = run_fd(["run", "--tp", "1", "--kv-cache-blocks", "1", "--max-new-tokens", "20"])
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "fd: error: this request needs 2 KV-cache blocks of 16 positions (its longest prompt, 4 tokens, and 20 new), "
        "and ernie4_5 at tp=1 has 1 (--kv-cache-blocks 1; 8192 bytes a block per rank); ask for fewer tokens, or raise "
        "--kv-cache-blocks (up to what --memory-fraction leaves)"
    ]


def test_verbose_after_the_command_is_the_same_as_before_it() -> None:
    """`fd run -v` (as docs/architecture.md writes it) is `fd -v run`: the report gains the decode step's parts."""
    def lines(*argv: str) -> list[str]:
        done = run_fd([*argv, "--tp", "1", "--steps", "2", "--graph", "off"])
        assert done.returncode == 0, done.stderr
        return [line.split(":")[0].strip() for line in done.stdout.splitlines() if ":" in line]

    plain, before, after = lines("run"), lines("-v", "run"), lines("run", "-v")
    assert before == after and len(after) > len(plain), (plain, after)


def test_explain_sizes_a_directory_holding_config_json_alone(tmp_path: Path) -> None:
    """README: `fd explain --checkpoint DIR` sizes the plan from config.json, no weight read; fd run needs the weights."""
    from fd_core.host.loading import load_plugins

    preset = dict(load_plugins({}).registry.get("ernie4_5").preset)
    (tmp_path / "config.json").write_text(json.dumps({**preset, "architectures": ["ernie4_5"], "hidden_size": 128}))
    explained = run_fd(["explain", "--checkpoint", str(tmp_path), "--tp", "1", "--json"])
    assert explained.returncode == 0, explained.stderr
    plan = json.loads(explained.stdout)
    preset_plan = json.loads(run_fd(["explain", "--tp", "1", "--json"]).stdout)
    # Sized from this config.json (a wider hidden size than the preset's), not from the preset.
    assert plan["memory"]["weights_per_rank"] > preset_plan["memory"]["weights_per_rank"]
    ran = run_fd(["run", "--checkpoint", str(tmp_path), "--tp", "1"])
    assert ran.returncode == 2 and ran.stderr.strip() == f"fd: error: checkpoint {tmp_path}: no *.safetensors files found"
