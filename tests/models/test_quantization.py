"""Weight-only quantization: fd's quantized form against values computed with numpy, the preparation of weights once
per load (never in a decode step or a replay), the memory a quantized model holds, the quality check failing a broken
quantizer, and `--quantization` at tp=2 against transformers' float32 reference."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import paddle
import pytest

from fd_core.host.loading import load_plugins
from fd_core.quantization import dequantize, head_bits, quantize, quantized_bytes
from fd_core.testing import ModelSuite

ARCHS = ["ernie4_5", "ernie4_5_vl", "qwen3_vl"]


def _numpy_quantized(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per output row (of [N, K]), symmetric: the oracle for fd_core.quantization, written from its docstring."""
    level = 127 if bits == 8 else 7
    peak = np.abs(w).max(axis=1)
    scales = np.where(peak > 0, peak / level, 1.0).astype(np.float32)
    values = np.clip(np.round(w / scales[:, None]), -level, level).astype(np.int8)
    if bits == 4:
        if values.shape[1] % 2:
            values = np.concatenate([values, np.zeros((values.shape[0], 1), np.int8)], axis=1)
        low, high = values[:, 0::2].astype(np.uint8) & 0xF, values[:, 1::2].astype(np.uint8) & 0xF
        values = (low | (high << 4)).view(np.int8)
    return values, scales


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape, transpose", [((6, 10), True), ((7, 13), True), ((9, 5), False)])
def test_quantize_gives_the_documented_form(bits: int, shape: tuple[int, int], transpose: bool) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32)
    w[0] = 0.0  # an all-zero channel: scale 1, values 0
    values, scales = quantize(paddle.to_tensor(w), bits, transpose_weight=transpose)
    rows = w if transpose else w.T
    want_values, want_scales = _numpy_quantized(rows, bits)
    np.testing.assert_array_equal(values.numpy(), want_values)
    np.testing.assert_allclose(scales.numpy(), want_scales, rtol=1e-6)
    # The weight it stands for is within half a level of the original, channel by channel.
    back = dequantize(values, scales, bits, rows.shape[1]).numpy()
    assert np.all(np.abs(back - rows) <= want_scales[:, None] / 2 + 1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_in_groups_gives_the_documented_form(bits: int) -> None:
    """Contract 1.6: each group of G columns quantized as its own row would be (the per-row oracle on [N * K / G, G]);
    a K that G does not divide is quantized per output channel."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((5, 96)).astype(np.float32)
    w[1, 24:48] = 0.0  # an all-zero group: scale 1, values 0
    values, scales = quantize(paddle.to_tensor(w), bits, group=24)
    level = 127 if bits == 8 else 7
    peak = np.abs(w.reshape(5, 4, 24)).max(axis=2)
    want_scales = np.where(peak > 0, peak / level, 1.0)
    np.testing.assert_allclose(scales.numpy(), want_scales, rtol=1e-6)
    levels = np.clip(np.round(w.reshape(5, 4, 24) / want_scales[:, :, None]), -level, level).reshape(5, 96)
    want_values = levels.astype(np.int8)
    if bits == 4:  # two a byte, the even column in the low four bits
        low, high = want_values[:, 0::2].view(np.uint8) & 0xF, want_values[:, 1::2].view(np.uint8) & 0xF
        want_values = (low | (high << 4)).view(np.int8)
    np.testing.assert_array_equal(values.numpy(), want_values)
    back = dequantize(values, scales, bits, 96).numpy()
    assert np.all(np.abs(back - w) <= np.repeat(want_scales, 24, axis=1) / 2 + 1e-6)
    _, channel_scales = quantize(paddle.to_tensor(w[:, :90]), bits, group=24)
    assert list(channel_scales.shape) == [5]


@pytest.mark.parametrize("transpose", [True, False])
def test_a_weight_quantized_a_block_of_rows_at_a_time_is_quantized_as_whole(
    monkeypatch: pytest.MonkeyPatch, transpose: bool
) -> None:
    """quantize() takes a large weight (an LM head) in blocks of rows, so that its float temporaries stay small: the
    blocks' form is the whole weight's."""
    import fd_core.quantization as quantization

    w = paddle.to_tensor(np.random.default_rng(5).standard_normal((37, 64)).astype(np.float32))
    whole = [quantize(w, bits, transpose, group) for bits in (8, 4) for group in (0, 16)]
    monkeypatch.setattr(quantization, "QUANTIZE_ELEMENTS", 5 * 64)
    blocks = [quantize(w, bits, transpose, group) for bits in (8, 4) for group in (0, 16)]
    for (values, scales), (want_values, want_scales) in zip(blocks, whole, strict=True):
        np.testing.assert_array_equal(values.numpy(), want_values.numpy())
        np.testing.assert_array_equal(scales.numpy(), want_scales.numpy())


def test_a_quant_kernel_written_before_groups_is_given_per_channel_weights(recwarn: pytest.WarningsRecorder) -> None:
    """The deprecation of contract 1.6: a quant_matmul kernel of a plugin written for 1.5 knows per-channel scales only,
    so it is given those (one DeprecationWarning naming the plugin); one written for 1.6 gets the groups."""
    from fd_core import native_ops
    from fd_core.host.kernel_table import Kernel, KernelTable, Ops

    def ops(contract: str) -> Ops:
        table = KernelTable()
        table.add(Kernel("quant_matmul", native_ops.quant_matmul, "oldchip" if contract == "1.5" else "newchip",
                         contract=contract), from_platform=True)
        return Ops(table, native_ops)

    old, new = ops("1.5"), ops("1.6")
    assert new.quant_group(32) == 32 and old.quant_group(0) == 0
    assert old.quant_group(32) == 0
    assert Ops(KernelTable(), native_ops).quant_group(32) == 32  # the native op takes groups
    messages = [str(w.message) for w in recwarn if issubclass(w.category, DeprecationWarning)]
    assert any("'oldchip'" in m and "per-channel" in m for m in messages), messages


def test_the_native_quant_matmul_is_the_product_with_the_dequantized_weight() -> None:
    from fd_core.native_ops import quant_matmul

    rng = np.random.default_rng(2)
    w, x = rng.standard_normal((11, 7)).astype(np.float32), rng.standard_normal((3, 7)).astype(np.float32)
    for bits in (8, 4):
        values, scales = _numpy_quantized(w, bits)
        level_values = values.astype(np.float32) if bits == 8 else _numpy_unpacked(values, 7)
        want = x @ (level_values * scales[:, None]).T
        got = quant_matmul(paddle.to_tensor(x), paddle.to_tensor(values), paddle.to_tensor(scales), bits)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def _numpy_unpacked(packed: np.ndarray, columns: int) -> np.ndarray:
    raw = packed.view(np.uint8)
    low, high = (raw & 0xF).astype(np.int16), (raw >> 4).astype(np.int16)
    low, high = np.where(low > 7, low - 16, low), np.where(high > 7, high - 16, high)
    return np.stack([low, high], axis=-1).reshape(packed.shape[0], -1)[:, :columns].astype(np.float32)


def _counting_backend(calls: list[str]) -> Any:
    """The cpu platform with matmul and quant_matmul replaced by native kernels whose preparation is counted."""
    from fd_core import native_ops
    from fd_core.host.backend import Backend
    from fd_core.host.kernel_table import Kernel, KernelTable

    def prepare_matmul(weight: Any, transpose_weight: bool) -> Any:
        calls.append("matmul")
        return weight.clone()

    def prepare_quant(weight: Any, scales: Any, bits: int) -> tuple[Any, Any]:
        calls.append("quant_matmul")
        return weight.clone(), scales.clone()

    table = KernelTable()
    table.add(Kernel("matmul", native_ops.matmul, "counting", True, prepare_matmul), from_platform=False)
    table.add(Kernel("quant_matmul", native_ops.quant_matmul, "counting", True, prepare_quant), from_platform=False)
    return Backend(load_plugins({}), kernels=table)


@pytest.mark.parametrize("quantization", [None, "wint8"])
def test_weights_are_prepared_once_per_load_and_never_in_a_step_or_a_replay(quantization: str | None) -> None:
    """Each linear weight's preparation runs once when it loads and once after a reload; captured decode steps and
    their replays run none. The parameter a prepared weight came from holds no storage; the tokens are those of the
    native kernels with nothing prepared."""
    from fd_core.host.backend import Backend
    from fd_core.host.kernel_table import KernelTable
    from fd_core.runtime.engine.loop import Engine
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for
    from fd_core.runtime.request import Request

    calls: list[str] = []
    backend = _counting_backend(calls)
    arch = backend.plugins.registry.get("ernie4_5")
    config = model_config_for(arch, None).with_overrides(quantization=quantization)
    runner = ModelRunner(backend, arch, config, graph="on")
    runner.load()
    runner.decide()
    assert runner.decision is not None and runner.decision.allowed
    # qkv, o, gate_up and down of each layer, and the LM head (each quantized when asked).
    linear = 4 * config.num_hidden_layers
    # The LM head is quantized with the linear layers (its table tied: the embedding looks tokens up in that form).
    once = Counter({"quant_matmul": linear + 1} if quantization else {"matmul": linear + 1})
    assert Counter(calls) == once
    request = Request.greedy([[5, 1, 4, 2, 3], [7, 7, 2]], 8)
    got = [c.token_ids for c in Engine(runner).generate(request)]
    assert runner.captured and Counter(calls) == once  # prefilled, captured and replayed: nothing prepared again
    model = runner.model
    assert model is not None
    attention = model.model.layers[0].self_attn
    assert not attention.qkv._is_initialized() and attention.qkv_prepared_0._is_initialized()
    # The tied head's table: the embedding reads it too, float, or in the head's quantized form (the float released).
    embedding = model.model.embed_tokens
    assert embedding.weight._is_initialized() == (quantization is None)
    assert (embedding.quantized is None) == (quantization is None)
    runner.seed = 1  # other weights, reloaded into the same model
    runner.reload()
    assert Counter(calls) == once + once
    again = [c.token_ids for c in Engine(runner).generate(request)]
    want = []
    for seed in (0, 1):
        plain = ModelRunner(Backend(backend.plugins, kernels=KernelTable()), arch, config, seed=seed, graph="off")
        plain.load()
        plain.decide()
        want.append([c.token_ids for c in Engine(plain).generate(request)])
    assert [got, again] == want and want[0] != want[1]


def test_a_quantized_model_holds_a_quarter_of_its_linear_weights_bytes() -> None:
    """wint8 against float32 on the ernie4_5 preset: the weights' bytes as held (values and scales), the parameters they
    came from released; the memory plan counts the same bytes. By default the tied LM head is quantized too and the
    embedding looks tokens up in its quantized table (its float table released); --float-embeddings keeps both float."""
    from fd_core.host.backend import Backend
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for

    backend = Backend(load_plugins({}))
    arch = backend.plugins.registry.get("ernie4_5")
    held = {}
    for scheme, float_embeddings in ((None, False), ("wint8", True), ("wint4", True), ("wint8", False),
                                     ("wint4", False)):
        config = model_config_for(arch, None).with_overrides(quantization=scheme, float_embeddings=float_embeddings)
        runner = ModelRunner(backend, arch, config, graph="off")
        runner.load()
        model = runner.model
        assert model is not None
        # Each storage once (a tied table's quantized form may be both the embedding's and the head's).
        tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t._is_initialized()}
        held[scheme, float_embeddings] = sum(t.numel().item() * t.element_size() for t in tensors.values())
        planned = config.weight_bytes_per_rank(1)
        # The plan counts a quantized tied table twice (the embedding's form and the head's, which a platform may
        # repack); where the kernel takes fd's form as it is, the two are one storage.
        spare = 0 if scheme is None or float_embeddings else quantized_bytes(
            config.vocab_size, config.hidden_size, head_bits(scheme))
        assert planned - spare - 0.05 * planned <= held[scheme, float_embeddings] <= 1.05 * planned, (
            scheme, float_embeddings, held, planned)
    float_config = model_config_for(arch, None)
    embeddings = float_config.vocab_size * float_config.hidden_size * 4
    float32 = held[None, False]
    linear32 = float32 - embeddings
    # A byte a value plus a float32 scale per output row; half a byte at 4 bits.
    assert held["wint8", True] - embeddings < 0.3 * linear32
    assert held["wint4", True] - embeddings < 0.18 * linear32
    # (At wint4 the cpu kernel repacks a tiny table: the head's copy and the embedding's are two storages.)
    assert held["wint8", False] < 0.3 * float32 and held["wint4", False] < 0.2 * float32


def test_a_tied_embedding_looks_tokens_up_in_the_heads_quantized_table() -> None:
    """Under --quantization the tied table is quantized once, by the LM head's product: the embedding of token t is
    row t of that form dequantized (fd_core.quantization.dequantize), and the float table holds no storage."""
    from fd_core.host.backend import Backend
    from fd_core.quantization import dequantize
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for

    backend = Backend(load_plugins({}))
    arch = backend.plugins.registry.get("ernie4_5")
    float_runner = ModelRunner(backend, arch, model_config_for(arch, None), graph="off")
    float_runner.load()
    assert float_runner.model is not None
    table = float_runner.model.model.embed_tokens.weight.numpy()  # [hidden, vocab]: the float weights, seed 0
    # The head, so the table, is quantized to 8 bits under wint4 too (fd_core.quantization.HEAD_BITS).
    for bits, scheme in ((8, "wint8"), (8, "wint4")):
        config = model_config_for(arch, None).with_overrides(quantization=scheme, quantization_group=32)
        runner = ModelRunner(backend, arch, config, graph="off")
        runner.load()
        assert runner.model is not None
        embedding = runner.model.model.embed_tokens
        assert embedding.quantized is not None and not embedding.weight._is_initialized()
        values, scales = quantize(paddle.to_tensor(table), bits, transpose_weight=False, group=32)
        ids = paddle.to_tensor([[3, 0, 511], [7, 7, 42]])
        want = dequantize(values, scales, bits, table.shape[0]).numpy()[ids.numpy()]
        np.testing.assert_array_equal(embedding(ids).numpy(), want)
        # Within half a step of its group of the float table (a group's step is its scale).
        step = np.repeat(scales.numpy()[ids.numpy()], 32, axis=-1)
        assert (np.abs(want - table.T[ids.numpy()]) <= step / 2 * (1 + 1e-5)).all()


def test_the_quality_check_fails_a_quantizer_whose_scales_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's check (fd check --model) against transformers' float32 logits: right with fd's quantizer, failed
    with scales off by 2x and with scales taken along the input axis."""
    import fd_models.layers.products as products

    suite = ModelSuite()
    plugins = load_plugins({})
    arch = plugins.registry.get("ernie4_5")
    figures: dict[str, str] = {}
    suite.test_quantized_logits_stay_near_the_reference(plugins, arch, 0, "wint8", figures.__setitem__)
    assert figures["figures"].startswith("wint8: logits cosine min 0.99")

    def doubled(weight: Any, bits: int, transpose_weight: bool = True, group: int = 0) -> tuple[Any, Any]:
        values, scales = quantize(weight, bits, transpose_weight)
        return values, scales * 2

    def inputs_axis(weight: Any, bits: int, transpose_weight: bool = True, group: int = 0) -> tuple[Any, Any]:
        values, _ = quantize(weight, bits, transpose_weight)
        w = weight.astype("float32") if transpose_weight else weight.astype("float32").transpose([1, 0])
        peak = paddle.max(paddle.abs(w), axis=0)  # over the outputs: one per input column
        rows = w.shape[0]
        repeated = paddle.concat([peak] * (rows // peak.shape[0] + 1))[:rows]
        return values, repeated / 127

    for broken in (doubled, inputs_axis):
        monkeypatch.setattr(products, "quantize", broken)
        with pytest.raises(AssertionError, match="ernie4_5 under --quantization wint8: wint8: logits cosine min"):
            suite.test_quantized_logits_stay_near_the_reference(plugins, arch, 0, "wint8", figures.__setitem__)


@pytest.mark.parametrize("architecture", ARCHS)
def test_tp2_quantized_next_tokens_agree_with_the_reference(architecture: str) -> None:
    """`LLM(tp=2, quantization="wint8")` (two gloo ranks, each quantizing its own shards) on the transformers-saved
    reference: the next token after each prefix of the reference's greedy sequence agrees with the reference's as
    often as the suite's wint8 bound asks, and so does tp=1's."""
    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.llm import LLM
    from fd_core.testing.model_suite import QUALITY_BOUNDS, QUALITY_STEPS

    plugins = load_plugins({})
    arch = plugins.registry.get(architecture)
    reference = ModelSuite().reference_case(arch, 0)
    prompt, tokens = reference["prompt"], reference["tokens"][:QUALITY_STEPS]
    prefixes = [[*prompt, *tokens[:i]] for i in range(QUALITY_STEPS)]
    shares = {}
    for tp in (1, 2):
        with LLM(str(reference["directory"]), tp=tp, quantization="wint8", max_batch=8) as llm:
            done = llm.generate(prefixes, SamplingParams(max_new_tokens=1, temperature=0.0))
        shares[tp] = sum(c.token_ids[0] == t for c, t in zip(done, tokens, strict=True)) / QUALITY_STEPS
    least = QUALITY_BOUNDS["wint8"][2]
    assert min(shares.values()) >= least, (architecture, shares)


def test_an_unknown_quantization_is_refused_in_one_line_before_any_rank_starts() -> None:
    from fd_core.errors import ConfigError
    from fd_core.runtime.llm import LLM

    with pytest.raises(ConfigError) as err:
        LLM(quantization="int8")
    assert str(err.value) == "LLM(quantization='int8') is not a quantization fd has; choose one of wint8, wint4 (or none)"


def test_fd_run_and_explain_say_the_linear_layers_are_quantized() -> None:
    import json

    from fakedist import run_fd

    done = run_fd(["run", "--tp", "1", "--steps", "4", "--quantization", "wint4", "--json"])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["quantization"] == "wint4" and report["kernels"]["quant_matmul"] == "cpu"
    explained = run_fd(["explain", "--tp", "1", "--quantization", "wint8"])
    assert "dtype: float32; linear layers and LM head wint8 in groups of 128 (quant_matmul" in explained.stdout
    explained = run_fd(["explain", "--tp", "1", "--quantization", "wint4"])
    assert "dtype: float32; linear layers wint4, LM head wint8, in groups of 32 (quant_matmul" in explained.stdout
    explained = run_fd(["explain", "--tp", "1", "--quantization", "wint4", "--float-embeddings"])
    assert "dtype: float32; linear layers wint4 in groups of 32 (quant_matmul" in explained.stdout
    refused = run_fd(["run", "--quantization", "int8"])
    assert refused.returncode == 2 and "--quantization: invalid choice: 'int8'" in refused.stderr
