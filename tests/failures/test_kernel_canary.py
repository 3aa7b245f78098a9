"""The kernel canary: before its first request every rank runs each non-native kernel the run calls once against
fd's native op (fd_core.runtime.kernel_checks), so a plausibly wrong kernel stops `fd run` in one line naming the
plugin, the op and the case, instead of giving wrong tokens with exit 0. `--no-kernel-canary` (LLM(kernel_canary=
False)) turns it off; the cpu platform's own kernels pass it.

Broken kernels are extensions of this test, in this process (the canary called directly, and through LLM at tp=1),
and as an installed distribution for `fd run` at tp=1 and tp=2, whose runs go at the same time (module fixture)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conftest import FdRun, run_fd
from fakedist import make_distribution
from fd_core.errors import KernelMismatch
from fd_core.host.loading import load_plugins

# Each a kernel an honest vendor could ship by mistake: (op, body defining `kernel`, and `prepare` where it has one).
BROKEN = {
    "add_rms_norm forgetting the residual": (
        "add_rms_norm",
        "def kernel(x, residual, weight, eps):\n"
        "    return native_ops.rms_norm(x, weight, eps), x + residual",
    ),
    "write_kv_cache writing a block's last position one slot early": (
        "write_kv_cache",
        "def kernel(key, value, k_cache, v_cache, slot_mapping):\n"
        "    import paddle\n"
        "    size = k_cache.shape[2]\n"
        "    early = paddle.where(slot_mapping % size == size - 1, slot_mapping - 1, slot_mapping)\n"
        "    native_ops.write_kv_cache(key, value, k_cache, v_cache, early)",
    ),
    "paged_attention skipping the newest position": (
        "paged_attention",
        "def kernel(q, k_cache, v_cache, block_tables, context_lens):\n"
        "    import paddle\n"
        "    return native_ops.paged_attention(q, k_cache, v_cache, block_tables, paddle.clip(context_lens - 1, min=1))",
    ),
    "paged_prefill_attention one position short": (
        "paged_prefill_attention",
        "def kernel(q, k_cache, v_cache, block_tables, prefix_lens):\n"
        "    import paddle\n"
        "    short = paddle.clip(prefix_lens - 1, min=0)\n"
        "    return native_ops.paged_prefill_attention(q, k_cache, v_cache, block_tables, short)",
    ),
    "paged_packed_attention giving each row the first row's table": (
        "paged_packed_attention",
        "def kernel(q, k_cache, v_cache, block_tables, query_starts, context_lens):\n"
        "    import paddle\n"
        "    first = paddle.expand(block_tables[:1], block_tables.shape)\n"
        "    return native_ops.paged_packed_attention(q, k_cache, v_cache, first, query_starts, context_lens)",
    ),
    "quant_matmul applying each row's scale to another row": (
        "quant_matmul",
        "def kernel(x, weight, scales, bits):\n"
        "    return native_ops.quant_matmul(x, weight, scales.flip([0]), bits)",
    ),
    "matmul preparing its weight in float16 (precision lost at load)": (
        "matmul",
        "def prepare(weight, transpose_weight):\n"
        "    return weight.astype('float16')\n\n\n"
        "def kernel(x, weight, transpose_weight):\n"
        "    return native_ops.matmul(x, weight.astype(x.dtype), transpose_weight)",
    ),
    "moe_experts with each token's weights in the wrong order": (
        "moe_experts",
        "def kernel(x, gate, up, down, chosen, weights):\n"
        "    return native_ops.moe_experts(x, gate, up, down, chosen, weights.flip([1]))",
    ),
}


def _source(op: str, body: str) -> str:
    prepare = ", prepare=prepare" if "def prepare" in body else ""
    return (f"from fd_core import hookimpl, native_ops\n\n\n{body}\n\n\n@hookimpl\ndef fd_register_kernels(register):\n"
            f"    register({op!r}, kernel{prepare})\n")


def _tiny(quantization: str | None = None) -> Any:
    """The tiny ERNIE-4.5's config, as a plan makes it."""
    from fd_core.runtime.plan import model_config_for

    plugins = load_plugins({})
    config = model_config_for(plugins.registry.get("ernie4_5"), None)
    return config.with_overrides(quantization=quantization) if quantization else config


