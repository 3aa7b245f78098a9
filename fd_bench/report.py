"""Result lines, the printed table, the machine description and the JSON document."""

from __future__ import annotations

import math
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any


@dataclass
class Line:
    """One comparison: side A against side B, their medians, the ratio and the target it is held to."""

    row: str
    case: str
    a: str
    b: str
    a_value: float | None
    b_value: float | None
    unit: str
    ratio: float | None
    ratio_label: str
    target: str
    met: bool | None  # None: reported only, or could not be measured
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def impossible(line: Line) -> str | None:
    """Why `line` holds a value no measurement can give (negative or non-finite times,
    speeds, sizes or ratios), or None."""
    for label, value in (("A", line.a_value), ("B", line.b_value), ("ratio", line.ratio)):
        if value is None:
            continue
        if not math.isfinite(value):
            return f"{label} is {value} (not a finite number)"
        if value < 0 and line.unit != "%":
            return (f"{label} is {value:.4g}, below zero: "
                    f"not a possible {'ratio' if label == 'ratio' else line.unit} value")
    if line.ratio is not None and line.a_value is not None and line.b_value == 0:
        return "B is 0: the ratio has no meaning"
    return None


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ns":
        return f"{value:.0f} ns" if value < 10_000 else f"{value / 1000:.1f} us"
    if unit == "us":
        return f"{value:.1f} us" if value < 10_000 else f"{value / 1000:.2f} ms"
    if unit == "ms":
        return f"{value:.2f} ms" if value < 100 else f"{value:.0f} ms"
    if unit == "tok/s":
        return f"{value:.1f} tok/s" if value < 1000 else f"{value:.0f} tok/s"
    if unit == "MiB":
        return f"{value:.0f} MiB"
    if unit == "%":
        return f"{value:+.2f} %"
    return f"{value:.3g} {unit}"


def _verdict(line: Line, smoke: bool) -> str:
    if line.met is None:
        if line.note.startswith("error:"):
            return "ERROR"
        return "reported" if line.target in ("", "reported") else "n/a"
    word = "met" if line.met else "MISSED"
    return f"({word})" if smoke else word


def table(lines: list[Line], smoke: bool) -> str:
    """A Markdown table of every line (smoke verdicts in parentheses: smoke numbers are not the record)."""
    head = ["row", "case", "A", "B", "A median", "B median", "ratio", "target", "verdict"]
    rows = [head, ["---"] * len(head)]
    for ln in lines:
        ratio = "-" if ln.ratio is None else f"{ln.ratio:.3f} ({ln.ratio_label})"
        rows.append([ln.row, ln.case, ln.a, ln.b, _fmt(ln.a_value, ln.unit), _fmt(ln.b_value, ln.unit), ratio,
                     ln.target, _verdict(ln, smoke)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = []
    for r in rows:
        if r[0] == "---":
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        else:
            out.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    notes = [f"- {ln.row} ({ln.case}): {ln.note}" for ln in lines if ln.note]
    return "\n".join(out + ([""] + notes if notes else []))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """What the numbers were measured on (no paddle import: versions come from the installed metadata)."""
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "nproc": usable,
        "cpu_model": _cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "paddlepaddle": _version("paddlepaddle"),
        "pluggy": _version("pluggy"),
        "numpy": _version("numpy"),
        "fd-backends": _version("fd-backends"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "executable": sys.executable,
    }
