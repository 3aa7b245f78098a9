"""fd_register_kernels and the named ops: registration checked at load, precedence, direct calls, capture,
reporting, and the suite's kernel checks catching a wrong kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fakedist import make_distribution, run_fd
from fd_core.errors import ConfigError, PluginError
from fd_core.host.loading import load_plugins

ROOT = Path(__file__).resolve().parents[2]


def _extension(name: str, source: str) -> tuple[str, dict[str, str], dict[str, dict[str, str]]]:
    module = name.replace("-", "_")
    return name, {module: source}, {"fd.plugins": {name: module}}


def _kernels(body: str) -> str:
    return "from fd_core import hookimpl\n\n\n@hookimpl\ndef fd_register_kernels(register):\n" + "".join(f"    {line}\n" for line in body.splitlines())


MISSPELLED = _kernels("register('rms_nrom', lambda x, weight, eps: x)")
BAD_SIGNATURE = _kernels("register('silu_and_mul', lambda a, b: a)")
NOT_A_FLAG = _kernels("register('silu_and_mul', lambda gate, up: gate, capturable='yes')")
IDENTITY_NORM = _kernels("register('rms_norm', rms_norm)").replace("@hookimpl", "def rms_norm(x, weight, eps):\n    return x * weight\n\n\n@hookimpl")
RECORDING_NORM = """
from fd_core import hookimpl, native_ops
from fd_core.graphs import capturing

SEEN = []


def rms_norm(x, weight, eps):
    SEEN.append(capturing())
    return native_ops.rms_norm(x, weight, eps)


@hookimpl
def fd_register_kernels(register):
    register("rms_norm", rms_norm, capturable=CAPTURABLE)
"""
MODEL_WITH_KERNELS = """
from fd_core import hookimpl


@hookimpl
def fd_register_models(register):
    pass


@hookimpl
def fd_register_kernels(register):
    register("silu_and_mul", lambda gate, up: gate)
"""


def test_an_unknown_op_is_refused_at_load_naming_the_plugin_and_the_nearest_op(install_plugin) -> None:
    install_plugin(*_extension("typo-kernels", MISSPELLED))
    with pytest.raises(PluginError) as err:
        load_plugins({})
    assert str(err.value) == (
        "plugin 'typo-kernels': fd_register_kernels registered an unknown op 'rms_nrom'; did you mean 'rms_norm'? "
        "(fd's ops: rms_norm, silu_and_mul, rotary_embedding, attention, sample, accept_draft, apply_penalties, allocate_kv_cache, "
        "write_kv_cache, read_kv_cache, paged_attention, paged_prefill_attention, paged_packed_attention, matmul, quant_matmul, add_rms_norm, "
        "gelu, moe_experts); fix the name "
        "in 'typo-kernels'"
    )


@pytest.mark.parametrize("op, suggested", [
    ("rms_nrom", "rms_norm"), ("silu_and_mull", "silu_and_mul"), ("gleu", "gelu"), ("moe_expert", "moe_experts"),
    ("fused_rope_foo", None), ("add_rms_norm_fused", None), ("layer_norm", None), ("rope", None), ("norm", None),
])
def test_only_a_likely_misspelling_gets_a_suggestion_and_fds_ops_are_always_listed(op: str, suggested: str | None) -> None:
    """A name a letter or two from one of fd's ops is a typo of it; one that only shares a part with an op (another
    op, unknown to this fd) gets no guess, which would point at the wrong op."""
    from fd_core.host.kernel_table import check_kernel
    from fd_core.kernels import OPS

    with pytest.raises(PluginError) as err:
        check_kernel("p", op, lambda x: x, True)
    message = str(err.value)
    assert message.startswith(f"plugin 'p': fd_register_kernels registered an unknown op {op!r}"), message
    assert ("did you mean" in message) == (suggested is not None), message
    if suggested:
        assert f"; did you mean {suggested!r}? (fd's ops: " in message, message
    assert f"(fd's ops: {', '.join(OPS)}); fix the name in 'p'" in message


def test_a_kernel_whose_signature_does_not_fit_the_op_is_refused(install_plugin) -> None:
    install_plugin(*_extension("odd-kernels", BAD_SIGNATURE))
    with pytest.raises(PluginError, match=r"^plugin 'odd-kernels': its kernel for 'silu_and_mul' takes \(a, b\), but silu_and_mul is called as "
                                          r"silu_and_mul\(gate, up\); give it exactly those arguments \(more only with defaults\)$"):
        load_plugins({})


PREPARE_ON_NORM = _kernels("register('rms_norm', lambda x, weight, eps: x, prepare=lambda weight, eps: weight)")
PREPARE_MISNAMED = _kernels("register('matmul', lambda x, weight, transpose_weight: x, prepare=lambda w, t: w)")
PREPARE_NOT_CALLABLE = _kernels("register('matmul', lambda x, weight, transpose_weight: x, prepare='pack')")


WRAPPED = """
import functools