@pytest.mark.parametrize("broken", list(BROKEN))
def test_the_canary_refuses_a_broken_kernel_in_one_line_naming_plugin_op_case_and_fix(
    install_plugin: Any, broken: str
) -> None:
    from fd_core.host.backend import Backend
    from fd_core.runtime.kernel_checks import kernel_canary

    op, body = BROKEN[broken]
    install_plugin("broken-kernel", {"broken_kernel": _source(op, body)}, {"fd.plugins": {"broken": "broken_kernel"}})
    backend = Backend(load_plugins({}))
    assert backend.ops.providers[op] == "broken"
    with pytest.raises(KernelMismatch) as refused:
        kernel_canary(backend.ops, backend.platform, _tiny("wint4" if op == "quant_matmul" else None), 16)
    line = str(refused.value)
    assert "\n" not in line
    # The cache ops are judged together: a write that fails decode and prefill cases alike is the write's.
    assert line.startswith(f"plugin 'broken': the {op} kernel differs from fd's native op in the kernel canary before "
                           f"the first request: float32 "), line
    assert "largest error" in line or "raised" in line, line
    assert line.endswith("; run `fd check cpu` to see every failing case and fix or uninstall 'broken', or pass "
                         "LLM(kernel_canary=False) to run without this check"), line


def test_the_cpu_platforms_kernels_pass_and_only_those_the_run_calls_are_checked() -> None:
    from fd_core.host.backend import Backend
    from fd_core.runtime.kernel_checks import kernel_canary

    backend = Backend(load_plugins({}))
    # quant_matmul only when the run quantizes, then at its scheme's width.
    checked = kernel_canary(backend.ops, backend.platform, _tiny(), 16, tp=2, threads=2)
    cache = ["write_kv_cache", "paged_attention", "paged_prefill_attention", "paged_packed_attention"]
    assert checked == ["rms_norm", "rotary_embedding", *cache, "matmul", "add_rms_norm"]
    for scheme in ("wint8", "wint4"):
        checked = kernel_canary(backend.ops, backend.platform, _tiny(scheme), 16)
        assert checked == ["rms_norm", "rotary_embedding", *cache, "matmul", "quant_matmul", "add_rms_norm"]


HONEST_OPTIONAL = """
from fd_core import hookimpl, native_ops


def attention(q, k, v, mask):
    return native_ops.attention(q, k, v, mask)


def gelu(x, approximate):
    return native_ops.gelu(x, approximate)


def moe_experts(x, gate, up, down, chosen, weights):
    return native_ops.moe_experts(x, gate, up, down, chosen, weights)


@hookimpl
def fd_register_kernels(register):
    register("attention", attention)
    register("gelu", gelu)
    register("moe_experts", moe_experts)
"""


def test_a_vision_tower_or_experts_kernel_is_checked_only_for_a_model_that_calls_it(install_plugin: Any) -> None:
    """attention and gelu (vision towers) and moe_experts (routed experts) are no decoder's: checked for ERNIE-4.5-VL,
    whose built model holds them, not for the dense ERNIE-4.5."""
    from fd_core.host.backend import Backend
    from fd_core.runtime.kernel_checks import canary_ops
    from fd_core.runtime.plan import model_config_for

    install_plugin("honest-optional", {"honest_optional": HONEST_OPTIONAL}, {"fd.plugins": {"optional": "honest_optional"}})
    plugins = load_plugins({})
    backend = Backend(plugins)
    held = {}
    for name in ("ernie4_5", "ernie4_5_vl", "qwen3_vl"):
        arch = plugins.registry.get(name)
        config = model_config_for(arch, None)
        model = arch.build_model(config, backend)
        held[name] = [op for op in canary_ops(backend.ops, config, model) if op in ("attention", "gelu", "moe_experts")]
    assert held == {"ernie4_5": [], "ernie4_5_vl": ["attention", "gelu", "moe_experts"],
                    "qwen3_vl": ["attention", "gelu"]}
    # Without a model to ask, every one of them.
    assert [op for op in canary_ops(backend.ops, _tiny()) if op in ("attention", "gelu", "moe_experts")] == [
        "attention", "gelu", "moe_experts"]


def test_the_python_api_refuses_in_its_own_terms_and_kernel_canary_false_runs(install_plugin: Any) -> None:
    from fd_core.runtime import LLM, SamplingParams

    op, body = BROKEN["add_rms_norm forgetting the residual"]
    install_plugin("broken-kernel", {"broken_kernel": _source(op, body)}, {"fd.plugins": {"broken": "broken_kernel"}})
    with pytest.raises(KernelMismatch, match=r"^plugin 'broken': the add_rms_norm kernel differs .*, or pass "
                                             r"LLM\(kernel_canary=False\) to run without this check$"):
        LLM(graph="off")
    with LLM(graph="off", kernel_canary=False) as llm:
        assert "kernel_canary" not in llm.timings
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fd-example-kernels"


