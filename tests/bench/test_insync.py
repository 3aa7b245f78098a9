"""fd_bench.insync, tp=2's bound: it holds the ceiling's bytes, and its in-step pass makes a tp=2 step's all-reduces.

No timing is asserted: the figures are judged from the full run in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fd_bench import insync, matvec
from fd_models.presets import TINY_TEXT

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "benchmarks" / "configs" / "ernie-4.5-0.3b.json"


def test_two_ranks_hold_the_ceilings_matrices_halved() -> None:
    """Each rank's matrices are the tensor-parallel halves of ERNIE-4.5-0.3B's, written out from its config by hand:
    q, k, v, gate and up split by outputs; o and down by inputs (their outputs, whole, are what the all-reduce adds);
    the LM head [hidden, vocab / 2], as fd holds it."""
    config = json.loads(CONFIG.read_text())
    # hidden 1024, 16 heads and 2 kv heads of 128, intermediate 3072, vocabulary 103424, 18 layers.
    layer = [(1024, 1024), (1024, 128), (1024, 128), (1024, 1024), (1024, 1536), (1024, 1536), (1536, 1024)]
    assert insync._layout(config) == layer * 18 + [(1024, 51712)]
    assert [layer[i][1] for i in insync.REDUCED_AFTER] == [config["hidden_size"]] * 2
    # Half the ceiling's bytes a rank.
    assert 2 * sum(k * n for k, n in insync._layout(config)) == sum(k * n for k, n in matvec.shapes(config))


def test_in_step_pass_makes_a_tp2_steps_all_reduces(tmp_path: Path) -> None:
    config = {k: TINY_TEXT[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                       "num_key_value_heads", "head_dim", "vocab_size")}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    done = subprocess.run([sys.executable, "-m", "fd_bench.insync", str(path), "1"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    # The embedding's, two a layer (after o and after down), the LM head's.
    assert all(r["all_reduces_per_pass"] == 2 * config["num_hidden_layers"] + 2 for r in doc["ranks"])
    assert doc["passes_per_s"] > 0 and doc["free_passes_per_s"] > 0