from fd_core import hookimpl, native_ops

CALLS = []


def counted(fn):
    @functools.wraps(fn, assigned=("__name__", "__doc__"))  # not __wrapped__: inspect would report fn's signature
    def kernel(*args, **kwargs):
        CALLS.append(fn.__name__)
        return fn(*args, **kwargs)
    return kernel


def norm(x, *rest):
    CALLS.append("norm")
    return native_ops.rms_norm(x, *rest)


@hookimpl
def fd_register_kernels(register):
    register("silu_and_mul", counted(native_ops.silu_and_mul))
    register("rms_norm", norm)
"""


def test_a_wrapper_taking_args_and_kwargs_is_accepted_and_called(install_plugin) -> None:
    """fd calls every op positionally: a `(*args, **kwargs)` wrapper, or named leading arguments then `*rest`, takes
    every call, so it registers and serves the op; a leading name that is not the op's is still refused."""
    import importlib

    import numpy as np
    import paddle

    from fd_core import native_ops
    from fd_core.host.backend import Backend
    from fd_core.host.kernel_table import check_kernel

    install_plugin(*_extension("wrapped-kernels", WRAPPED))
    backend = Backend(load_plugins({}))
    assert backend.ops.providers["silu_and_mul"] == backend.ops.providers["rms_norm"] == "wrapped-kernels"
    gate, up, weight = (paddle.to_tensor(np.random.default_rng(i).standard_normal((2, 8)).astype("float32"))
                        for i in range(3))
    np.testing.assert_array_equal(backend.ops.silu_and_mul(gate, up).numpy(), native_ops.silu_and_mul(gate, up).numpy())
    np.testing.assert_array_equal(backend.ops.rms_norm(gate, weight[0], 1e-6).numpy(),
                                  native_ops.rms_norm(gate, weight[0], 1e-6).numpy())
    assert importlib.import_module("wrapped_kernels").CALLS == ["silu_and_mul", "norm"]
    with pytest.raises(PluginError, match=r"its kernel for 'rms_norm' takes \(h, rest\)"):
        check_kernel("p", "rms_norm", lambda h, *rest: h, True)


@pytest.mark.parametrize("source, message", [
    (PREPARE_ON_NORM, "plugin 'prep': fd_register_kernels registered a prepare function for 'rms_norm', whose "
                      "arguments are never prepared (ops with prepared weights: matmul, quant_matmul, moe_experts); register "
                      "'rms_norm' without prepare="),
    (PREPARE_MISNAMED, "plugin 'prep': its prepare function for 'matmul' takes (w, t), but it is called as "
                       "prepare(weight, transpose_weight) (the op's arguments after x); give it exactly those "
                       "arguments"),
    (PREPARE_NOT_CALLABLE, "plugin 'prep': fd_register_kernels registered prepare='pack' for 'matmul', which is not "
                           "callable; pass a function taking (weight, transpose_weight)"),
])
def test_a_prepare_function_is_checked_at_load(install_plugin, source: str, message: str) -> None:
    install_plugin(*_extension("prep", source))
    with pytest.raises(PluginError) as err:
        load_plugins({})
    assert str(err.value) == message


def test_capturable_must_be_a_bool(install_plugin) -> None:
    install_plugin(*_extension("flag-kernels", NOT_A_FLAG))
    with pytest.raises(PluginError, match="registered 'silu_and_mul' with capturable='yes'; pass True or False"):
        load_plugins({})


