"""The cpu platform's graph vote: static programs for small models at tp=1 only, where they pay."""

from __future__ import annotations

import json
from pathlib import Path

from fd_core import ModelConfig, ParallelConfig
from fd_core.host.backend import load_backend
from fd_core.runtime.plan import model_config_for

CONFIG = Path(__file__).resolve().parents[3] / "benchmarks" / "configs" / "ernie-4.5-0.3b.json"


def test_a_model_whose_products_mlas_runs_is_never_captured() -> None:
    """ERNIE-4.5-0.3B's products run on ONNX Runtime's MLAS (fd_plugins.cpu.mlas), outside Paddle: a static program
    cannot hold them, so the vote is a veto, under --graph on too."""
    backend = load_backend(env={"FD_PLATFORM": "cpu"})
    big = ModelConfig.from_dict("Ernie4_5ForCausalLM", json.loads(CONFIG.read_text()))
    one = ParallelConfig(tp_size=1, tp_rank=0)
    for requested in ("auto", "on"):
        decision = backend.graph_decision(big, one, requested)
        assert not decision.allowed
        (vote,) = decision.votes
        assert vote.plugin == "cpu" and not vote.advisory and "ONNX Runtime's MLAS" in vote.reason


def test_auto_captures_the_tiny_preset_at_tp1_and_skips_it_at_tp2() -> None:
    backend = load_backend(env={"FD_PLATFORM": "cpu"})
    tiny = model_config_for(backend.plugins.registry.get("ernie4_5"), None)
    assert backend.graph_decision(tiny, ParallelConfig(tp_size=1, tp_rank=0), "auto").allowed
    skipped = backend.graph_decision(tiny, ParallelConfig(tp_size=2, tp_rank=0), "auto")
    assert not skipped.allowed and "gloo all-reduce" in skipped.votes[0].reason


def test_a_fused_weight_mlas_serves_vetoes_capture_and_the_default_run_goes_eager(tmp_path: Path) -> None:
    """hidden 256 and intermediate 768: each of gate and up is 0.75 MiB, under MLAS's 1 MiB, but the layer holds them
    fused (1.5 MiB), which MLAS serves: the vote counts the weights as the layers hold them, so `fd run` (graphs auto)
    runs eagerly instead of failing in the capture."""
    import subprocess
    import sys

    backend = load_backend(env={"FD_PLATFORM": "cpu"})
    preset = dict(backend.plugins.registry.get("ernie4_5").preset)
    data = {**preset, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 1, "head_dim": 64}
    config = ModelConfig.from_dict("Ernie4_5ForCausalLM", data)
    one = ParallelConfig(tp_size=1, tp_rank=0)
    assert "ONNX Runtime's MLAS" in backend.graph_decision(config, one, "auto").votes[0].reason
    # Quantized in groups of 8, which MLAS has no kernel for, its products are Paddle's: no veto for MLAS (a group
    # that divides no weight's inputs is per output channel, which MLAS serves).
    grouped = config.with_overrides(quantization="wint8", quantization_group=8, float_embeddings=False)
    assert all("MLAS" not in v.reason for v in backend.graph_decision(grouped, one, "auto").votes)
    (tmp_path / "config.json").write_text(json.dumps(data))
    fd = [sys.executable, "-m", "fd_core.cli"]
    made = subprocess.run([*fd, "save-random", "--config", str(tmp_path / "config.json"), str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    ran = subprocess.run([*fd, "run", "--checkpoint", str(tmp_path / "c"), "--tp", "1", "--steps", "4", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert "ONNX Runtime's MLAS" in json.dumps(json.loads(ran.stdout)["graph"])
