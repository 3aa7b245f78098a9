"""The llamacpp bench row's own logic (fd_bench/llamacpp.py). The row itself needs a llama.cpp build, which CI does
not have: these check what decides its figures and its refusals, not llama.cpp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fd_bench import llamacpp

ROOT = Path(__file__).resolve().parents[2]


def _entry(name: str, threads: int, speed: float, gen: int = 64) -> dict[str, object]:
    # The fields llama-bench's `-o json` prints for each test (llama.cpp at llama-cpp-python 0.3.36's tree).
    return {"model_filename": f"/tmp/work/{name}.gguf", "model_type": "ernie4_5 0.3B", "n_threads": threads,
            "n_prompt": 0, "n_gen": gen, "n_depth": 16, "avg_ts": speed, "stddev_ts": 0.1}


def test_llama_bench_report_is_read_by_file_and_threads() -> None:
    """Each (type, threads) gets its own speed; prompt-only tests are skipped; a file the row did not make is an
    error, not a silently dropped figure."""
    report = [_entry("model-f32", 1, 15.4), _entry("model-f32", 2, 20.6), _entry("model-q8_0", 2, 73.2),
              _entry("model-q4_0", 1, 77.0), _entry("model-q4_0", 2, 105.4, gen=0)]
    assert llamacpp.bench_speeds(json.dumps(report)) == {("f32", 1): 15.4, ("f32", 2): 20.6, ("q8_0", 2): 73.2,
                                                         ("q4_0", 1): 77.0}
    with pytest.raises(ValueError, match="did not make"):
        llamacpp.bench_speeds(json.dumps([_entry("other", 2, 1.0)]))


def test_missing_says_what_to_set_and_what_to_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(llamacpp.TREE_ENV, raising=False)
    assert llamacpp.TREE_ENV in (llamacpp.missing() or "")
    monkeypatch.setenv(llamacpp.TREE_ENV, str(tmp_path))
    why = llamacpp.missing() or ""
    assert all(b in why for b in llamacpp.BINARIES) and "cmake" in why
    (tmp_path / "build" / "bin").mkdir(parents=True)
    for name in llamacpp.BINARIES:
        (tmp_path / "build" / "bin" / name).write_text("")
    assert "convert_hf_to_gguf.py" in (llamacpp.missing() or "")
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    assert llamacpp.missing() is None


def test_the_stub_tokenizer_keeps_the_configs_special_ids(tmp_path: Path) -> None:
    """The converter reads pad, bos and eos from the tokenizer it is given; the stub's must be the config's."""
    import sentencepiece

    llamacpp.stub_tokenizer(tmp_path)
    model = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    assert (model.pad_id(), model.bos_id(), model.eos_id(), model.get_piece_size()) == (0, 1, 2, 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.model", "tokenizer.vocab"]


def test_without_a_build_the_row_says_so_and_the_run_succeeds(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FD_PLATFORM", "FD_PLUGINS", llamacpp.TREE_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    out = tmp_path / "row.json"
    proc = subprocess.run([sys.executable, "-m", "fd_bench", "--rows", "llamacpp", "--json", str(out)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = json.loads(out.read_text())["lines"]
    assert len(lines) == 3 and all(ln["met"] is None and llamacpp.TREE_ENV in ln["note"] for ln in lines)