def test_two_extensions_on_one_op_is_an_error_naming_both(install_plugin) -> None:
    install_plugin(*_extension("first-kernels", IDENTITY_NORM))
    install_plugin(*_extension("second-kernels", IDENTITY_NORM))
    with pytest.raises(PluginError, match=r"plugins '(first|second)-kernels' and '(first|second)-kernels' both register a kernel for 'rms_norm'"):
        load_plugins({})


def test_a_model_package_may_not_register_kernels(install_plugin) -> None:
    install_plugin("model-kernels", {"model_kernels": MODEL_WITH_KERNELS},
                   {"fd.models": {"model-kernels": "model_kernels"}})
    with pytest.raises(PluginError, match="plugin 'model-kernels': a model package may not register kernels"):
        load_plugins({})


def test_an_extension_takes_precedence_over_the_platform_and_layers_call_it_directly(install_plugin) -> None:
    from fd_core import native_ops
    from fd_core.host.backend import Backend
    from fd_core.host.kernel_table import KernelTable
    from fd_plugins.cpu import kernels as cpu_kernels

    plain = Backend(load_plugins({}))
    assert plain.ops.providers["rms_norm"] == "cpu" and plain.ops.rms_norm is cpu_kernels.rms_norm
    assert plain.ops.silu_and_mul is native_ops.silu_and_mul and plain.ops.native("silu_and_mul")
    assert Backend(load_plugins({}), kernels=KernelTable()).ops.rms_norm is native_ops.rms_norm
    install_plugin(*_extension("first-kernels", IDENTITY_NORM))
    plugins = load_plugins({})
    backend = Backend(plugins)
    assert backend.ops.providers["rms_norm"] == "first-kernels"
    kernel = sys.modules["first_kernels"].rms_norm
    assert backend.ops.rms_norm is kernel
    from fd_models.layers.norm import RMSNorm

    assert RMSNorm(8, 1e-6, backend).rms_norm is kernel  # resolved once: the layer's call is the kernel's own
    assert (plugins.kernels.by_plugin("first-kernels") == ["rms_norm"]
            and plugins.kernels.by_plugin("cpu") == ["add_rms_norm", "matmul", "paged_attention",
                                                     "paged_packed_attention", "paged_prefill_attention",
                                                     "quant_matmul", "rms_norm", "rotary_embedding", "write_kv_cache"])


def test_no_model_layer_computes_an_op_itself() -> None:
    words = ("native_ops", "F.silu(", "rsqrt(", "def attend(", "def apply_rope(", "F.softmax(scores", "paddle.matmul(",
             "F.gelu(", "F.sigmoid(", "repeat_interleave(")
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "fd_models").rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1)
            if any(w in line for w in words)]
    assert not hits, f"model code computing a named op instead of calling the Backend's: {hits}"


@pytest.mark.parametrize("capturable", [True, False])
def test_capture_is_visible_to_a_kernel_and_an_uncapturable_one_turns_graphs_off(
    install_plugin, capturable: bool,
) -> None:
    from fd_core.host.backend import Backend
    from fd_core.runtime.engine.loop import Engine
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for
    from fd_core.runtime.request import Request

    install_plugin(*_extension("rec-kernels", RECORDING_NORM.replace("CAPTURABLE", str(capturable))))
    plugins = load_plugins({})
    backend = Backend(plugins)
    arch = plugins.registry.get("ernie4_5")
    runner = ModelRunner(backend, arch, model_config_for(arch, None))
    runner.load()
    decision = runner.decide()
    Engine(runner).generate(Request.greedy([[1, 2, 3]], 3))
    seen = sys.modules["rec_kernels"].SEEN
    if capturable:
        assert decision.allowed and True in seen and False in seen  # traced inside the capture, eager at prefill
    else:
        assert not decision.allowed and set(seen) == {False}
        assert any(
            v.plugin == "rec-kernels" and not v.allow and "rms_norm is registered as not capturable" in v.reason
            for v in decision.votes
        )
        with pytest.raises(ConfigError, match=r"^LLM\(graph='on'\): plugin 'rec-kernels' registered its kernel for rms_norm as not capturable; use 'auto' or 'off'$"):
            backend.graph_decision(runner.config, requested="on")


