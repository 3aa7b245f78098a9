"""Packages written against each released contract, installed with pip and certified with `fd check` as a vendor would.

Each folder here is one release's frozen copies (README.md says which and why). A change that fails a check here breaks
plugins in the field: it needs a new contract major, or a deprecation that keeps the old form working.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from importlib.metadata import Distribution, distributions
from pathlib import Path

import pytest

from fakedist import run_fd
from fd_core import CONTRACT_VERSION

HERE = Path(__file__).parent
RELEASES = sorted(p.name for p in HERE.iterdir() if p.is_dir() and any(p.glob("*/pyproject.toml")))
EXAMPLES = HERE.parents[1] / "examples"
NOT_CODE = {"build", "tests", "__pycache__"}
CACHE_OPS = {"allocate_kv_cache", "write_kv_cache", "paged_attention", "paged_prefill_attention"}


def _code(package: Path) -> str:
    """A package's code as Python reads it: its modules' syntax trees, less the FD_CONTRACT declaration. Two copies
    that differ only in layout, comments or the declaration (which test_fd_plugins_lists... checks) run the same."""
    trees = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        if NOT_CODE & set(parts) or any(p.endswith(".egg-info") for p in parts):
            continue
        tree = ast.parse(path.read_text())
        tree.body = [node for node in tree.body if not (
            isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FD_CONTRACT" for t in node.targets))]
        trees.append(f"{'/'.join(parts)}\n{ast.dump(tree)}")
    return "\n".join(trees)


def certified_elsewhere(release: str, name: str) -> str | None:
    """Where the same code as this release's copy of package `name` is certified already, if it is: the example
    that ships it (its own tests and tests/core/test_kernels.py run the same checks on it), or an earlier folder's
    copy. Each distinct code is certified once, keeping CI in its budget."""
    code = _code(HERE / release / name)
    if (EXAMPLES / name / "pyproject.toml").exists() and _code(EXAMPLES / name) == code:
        return f"examples/{name}"
    for other in RELEASES[: RELEASES.index(release)]:
        if (HERE / other / name / "pyproject.toml").exists() and _code(HERE / other / name) == code:
            return f"{other}/{name}"
    return None


def test_a_copy_that_differs_from_another_only_in_layout_or_declaration_is_the_same_code() -> None:
    """The check that lets a copy be certified once: the previous release's platform package and its 1.0 copy differ
    in layout and FD_CONTRACT only; the 1.2 one adds hooks; the shipped example is 1.2's."""
    assert certified_elsewhere("previous-release", "fd-checked-allreduce") == "contract-1.0/fd-checked-allreduce"
    assert certified_elsewhere("contract-1.0", "fd-checked-allreduce") is None
    assert _code(HERE / "contract-1.0" / "fd-checked-allreduce") != _code(HERE / "contract-1.2" / "fd-checked-allreduce")
    assert certified_elsewhere("contract-1.2", "fd-checked-allreduce") == "examples/fd-checked-allreduce"


def test_every_release_since_the_first_is_here() -> None:
    """The previous release (no declared contract) and this contract version each have their copies."""
    assert "previous-release" in RELEASES and f"contract-{CONTRACT_VERSION}" in RELEASES, RELEASES


