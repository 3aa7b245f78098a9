"""The runner end to end: what the model suite (tests/models/test_model_suite.py) cannot express: a picture's
effect, the order of the lifecycle calls around a reload, registry and tp errors."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core import ModelConfig, hookimpl
from fd_core.host.backend import load_backend
from fd_core.host.loading import load_plugins
from fd_core.runtime.engine.loop import Engine
from fd_core.runtime.engine.runner import ModelRunner
from fd_core.runtime.plan import model_config_for
from fd_core.runtime.request import Request
from tp_workers import generate

ARCHS = ["ernie4_5", "ernie4_5_vl", "qwen3_vl"]


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
        assert order.calls == ["clear_graphs", "release_weights", "clean(None)", "load_weights",
                               "clean(state)", "capture"]


def test_unknown_architecture_lists_the_registered_ones() -> None:
    from fd_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown architecture 'llama'; registered: ernie4_5 \(Ernie4_5ForCausalLM\), ernie4_5_vl \(Ernie4_5_VLMoeForConditionalGeneration\), qwen3_vl \(Qwen3VLForConditionalGeneration\)"):
        load_plugins({}).registry.get("llama")


def test_tp_must_divide_every_sharded_dimension() -> None:
    from fd_core.errors import ConfigError

    config = ModelConfig(architecture="x", num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         vocab_size=512)
    config.check_tensor_parallel(2)
    with pytest.raises(ConfigError, match=r"tp=4 does not divide num_key_value_heads=2 of x; choose a tp that divides each of them"):
        config.check_tensor_parallel(4)


def test_one_graph_backend_serves_every_batch_size_and_a_reload_clears_it() -> None:
    """Decoding 1, then 2, then 1 prompts replays captured graphs for both sizes (one platform graph backend, kept)."""
    backend = load_backend(plugins=load_plugins({}))
    made = []
    real = backend.graph_backend
    backend.graph_backend = lambda: made.append(real()) or made[-1]  # type: ignore[method-assign]
    spec = backend.plugins.registry.get("ernie4_5")
    runner = ModelRunner(backend, spec, model_config_for(spec, None))
    runner.load()
    assert runner.decide().allowed
    engine = Engine(runner)
    one, two = Request.greedy([[1, 2, 3]], 4), Request.greedy([[1, 2, 3], [4, 5]], 4)
    first = engine.generate(one)[0].token_ids
    engine.generate(two)
    assert engine.generate(one)[0].token_ids == first
    # One platform graph backend for every batch size (the model holds it wrapped, each first replay checked).
    assert len(made) == 1 and runner.model.graphs.inner is made[0]
    # Keys (rows, block-table width): 4 blocks of 16 is the narrowest width captured.
    assert made[0].has((1, 4)) and made[0].has((2, 4)), "a batch size's captured graph was lost when another was captured"
    runner.reload()
    assert not made[0].has((1, 4)) and runner.captured == set()
    assert engine.generate(one)[0].token_ids == first and made[0].has((1, 4)) and len(made) == 1