@pytest.fixture(scope="module")
def example_kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example extension package, installed with pip into a directory of its own (put on PYTHONPATH to use it)."""
    target = tmp_path_factory.mktemp("example-kernels")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(ROOT / "examples" / "fd-example-kernels")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return target


def test_a_pip_installed_extension_runs_its_kernels_on_every_rank_with_unchanged_tokens(
    example_kernels: Path, tmp_path: Path,
) -> None:
    # With penalties, so that its apply_penalties runs too; without the kernel canary, whose calls of every kernel
    # would leave the trace below whether or not the model calls them.
    args = ["run", "--tp", "2", "--max-new-tokens", "6", "--prompt-ids", "5,6,7,8", "--repetition-penalty", "1.3",
            "--presence-penalty", "0.5", "--json", "--no-kernel-canary"]
    plain = run_fd(args, timeout=300)
    assert plain.returncode == 0, plain.stderr
    trace = tmp_path / "trace"
    trace.mkdir()
    ours = run_fd(args, example_kernels, {"FD_EXAMPLE_KERNELS_TRACE": str(trace)}, timeout=300)
    assert ours.returncode == 0, ours.stderr
    plain_json, ours_json = json.loads(plain.stdout), json.loads(ours.stdout)
    assert plain_json["kernels"]["rms_norm"] == "cpu" and plain_json["kernels"]["silu_and_mul"] == "native"
    cache_ops = ("allocate_kv_cache", "write_kv_cache", "read_kv_cache", "paged_attention", "paged_prefill_attention",
                 "paged_packed_attention")
    products = ("matmul", "quant_matmul")  # on weights it prepares at load
    assert ours_json["kernels"] == {**plain_json["kernels"], "rms_norm": "example-kernels",
                                    "add_rms_norm": "example-kernels", "silu_and_mul": "example-kernels",
                                    "moe_experts": "example-kernels", "apply_penalties": "example-kernels",
                                    "accept_draft": "example-kernels",
                                    **dict.fromkeys((*cache_ops, *products), "example-kernels")}
    # Its own cache layout (token-major blocks), written and read by its own kernels on both ranks, and its own
    # prepared weights: the same tokens.
    assert ours_json["tokens"] == plain_json["tokens"]
    # One prompt in captured decode steps: no step mixes prompt chunks and decode rows (paged_packed_attention).
    # No prompt handed to another instance: read_kv_cache is not called either.
    called = [op for op in cache_ops if op not in ("paged_packed_attention", "read_kv_cache")]
    for op in ("rms_norm", "add_rms_norm", "silu_and_mul", *called, "matmul", "apply_penalties"):
        assert len({p.name for p in trace.glob(f"{op}.*")}) == 2, f"{op} was not called by both ranks: {sorted(p.name for p in trace.iterdir())}"
    listed = json.loads(run_fd(["plugins", "--json"], example_kernels).stdout)
    assert (next(p for p in listed["plugins"] if p["name"] == "example-kernels")["kernels"]
            == sorted(["rms_norm", "add_rms_norm", "silu_and_mul", "moe_experts", "apply_penalties", "accept_draft",
                       *cache_ops, *products]))
    explained = run_fd(["explain", "--tp", "1"], example_kernels)
    assert "rms_norm: example-kernels, silu_and_mul: example-kernels, rotary_embedding: cpu" in " ".join(explained.stdout.split())


def test_the_suite_passes_the_example_kernels(example_kernels: Path) -> None:
    done = run_fd(["check", "cpu", "-k", "kernel or native_path or paged or prepared or read_kv"], example_kernels,
                  timeout=300)
    assert done.returncode == 0 and "6 passed, 0 failed" in done.stdout, done.stdout + done.stderr
    assert "passed   test_read_kv_cache_gives_back_what_write_kv_cache_wrote" in done.stdout
    assert "passed   test_the_platform_generates_what_the_native_path_does" in done.stdout
    assert "passed   test_the_paged_kv_cache_ops_match_the_native_ones" in done.stdout
    assert "passed   test_prepared_weights_give_the_native_results_and_follow_a_reload" in done.stdout
    assert "passed   test_quantized_models_generate_what_the_native_path_does" in done.stdout


@pytest.mark.parametrize("broken, op", [("prepare", "matmul"), ("quant_matmul", "quant_matmul"),
                                        ("prepare_moe", "moe_experts")])
def test_the_suite_fails_a_stale_preparation_or_a_wrong_unpacking_by_its_op(
    example_kernels: Path, broken: str, op: str
) -> None:
    """FD_EXAMPLE_KERNELS_BREAK=prepare: the matmul preparation cached by the weight's id() (stale after an in-place
    reload); =quant_matmul: the two 4-bit values of a byte swapped; =prepare_moe: the experts' preparation cached by
    the gate's id()."""
    done = run_fd(["check", "cpu", "-k", "prepared"], example_kernels, {"FD_EXAMPLE_KERNELS_BREAK": broken},
                  timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if "test_prepared_weights" in x)
    assert line.split()[0] == "failed" and f"AssertionError: {op} (example-kernels)" in line, done.stdout
    if broken.startswith("prepare"):  # right at load, wrong only once the same tensor is refilled
        assert "after a reload (the same tensors refilled, prepared again)" in line, line


