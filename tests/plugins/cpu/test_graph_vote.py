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
