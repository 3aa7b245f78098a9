"""Bench rows holding values no measurement can give are errors, never "met" (a negative RSS ratio was once "met")."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import fd_bench
from fd_bench.report import Line, impossible


def _line(**change: Any) -> Line:
    values: dict[str, Any] = {"row": "tp1", "case": "c", "a": "A", "b": "B", "a_value": 10.0, "b_value": 20.0,
                              "unit": "MiB", "ratio": 0.5, "ratio_label": "A / B", "target": "<= 1.20", "met": True}
    values.update(change)
    return Line(**values)


@pytest.mark.parametrize(("change", "why"), [
    ({"ratio": -0.35, "a_value": -7.0}, "below zero"),
    ({"ratio": math.nan}, "not a finite number"),
    ({"b_value": math.inf}, "not a finite number"),
    ({"b_value": 0.0}, "B is 0"),
])
def test_impossible_values_are_named(change: dict[str, Any], why: str) -> None:
    problem = impossible(_line(**change))
    assert problem is not None and why in problem


def test_possible_values_pass() -> None:
    assert impossible(_line()) is None
    assert impossible(_line(unit="%", a_value=-0.2, ratio=None)) is None  # a change in percent may be negative


def test_a_row_with_an_impossible_value_is_an_error_not_met(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    negative = _line(a_value=-17.0, ratio=-0.35, met=True)  # what the smoke RSS row once printed as met
    monkeypatch.setattr(fd_bench, "_runners", lambda selected, smoke: [(("tp1",), lambda: [negative])])
    out = tmp_path / "r.json"
    assert fd_bench.main(["--smoke", "--rows", "tp1", "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert "tp1" in doc["errors"] and "below zero" in doc["errors"]["tp1"]
    assert doc["summary"]["met"] == [] and doc["summary"]["errors"] == ["tp1"]
    assert doc["lines"][0]["met"] is None
    assert "ERROR" in capsys.readouterr().out


def test_rows_that_run_fd_serve_say_not_measured_without_the_serve_extra(monkeypatch) -> None:
    """Issue 37: `fd bench --smoke` exited 1 (a RuntimeError from its serve row) where the serve extra was missing."""
    import importlib.util

    from fd_bench import main, paged, serving

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    for lines in (serving.serve_rows(True), paged.prefix_rows(True)):
        assert lines
        for line in lines:
            assert line.met is None and line.a_value is None
            assert line.note.startswith("not measured: fastapi not installed (the row runs fd serve: pip install")
    assert main(["--smoke", "--rows", "serve,prefix", "--json", "-"]) == 0