def test_the_suite_fails_an_add_rms_norm_that_normalises_before_the_add_by_its_name(example_kernels: Path) -> None:
    """The example's add_rms_norm made to normalise x instead of x + residual (FD_EXAMPLE_KERNELS_BREAK): its sum is
    right, its norm is not."""
    done = run_fd(["check", "cpu", "-k", "every_kernel_in_use"], example_kernels,
                  {"FD_EXAMPLE_KERNELS_BREAK": "add_rms_norm"}, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if "test_every_kernel_in_use" in x)
    assert line.split()[0] == "failed" and "AssertionError: add_rms_norm (example-kernels) float32 x[" in line, line
    assert "result 0 (normed): largest error" in line and "rms_norm (example-kernels)" not in line.replace(
        "add_rms_norm (example-kernels)", ""), line


@pytest.mark.parametrize("op, case", [("apply_penalties", "logits[4, "), ("accept_draft", "logits[4, 4, ")])
def test_the_suite_fails_penalties_or_an_acceptance_subtly_wrong_by_name(example_kernels: Path, op: str,
                                                                          case: str) -> None:
    """The example's apply_penalties made to subtract the presence penalty for the prompt's tokens too, and its
    accept_draft made to break a tied argmax toward the higher id (FD_EXAMPLE_KERNELS_BREAK)."""
    done = run_fd(["check", "cpu", "-k", "every_kernel_in_use"], example_kernels,
                  {"FD_EXAMPLE_KERNELS_BREAK": op}, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if "test_every_kernel_in_use" in x)
    assert line.split()[0] == "failed" and f"AssertionError: {op} (example-kernels) float32 {case}" in line, line


def test_the_suite_fails_a_moe_combine_that_forgets_the_weights_by_its_name(example_kernels: Path) -> None:
    """The example's moe_experts made to add every chosen expert at weight 1 (FD_EXAMPLE_KERNELS_BREAK): the kernel
    cases and the model run (ERNIE-4.5-VL's experts) both fail, naming the op."""
    done = run_fd(["check", "cpu", "-k", "every_kernel_in_use or native_path"], example_kernels,
                  {"FD_EXAMPLE_KERNELS_BREAK": "moe_experts"}, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if "test_every_kernel_in_use" in x)
    assert line.split()[0] == "failed" and "AssertionError: moe_experts (example-kernels) float32" in line, line
    line = next(x for x in done.stdout.splitlines() if "test_the_platform_generates_what_the_native_path_does" in x)
    assert line.split()[0] == "failed" and "ernie4_5_vl on cpu" in line, line


