"""The runner end to end: tp=2 over two real gloo ranks equals tp=1, graphs equal eager, reloads keep the output."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core import ModelConfig, ParallelConfig, hookimpl
from fd_core.backend import load_backend
from fd_core.plugins import load_plugins
from fd_core.runtime.distributed import spawn_ranks
from fd_core.runtime.engine import Engine
from fd_core.runtime.lifecycle import ModelRunner
from fd_core.runtime.plan import model_config_for
from fd_core.runtime.request import Request
from tp_workers import generate, tp_rank

ARCHS = ["ernie4_5", "ernie4_5_vl", "qwen3_vl"]
# float32 sums in a different order across two ranks: agreement to 1e-4 absolute on logits of size ~1.
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return spawn_ranks(tp_rank, (ARCHS,), 2, "gloo")


@pytest.fixture(scope="module")
def tp1() -> dict:
    backend = load_backend(ParallelConfig(tp_size=1))
    return {name: {mode: generate(backend, name, mode) for mode in ("off", "on")} for name in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_logits_and_tokens_equal_tp1(tp1: dict, tp2: list[dict], arch: str) -> None:
    for rank in tp2:
        for mode in ("off", "on"):
            np.testing.assert_allclose(rank[arch][mode]["logits"], tp1[arch]["off"]["logits"], atol=LOGIT_ATOL, rtol=0)
            assert rank[arch][mode]["tokens"] == tp1[arch]["off"]["tokens"]


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_captured_decode_equals_eager(tp1: dict, tp2: list[dict], arch: str) -> None:
    assert tp1[arch]["on"]["graph"] and not tp1[arch]["off"]["graph"]
    assert tp1[arch]["on"]["tokens"] == tp1[arch]["off"]["tokens"]
    assert all(rank[arch]["on"]["graph"] for rank in tp2)


def test_tokens_are_not_degenerate(tp1: dict) -> None:
    # A model whose tokens never change would make every equality above vacuous.
    assert len(set(tp1["ernie4_5"]["off"]["tokens"])) > 2


@pytest.mark.parametrize("arch", ["ernie4_5_vl", "qwen3_vl"])
def test_vl_output_depends_on_the_image(arch: str) -> None:
    backend = load_backend()
    one, other = generate(backend, arch, "off", image_seed=0), generate(backend, arch, "off", image_seed=1)
    assert np.abs(one["logits"] - other["logits"]).max() > 1e-3


class _Order:
    """Records the lifecycle calls the runner makes, in order, through real hooks."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @hookimpl(wrapper=True)
    def fd_clear_graphs(self, model):
        self.calls.append("clear_graphs")
        return (yield)

    @hookimpl
    def fd_clean_memory_fragments(self, state_dict):
        self.calls.append("clean(state)" if state_dict else "clean(None)")


@pytest.mark.parametrize("arch", ARCHS)
def test_reload_clears_graphs_before_releasing_weights_and_keeps_the_output(arch: str) -> None:
    plugins = load_plugins({})
    order = _Order()
    plugins.pm.register(order, name="order-probe")
    backend = load_backend(plugins=plugins)
    spec = plugins.registry.get(arch)
    runner = ModelRunner(backend, spec, model_config_for(spec, None))
    runner.load()
    assert runner.decide().allowed
    engine, request = Engine(runner), Request.greedy([[1, 2, 3]], 5)
    first = engine.generate(request)[0].token_ids
    model = runner.model
    for name in ("release_weights", "load_weights", "capture"):
        original = getattr(model, name)

        def recorded(*args, _name=name, _original=original):
            order.calls.append(_name)
            return _original(*args)

        setattr(model, name, recorded)
    for _ in range(3):
        order.calls.clear()
        runner.reload()
        # The engine captures again on its next batch: the graph state was cleared where it is kept.
        assert engine.generate(request)[0].token_ids == first
        assert order.calls == ["clear_graphs", "release_weights", "clean(None)", "load_weights", "clean(state)", "capture"]


def test_unknown_architecture_lists_the_registered_ones() -> None:
    from fd_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown architecture 'llama'; registered: ernie4_5 \(Ernie4_5ForCausalLM\), ernie4_5_vl \(Ernie4_5_VLMoeForConditionalGeneration\), qwen3_vl \(Qwen3VLForConditionalGeneration\)"):
        load_plugins({}).registry.get("llama")


def test_tp_must_divide_every_sharded_dimension() -> None:
    from fd_core.errors import ConfigError

    config = ModelConfig(architecture="x", num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=512)
    config.check_tensor_parallel(2)
    with pytest.raises(ConfigError, match=r"tp=4 does not divide num_key_value_heads=2 of x; choose a tp that divides each of them"):
        config.check_tensor_parallel(4)