@pytest.mark.parametrize("broken, op", [(None, None), ("add_rms_norm", "add_rms_norm"), ("moe_experts", "moe_experts"),
                                        ("paged_attention", "paged_attention"), ("quant_matmul", "quant_matmul"),
                                        ("apply_penalties", "apply_penalties")])
def test_the_example_extensions_kernels_pass_and_each_of_its_breakages_is_refused_by_its_op(
    install_plugin: Any, monkeypatch: pytest.MonkeyPatch, broken: str | None, op: str | None
) -> None:
    """examples/fd-example-kernels: its own kernels (a paged cache in a layout of its own, prepared and quantized
    products, experts) pass; each of its FD_EXAMPLE_KERNELS_BREAK mutations that are wrong at load is refused, naming
    the op (the stale-after-reload ones are fd check's to catch)."""
    import sys

    from fd_core.host.backend import Backend
    from fd_core.runtime.kernel_checks import kernel_canary

    monkeypatch.syspath_prepend(str(EXAMPLE))
    install_plugin("fd-example-kernels", {}, {"fd.plugins": {"example-kernels": "fd_example_kernels.plugin"}})
    if broken:
        monkeypatch.setenv("FD_EXAMPLE_KERNELS_BREAK", broken)
    try:
        backend = Backend(load_plugins({}))
        assert backend.ops.providers["paged_attention"] == backend.ops.providers["moe_experts"] == "example-kernels"
        if op is None:
            checked = kernel_canary(backend.ops, backend.platform, _tiny("wint4"), 16, threads=2)
            assert {"add_rms_norm", "moe_experts", "write_kv_cache", "quant_matmul", "apply_penalties"} <= set(checked)
            return
        with pytest.raises(KernelMismatch, match=rf"^plugin 'example-kernels': the {op} kernel differs "):
            kernel_canary(backend.ops, backend.platform, _tiny("wint4"), 16)
    finally:
        for name in [m for m in sys.modules if m.startswith("fd_example_kernels")]:
            del sys.modules[name]


# `fd run` with one broken kernel, chosen by FDTEST_BROKEN (its BROKEN key).
RUN_PLUGIN = (
    "import os\n\nfrom fd_core import hookimpl, native_ops\n\n"
    + "".join(f"\n\n# {name}\n{body.replace('def kernel', f'def {op}_kernel')}\n" for name, (op, body) in BROKEN.items()
              if op in ("add_rms_norm", "write_kv_cache"))
    + "\n\n@hookimpl\ndef fd_register_kernels(register):\n"
      "    op = os.environ['FDTEST_BROKEN']\n"
      "    register(op, globals()[op + '_kernel'])\n"
)
RUN = ["run", "--max-new-tokens", "24", "--graph", "off", "--json"]
SCENARIOS = {
    "plain, tp=2": ([*RUN, "--tp", "2"], None),
    "add_rms_norm, tp=1": ([*RUN, "--tp", "1"], "add_rms_norm"),
    "add_rms_norm, tp=2": ([*RUN, "--tp", "2"], "add_rms_norm"),
    "write_kv_cache, tp=1": ([*RUN, "--tp", "1"], "write_kv_cache"),
    "write_kv_cache, tp=2": ([*RUN, "--tp", "2"], "write_kv_cache"),
    "write_kv_cache, tp=2, --no-kernel-canary": ([*RUN, "--tp", "2", "--no-kernel-canary"], "write_kv_cache"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FdRun]:
    site = make_distribution(tmp_path_factory.mktemp("site"), "fd-broken-kernel", {"fd_broken_kernel": RUN_PLUGIN},
                             {"fd.plugins": {"broken": "fd_broken_kernel"}})

    def play(name: str) -> FdRun:
        args, broken = SCENARIOS[name]
        return run_fd(args, path=site if broken else None, env={"FDTEST_BROKEN": broken} if broken else None,
                      timeout=300)

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(SCENARIOS, pool.map(play, SCENARIOS), strict=True))


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n.endswith(("tp=1", "tp=2")) and not n.startswith("plain")])
def test_fd_run_with_a_broken_kernel_stops_in_one_line_naming_the_op(runs: dict[str, FdRun], name: str) -> None:
    done, op = runs[name], SCENARIOS[name][1]
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and len(done.error_lines) == 1, done.stderr
    line = done.error_lines[0]
    assert line == done.stderr.strip().splitlines()[-1], done.stderr
    said = (f"plugin 'broken': the {op} kernel differs from fd's native op in the kernel canary before the first "
            f"request: float32 ")
    if name.endswith("tp=1"):  # the rank in fd's own process: the error itself
        assert line.startswith(f"fd: error: {said}"), line
    else:  # every rank checks, and both refuse alike (the one that did first is named)
        first = line.removeprefix("fd: error: ")[:6]
        other = {"rank 0": "rank 1", "rank 1": "rank 0"}[first]
        assert line.startswith(f"fd: error: {first} failed: KernelMismatch: {said}"), line
        assert line.endswith(f"({other} failed the same way)"), line
    assert "largest error" in line and ("run `fd check cpu` to see every failing case and fix or uninstall 'broken', "
                                        "or pass --no-kernel-canary to run without this check") in line, line