def test_the_suite_fails_an_off_by_one_read_kv_cache_by_its_name(example_kernels: Path) -> None:
    """The example's read_kv_cache made to read each slot's neighbour (FD_EXAMPLE_KERNELS_BREAK): the read-back check
    fails naming it, and the attention cases (which never read through it) pass."""
    done = run_fd(["check", "cpu", "-k", "read_kv or paged"], example_kernels,
                  {"FD_EXAMPLE_KERNELS_BREAK": "read_kv_cache"}, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("failed   test_read_kv_cache_gives_back_what_write_kv_cache_wrote  AssertionError: read_kv_cache "
            "(example-kernels): float32") in done.stdout, done.stdout
    assert "passed   test_the_paged_kv_cache_ops_match_the_native_ones" in done.stdout


def test_the_suite_fails_a_write_kv_cache_that_spills_by_its_name(example_kernels: Path) -> None:
    """The example's write made to round a step of few tokens up to a tile of 4 (FD_EXAMPLE_KERNELS_BREAK): its
    extra slots belong to other sequences, which no attention case reads; the read-back check's rewrite in
    decode-sized calls fails it, naming write_kv_cache."""
    done = run_fd(["check", "cpu", "-k", "read_kv"], example_kernels, {"FD_EXAMPLE_KERNELS_BREAK": "write_kv_cache"},
                  timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("failed   test_read_kv_cache_gives_back_what_write_kv_cache_wrote  AssertionError: write_kv_cache "
            "(example-kernels): float32") in done.stdout and "changed the keys of" in done.stdout, done.stdout


def test_the_suite_fails_an_off_by_one_paged_attention_by_its_name(example_kernels: Path) -> None:
    """The example's decode attention made to skip each row's newest position (FD_EXAMPLE_KERNELS_BREAK)."""
    done = run_fd(["check", "cpu", "-k", "paged"], example_kernels, {"FD_EXAMPLE_KERNELS_BREAK": "paged_attention"},
                  timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed   test_the_paged_kv_cache_ops_match_the_native_ones  AssertionError: paged_attention: " in done.stdout


WRONG_KERNELS = """
from fd_core import hookimpl, native_ops
from fd_core.kernels import compute_threads


def rms_norm(x, weight, eps):
    return native_ops.rms_norm(x, weight, 1e-2)  # the caller's eps ignored


def sample(logits, temperature, top_k, top_p, uniform):
    return native_ops.sample(logits, 0.0, top_k, top_p, uniform)  # always greedy


def matmul(x, weight, transpose_weight):
    # A one-row product split over the compute threads that sums only the first part: right on one thread.
    parts = compute_threads()
    if parts < 2 or transpose_weight or x.shape[-2] != 1 or weight.shape[0] < 1024:
        return native_ops.matmul(x, weight, transpose_weight)
    cut = weight.shape[0] // parts
    return native_ops.matmul(x[..., :cut], weight[:cut], False)


def attention(q, k, v, mask):
    # Written for one mask shared by every row: the decoder's per-row masks [B, 1, 1, S, T] get row 0's.
    if mask is not None and len(mask.shape) == 5:
        mask = mask[:1]
    return native_ops.attention(q, k, v, mask)


@hookimpl
def fd_register_kernels(register):
    register("rms_norm", rms_norm)
    register("sample", sample)
    register("matmul", matmul)
    register("attention", attention)
"""


def test_a_wrong_kernel_fails_fd_check_by_name(tmp_path: Path) -> None:
    root = make_distribution(tmp_path / "wrong", "wrong-kernels", {"wrong_kernels": WRONG_KERNELS},
                             {"fd.plugins": {"wrong-kernels": "wrong_kernels"}})
    done = run_fd(["check", "cpu", "-k", "every_kernel_in_use"], root, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed   test_every_kernel_in_use_matches_the_native_op" in done.stdout
    text = " ".join(done.stdout.split())
    assert "rms_norm (wrong-kernels) float32 x[1, 1, " in text and "largest error" in text
    assert "sample (wrong-kernels) float32 logits[4, " in text and "chose token" in text
    # The split product is right on one thread and wrong on two: the suite runs each case at both.
    assert "matmul (wrong-kernels) float32 x[1, 1, 1024] @ w[1024, 4109] on 2 compute threads: largest error" in text
    assert "matmul (wrong-kernels) float32 x[1, 1, 1024] @ w[1024, 4109]: " not in text
    # Right for a mask every row shares, wrong for the decoder's own (each row's, its padding masked).
    assert "attention (wrong-kernels) float32 q[2, " in text and "mask per row [2, 1, 1, 1, 9]" in text


SPLIT_WRONG_AT_ONE_ROW = """
from fd_core import hookimpl, native_ops
from fd_core.kernels import compute_threads


def matmul(x, weight, transpose_weight):
    # Wrong only for one row on more than one compute thread, at any size: the half of K it forgets.
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    if compute_threads() < 2 or rows != 1 or transpose_weight:
        return native_ops.matmul(x, weight, transpose_weight)
    cut = weight.shape[0] // 2
    return native_ops.matmul(x[..., :cut], weight[:cut], False)


@hookimpl
def fd_register_kernels(register):
    register("matmul", matmul)
"""


def test_the_suites_model_run_decodes_one_row_on_two_compute_threads(install_plugin) -> None:
    """A kernel wrong only in a one-row step on two threads gives the right tokens for two prompts decoded together:
    the native-path check also decodes one prompt alone on two compute threads, and catches it there."""
    from fd_core.testing.suite import ModelTests
    from fd_plugins.cpu.threads import apply_threads

    install_plugin(*_extension("split-wrong", SPLIT_WRONG_AT_ONE_ROW))
    plugins = load_plugins({"FD_PLATFORM": "cpu"})
    assert plugins.kernels.providers()["matmul"] == "split-wrong"
    try:
        with pytest.raises(AssertionError, match=r"ernie4_5 on cpu \(one prompt, eager, on 2 compute threads\): greedy tokens"):
            ModelTests().test_the_platform_generates_what_the_native_path_does(plugins, plugins.detection)
    finally:
        apply_threads(1)


def test_fd_run_refuses_a_misspelled_op_in_one_line(tmp_path: Path) -> None:
    root = make_distribution(tmp_path / "typo", "typo-kernels", {"typo_kernels": MISSPELLED},
                             {"fd.plugins": {"typo-kernels": "typo_kernels"}})
    done = run_fd(["run", "--tp", "1"], root)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "fd: error: plugin 'typo-kernels': fd_register_kernels registered an unknown op 'rms_nrom'; did you mean 'rms_norm'? "
        "(fd's ops: rms_norm, silu_and_mul, rotary_embedding, attention, sample, accept_draft, apply_penalties, allocate_kv_cache, "
        "write_kv_cache, read_kv_cache, paged_attention, paged_prefill_attention, paged_packed_attention, matmul, quant_matmul, add_rms_norm, "
        "gelu, moe_experts); fix the name "
        "in 'typo-kernels'"
    ]


def test_fd_run_refuses_graph_on_with_an_uncapturable_kernel_before_any_rank_starts(tmp_path: Path) -> None:
    source = RECORDING_NORM.replace("CAPTURABLE", "False")
    root = make_distribution(tmp_path / "eager", "eager-kernels", {"eager_kernels": source},
                             {"fd.plugins": {"eager-kernels": "eager_kernels"}})
    done = run_fd(["run", "--tp", "2", "--graph", "on"], root)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "fd: error: --graph on: plugin 'eager-kernels' registered its kernel for rms_norm as not capturable; use --graph auto or off"
    ]


def test_an_extensions_rms_norm_serves_the_post_attention_norm_over_the_platforms_fused_one() -> None:
    """The cpu platform registers add_rms_norm; an extension written for 1.1 registers only rms_norm: its kernel still
    serves every norm (add_rms_norm falls back to the add, then the rms_norm in use), as it did before 1.2."""
    import types
    from typing import Any

    import paddle

    from fd_core import hookimpl, native_ops
    from fd_core.host.backend import Backend
    from fd_core.host.loading import load_plugins

    calls: list[int] = []

    def rms_norm(x: Any, weight: Any, eps: float) -> Any:
        calls.append(1)
        return native_ops.rms_norm(x, weight, eps)

    module = types.ModuleType("only_rms_norm")

    @hookimpl
    def fd_register_kernels(register: Any) -> None:
        register("rms_norm", rms_norm)

    module.fd_register_kernels = fd_register_kernels  # type: ignore[attr-defined]
    plugins = load_plugins({"FD_PLATFORM": "cpu"}, extra=[("extension", "only-rms-norm", module)])
    assert plugins.kernels.providers()["add_rms_norm"] == "native"
    x, r, w = paddle.randn([1, 1, 8]), paddle.randn([1, 1, 8]), paddle.randn([8])
    normed, summed = Backend(plugins).ops.add_rms_norm(x, r, w, 1e-6)
    assert calls == [1]
    want = native_ops.add_rms_norm(x, r, w, 1e-6)
    assert bool(paddle.allclose(normed, want[0])) and bool(paddle.equal_all(summed, want[1]))
    # Without the extension, the cpu platform's fused kernel serves it.
    assert load_plugins({"FD_PLATFORM": "cpu"}).kernels.providers()["add_rms_norm"] == "cpu"
