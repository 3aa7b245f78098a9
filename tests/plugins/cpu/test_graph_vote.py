"""The cpu platform's graph vote: static programs for small models at tp=1 only, where they pay."""

from __future__ import annotations

import json
from pathlib import Path

from fd_core import ModelConfig, ParallelConfig
from fd_core.host.backend import load_backend
from fd_core.runtime.plan import model_config_for

CONFIG = Path(__file__).resolve().parents[3] / "benchmarks" / "configs" / "ernie-4.5-0.3b.json"


def test_auto_skips_a_memory_bound_model_and_on_still_captures_it() -> None:
    backend = load_backend(env={"FD_PLATFORM": "cpu"})
    big = ModelConfig.from_dict("Ernie4_5ForCausalLM", json.loads(CONFIG.read_text()))
    one = ParallelConfig(tp_size=1, tp_rank=0)
    auto = backend.graph_decision(big, one, "auto")
    assert not auto.allowed
    (vote,) = auto.votes
    assert vote.plugin == "cpu" and vote.advisory and "1376 MiB of dense weights per rank, more than 64 MiB" in vote.reason
    assert backend.graph_decision(big, one, "on").allowed


def test_auto_captures_the_tiny_preset_at_tp1_and_skips_it_at_tp2() -> None:
    backend = load_backend(env={"FD_PLATFORM": "cpu"})
    tiny = model_config_for(backend.plugins.registry.get("ernie4_5"), None)
    assert backend.graph_decision(tiny, ParallelConfig(tp_size=1, tp_rank=0), "auto").allowed
    skipped = backend.graph_decision(tiny, ParallelConfig(tp_size=2, tp_rank=0), "auto")
    assert not skipped.allowed and "gloo all-reduce" in skipped.votes[0].reason