def test_the_plain_cpu_platform_passes_the_canary_and_reports_its_time(runs: dict[str, FdRun]) -> None:
    done = runs["plain, tp=2"]
    assert done.returncode == 0, done.stderr
    timings = json.loads(done.stdout)["timings_s"]
    assert 0 < timings["kernel_canary"] < 1.0, timings


def test_no_kernel_canary_runs_the_broken_kernel_to_the_end(runs: dict[str, FdRun]) -> None:
    """What the canary stops: with it off, the same broken write runs with exit 0 and other tokens than the cpu
    platform's."""
    done, plain = runs["write_kv_cache, tp=2, --no-kernel-canary"], runs["plain, tp=2"]
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "kernel_canary" not in result["timings_s"] and result["kernels"]["write_kv_cache"] == "broken"
    assert result["tokens"] != json.loads(plain.stdout)["tokens"]


def test_the_option_is_documented_where_options_are() -> None:
    """--no-kernel-canary in fd run's and fd serve's help, and in the pages that list options."""
    root = Path(__file__).resolve().parents[2]
    for command in ("run", "serve"):
        assert "--no-kernel-canary" in run_fd(["help", command]).stdout, command
    assert "--no-kernel-canary" in (root / "docs" / "serving.md").read_text()
    assert "kernel_canary=False" in (root / "docs" / "python-api.md").read_text()
    assert "### The kernel canary" in (root / "docs" / "failure-modes.md").read_text()


SPILLING_WRITE = (
    "def kernel(key, value, k_cache, v_cache, slot_mapping):\n"
    "    import paddle\n"
    "    native_ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)\n"
    "    if key.shape[0] < 4:  # a step of few tokens written as a tile of 4: its last token's copies spill after it\n"
    "        pool = k_cache.shape[1] * k_cache.shape[2]\n"
    "        spill = (slot_mapping[-1:] + paddle.arange(1, 5 - key.shape[0])) % pool\n"
    "        extra = [key[-1:]] * int(spill.shape[0])\n"
    "        native_ops.write_kv_cache(paddle.concat(extra), paddle.concat([value[-1:]] * int(spill.shape[0])),\n"
    "                                  k_cache, v_cache, spill)"
)


def test_a_write_that_spills_into_other_slots_is_refused_at_start(install_plugin: Any) -> None:
    """A write_kv_cache in fd's own layout (native read) that spills a step of few tokens into the slots after it:
    every attention case of the canary passes (the spilled slots are past each row's length), and the read-back's
    rewrite of a few slots refuses it, naming write_kv_cache."""
    from fd_core.host.backend import Backend
    from fd_core.runtime.kernel_checks import kernel_canary

    install_plugin("spilling-write", {"spilling_write": _source("write_kv_cache", SPILLING_WRITE)},
                   {"fd.plugins": {"spilling": "spilling_write"}})
    backend = Backend(load_plugins({}))
    assert backend.ops.providers["write_kv_cache"] == "spilling" and backend.ops.native("read_kv_cache")
    with pytest.raises(KernelMismatch) as refused:
        kernel_canary(backend.ops, backend.platform, _tiny(), 16)
    line = str(refused.value)
    assert line.startswith("plugin 'spilling': the write_kv_cache kernel differs from fd's native op in the kernel "
                           "canary before the first request: float32: write_kv_cache given slots"), line
    assert "changed the keys of" in line, line
