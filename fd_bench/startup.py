"""Start-up row: whole processes, `python -c pass` against `import fd_core` and `fd plugins`, interleaved."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fd_bench.report import Line

_PADDLE_PROBE = (
    "import sys, io, contextlib\n"
    "{body}\n"
    "print(sorted(m for m in sys.modules if m == 'paddle' or m.startswith('paddle.'))[:3])\n"
)
_IMPORT_BODY = "import fd_core"
_PLUGINS_BODY = "from fd_core.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):\n    main(['plugins'])"


def fd_command() -> list[str]:
    """The installed `fd` console script next to this interpreter, else on PATH, else `python -m fd_core.cli`."""
    here = Path(sys.executable).parent / "fd"
    if here.exists():
        return [str(here)]
    found = shutil.which("fd")
    return [found] if found else [sys.executable, "-m", "fd_core.cli"]


def _env() -> dict[str, str]:
    # The user's environment, minus a forced platform: `fd plugins` is measured as a user runs it.
    return {k: v for k, v in os.environ.items() if k != "FD_PLATFORM"}


def _time(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter_ns()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    elapsed = time.perf_counter_ns() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return elapsed / 1e6


def _paddle_modules(body: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _PADDLE_PROBE.format(body=body)], capture_output=True, text=True,
                         env=env, check=True)
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own probe prints a list literal


def startup_rows(smoke: bool) -> list[Line]:
    env = _env()
    reps = 5 if smoke else 40
    commands = {
        "pass": [sys.executable, "-c", "pass"],
        "import": [sys.executable, "-c", "import fd_core"],
        "plugins": fd_command() + ["plugins"],
    }
    for cmd in commands.values():  # warm the page cache and the bytecode caches
        _time(cmd, env)
    times: dict[str, list[float]] = {k: [] for k in commands}
    order = list(commands)
    for i in range(reps):
        for name in order if i % 2 == 0 else reversed(order):
            times[name].append(_time(commands[name], env))
    med = {k: statistics.median(v) for k, v in times.items()}
    paddle_import = _paddle_modules(_IMPORT_BODY, env)
    paddle_plugins = _paddle_modules(_PLUGINS_BODY, env)
    lines = []
    for key, label, limit, leaked in (
        ("import", 'python -c "import fd_core"', 50.0, paddle_import),
        ("plugins",
         " ".join(["fd"] + commands["plugins"][1:]) if commands["plugins"][0].endswith("fd")
         else " ".join(commands["plugins"]),
         300.0, paddle_plugins),
    ):
        added = med[key] - med["pass"]
        lines.append(Line(
            row="startup", case=f"{key}: adds <= {limit:.0f} ms, no paddle",
            a=label, b='python -c "pass"', a_value=med[key], b_value=med["pass"], unit="ms",
            ratio=med[key] / med["pass"], ratio_label="A / B",
            target=f"adds <= {limit:.0f} ms; paddle not imported",
            met=added <= limit and not leaked,
            note=f"adds {added:.1f} ms; paddle modules imported: {leaked or 'none'}; {reps} runs each",
            details={"added_ms": added, "paddle_modules": leaked, "runs": reps, "all_ms": times[key],
                     "pass_ms": times["pass"], "command": commands[key]},
        ))
    return lines
