"""The project's own mutation test: every deliberately broken platform in platforms/ fails `fd check`, and the unmutated
control passes it. Each runs for real, in a subprocess, installed as a third-party distribution (a dist-info with its
`fd.platforms` entry point on PYTHONPATH), two at a time. A mutant is checked with the checks named by its EXPECT
(a -k expression: where it must be caught), the control with every mutant's checks together: each check that fails a
mutant passes the unmutated platform (the whole suite on the same code runs in tests/plugins/cpu)."""

from __future__ import annotations

import ast
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1]))
from fakedist import make_distribution, run_fd  # noqa: E402

PLATFORMS = Path(__file__).parent / "platforms"
MUTANTS = sorted(p.stem for p in PLATFORMS.glob("mutant_*.py") if p.stem != "mutant_control")


def _expect(name: str) -> str | None:
    """The module's EXPECT, read without importing it."""
    tree = ast.parse((PLATFORMS / f"{name}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXPECT" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name}.py declares no EXPECT")


def _check(name: str, root: Path) -> dict[str, Any]:
    dist = make_distribution(root / name, name.replace("_", "-"), {}, {"fd.platforms": {name: name}})
    expect = _expect(name) or " or ".join(f"({_expect(m)})" for m in MUTANTS)
    args = ["check", name, "--json", "-k", expect]
    begin = time.monotonic()
    done = run_fd(args, path=Path(f"{PLATFORMS}:{dist}"), timeout=600)
    try:
        report = json.loads(done.stdout)
    except ValueError:
        report = {"checks": [], "verdict": f"no JSON: {done.stderr.strip()[-500:]}"}
    result = {"code": done.returncode, "report": report, "stderr": done.stderr, "seconds": time.monotonic() - begin}
    # The run's own guards: at tp=2 the mutant either stops the run or gives the tokens the cpu platform gives.
    ran = run_fd(["run", "--tp", "2", "--steps", "6", "--json"], path=Path(f"{PLATFORMS}:{dist}"),
                 env={"FD_PLATFORM": name}, timeout=300)
    result["run"] = {"code": ran.returncode, "stdout": ran.stdout, "error": ran.stderr.strip().splitlines()[-1:] }
    return result


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("mutants")
    names = ["mutant_control", *MUTANTS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(names, pool.map(lambda n: _check(n, root), names), strict=True))


def test_the_control_passes_every_check_a_mutant_fails(outcomes: dict[str, dict[str, Any]]) -> None:
    control = outcomes["mutant_control"]
    failed = [c for c in control["report"]["checks"] if c["outcome"] == "failed"]
    assert control["code"] == 0 and not failed, (control["report"].get("verdict"), failed, control["stderr"][-2000:])
    assert sum(c["outcome"] == "passed" for c in control["report"]["checks"]) >= 30


@pytest.mark.parametrize("name", MUTANTS)
def test_the_mutant_never_makes_fd_run_print_wrong_tokens(outcomes: dict[str, dict[str, Any]], name: str) -> None:
    run = outcomes[name]["run"]
    if run["code"] != 0:
        assert run["error"] and run["error"][0].startswith("fd: error: "), run  # stopped, with one line that says why
        return
    control = outcomes["mutant_control"]["run"]
    assert control["code"] == 0, control
    assert json.loads(run["stdout"])["tokens"] == json.loads(control["stdout"])["tokens"], f"{name}: fd run printed other tokens with exit 0"


@pytest.mark.parametrize("name", MUTANTS)
def test_the_mutant_fails_fd_check(outcomes: dict[str, dict[str, Any]], name: str) -> None:
    got = outcomes[name]
    failed = [c for c in got["report"]["checks"] if c["outcome"] == "failed"]
    assert got["code"] != 0 and failed, f"{name} passed fd check -k {_expect(name)!r}: {got['report'].get('verdict')}"
    # The checks it fails pass without the mutation: the mutation, not the check, is what fails.
    passed = {c["check"] for c in outcomes["mutant_control"]["report"]["checks"] if c["outcome"] == "passed"}
    assert {c["check"] for c in failed} <= passed, (name, [c["check"] for c in failed if c["check"] not in passed])
    # Each failure says what was wrong, naming the platform: not a bare assertion.
    for check in failed:
        assert name in check["detail"] and len(check["detail"]) > 40, check


if __name__ == "__main__":  # print what each mutant fails: python tests/mutants/test_mutants.py
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for mutant in sys.argv[1:] or MUTANTS:
            got = _check(mutant, Path(tmp))
            print(f"{mutant}: exit {got['code']}, {got['seconds']:.1f} s")
            for c in got["report"]["checks"]:
                if c["outcome"] == "failed":
                    print(f"  {c['check']}: {c['detail'][:260]}")