@pytest.fixture(scope="module", params=RELEASES)
def release(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One release's packages, pip-installed (from a copy: a build writes beside its sources) into one directory."""
    name = request.param
    sources, target = tmp_path_factory.mktemp(f"{name}-src"), tmp_path_factory.mktemp(name)
    packages = []
    for package in sorted((HERE / name).glob("*/pyproject.toml")):
        copy = sources / package.parent.name
        shutil.copytree(package.parent, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        packages.append(str(copy))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                           "--target", str(target), *packages], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return name, target


def _installed(target: Path) -> list[Distribution]:
    return sorted(distributions(path=[str(target)]), key=lambda d: d.metadata["Name"])


def _entry_points(target: Path, group: str) -> list[str]:
    return sorted(ep.name for dist in _installed(target) for ep in dist.entry_points if ep.group == group)


def _check(args: list[str], target: Path) -> dict:
    """`fd check ... --json` with the release installed; the report, after asserting it passed with exit code 0."""
    done = run_fd(["check", *args, "--json"], target, timeout=600)
    assert done.stdout, done.stderr[-3000:]
    report = json.loads(done.stdout)
    failed = [f"{c['check']}: {c['detail']}" for c in report["checks"] if c["outcome"] == "failed"]
    assert (done.returncode, report["verdict"]) == (0, "passed"), (report["verdict"], failed, done.stderr[-2000:])
    return report


def test_fd_plugins_lists_each_package_with_the_contract_it_was_written_for(release: tuple[str, Path]) -> None:
    name, target = release
    done = run_fd(["plugins", "--json"], target)
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert listed["contract_version"] == CONTRACT_VERSION and not listed["problems"]
    ours = {d.metadata["Name"] for d in _installed(target)}
    records = [p for p in listed["plugins"] if p["distribution"] in ours]
    assert {p["distribution"] for p in records} == ours
    declared = name != "previous-release"  # before contract versions, no package could say one
    version = name.removeprefix("contract-") if declared else "1.0"  # none declared: read as the first version
    for record in records:
        assert record["error"] is None, record
        assert (record["contract"], record["contract_declared"]) == (version, declared), record
    text = run_fd(["plugins"], target).stdout
    assert text.endswith(f"\nfd's plugin contract: {CONTRACT_VERSION}\n")
    assert (f", contract {version} (not declared)" in text) == (not declared)


def test_the_cpu_platform_conforms_with_the_release_installed(release: tuple[str, Path]) -> None:
    """Its kernels are checked against the native ops and its model packages run on the platform, apart from the
    platform's own checks: the cpu suite's checks that run what a release installs (its kernels, and the cache
    layout, prepared weights and quantized models where it registers their ops; its models); the rest of the cpu
    suite is the cpu platform's own, run by tests/plugins/cpu."""
    name, target = release
    elsewhere = [certified_elsewhere(name, d.metadata["Name"]) for d in _installed(target)]
    if all(elsewhere):
        pytest.skip(f"every package of {name} is certified as {', '.join(map(str, elsewhere))}")
    listed = json.loads(run_fd(["plugins", "--json"], target).stdout)
    ops = {op for p in listed["plugins"] if p["name"] in _entry_points(target, "fd.plugins") for op in p["kernels"]}
    assert ops or _entry_points(target, "fd.models")
    # The checks what the release registers can change: its kernels the kernel and native-path ones, its cache ops
    # the paged one, its matmul or quant_matmul (and their preparation) the prepared and quantized ones; its model
    # packages the one that runs them on the platform.
    checks = ["installed_model_packages"] + (["every_kernel_in_use", "platform_generates_what_the_native_path"]
                                             if ops else [])
    if ops & CACHE_OPS:
        checks.append("paged")
    if ops & {"matmul", "quant_matmul"}:
        checks += ["prepared", "quantized"]
    report = _check(["cpu", "-k", " or ".join(checks)], target)
    outcome = {c["check"]: c["outcome"] for c in report["checks"]}
    if ops:
        assert outcome["test_every_kernel_in_use_matches_the_native_op"] == "passed"
        assert outcome["test_the_platform_generates_what_the_native_path_does"] == "passed"
    # Not skipped where the release has a model package: it runs on the platform.
    models_here = bool(_entry_points(target, "fd.models"))
    assert outcome["test_installed_model_packages_run_on_this_platform"] == ("passed" if models_here else "skipped")
    if "quantized" in checks:
        assert outcome["test_quantized_models_generate_what_the_native_path_does"] == "passed"


def test_each_platform_package_passes_the_platform_suite(release: tuple[str, Path]) -> None:
    name, target = release
    platforms = {ep.name: dist.metadata["Name"] for dist in _installed(target) for ep in dist.entry_points
                 if ep.group == "fd.platforms"}
    if not platforms:
        pytest.skip("this release's folder holds no platform package")
    checked = 0
    for platform, package in sorted(platforms.items()):
        if certified_elsewhere(name, package) is None:
            report = _check([platform], target)
            assert report["platform"] == platform and report["counts"]["passed"] > 30
            checked += 1
    if not checked:
        pytest.skip(f"the same code is certified as {', '.join(str(certified_elsewhere(name, p)) for p in platforms.values())}")


def test_each_model_package_passes_the_model_suite(release: tuple[str, Path]) -> None:
    """With the transformers reference: the tokens are the published implementation's."""
    pytest.importorskip("transformers", reason="the reference comes with the test extra (pip install -e '.[test]')")
    _, target = release
    packages = _entry_points(target, "fd.models")
    if not packages:
        pytest.skip("this release's folder holds no model package")
    listed = json.loads(run_fd(["plugins", "--json"], target).stdout)
    architectures = [a["name"] for a in listed["architectures"] if a["package"] in packages]
    assert architectures
    for architecture in architectures:
        # The reference's tokens: what a package written against an earlier contract must still give (the model
        # suite's other checks are fd's shared layers, run on fd's own architectures by tests/models).
        # And its prompts scored in their prefill (prefill_every, contract 1.5; inherited from fd's decoder before).
        report = _check(["--model", architecture, "-k", "reference_greedy_tokens or scored_in_its_prefill"], target)
        outcome = {c["check"]: c["outcome"] for c in report["checks"]}
        assert outcome["test_reference_greedy_tokens[preset]"] == "passed"
        assert outcome["test_a_prompt_scored_in_its_prefill_equals_one_scored_a_step[preset]"] == "passed"
