"""moe_experts' stacked expert weights prepared at load (contract 1.4), through ERNIE-4.5-VL's MoE layer: a kernel that
reads its own layout (gate and up fused and transposed, down transposed) gives the native path's greedy tokens, each
modality's three weights are prepared once per load, their parameters released, captured decode steps replay without
preparing, and a reload of other weights is followed. The oracle is the all-native path on the same seed."""

from __future__ import annotations

from typing import Any

import pytest

from fd_core import native_ops
from fd_core.host.backend import Backend
from fd_core.host.kernel_table import KernelTable, check_kernel
from fd_core.host.loading import load_plugins
from fd_core.runtime.engine.loop import Engine
from fd_core.runtime.engine.runner import ModelRunner
from fd_core.runtime.plan import model_config_for
from fd_core.runtime.request import Request
from fd_models.layers.moe import MoEBlock

REQUEST = Request.greedy([[5, 1, 4, 2, 3], [7, 7, 2]], 6)


class FusedExperts:
    """A kernel in its own layout, and its preparation, which counts its calls."""

    def __init__(self) -> None:
        self.prepared = 0

    def prepare(self, gate: Any, up: Any, down: Any) -> tuple[Any, None, Any]:
        import paddle

        self.prepared += 1
        return (paddle.concat([gate, up], axis=1).transpose([0, 2, 1]).contiguous(), None,
                down.transpose([0, 2, 1]).contiguous())

    def kernel(self, x: Any, gate: Any, up: Any, down: Any, chosen: Any, weights: Any) -> Any:
        assert up is None and gate.shape[1] == x.shape[-1], "called with the weights as they loaded, not prepared"
        fused_gate, fused_up = gate.transpose([0, 2, 1]).chunk(2, axis=1)
        return native_ops.moe_experts(x, fused_gate, fused_up, down.transpose([0, 2, 1]), chosen, weights)


def tokens(runner: ModelRunner) -> list[list[int]]:
    return [c.token_ids for c in Engine(runner).generate(REQUEST)]


def test_prepared_expert_weights_give_the_native_tokens_replay_unprepared_and_follow_a_reload() -> None:
    plugins = load_plugins()
    fused = FusedExperts()
    table = KernelTable()
    table.add(check_kernel("fused-moe", "moe_experts", fused.kernel, True, fused.prepare), from_platform=False)
    backend, native = Backend(plugins, kernels=table), Backend(plugins, kernels=KernelTable())
    arch = plugins.registry.get("ernie4_5_vl")
    config = model_config_for(arch, None)
    runner = ModelRunner(backend, arch, config, graph="on")
    runner.load()
    runner.decide()
    assert runner.graphs_allowed
    assert runner.model is not None
    blocks = [layer for layer in runner.model.sublayers() if isinstance(layer, MoEBlock)]
    assert blocks
    assert fused.prepared == 2 * len(blocks)  # text and vision experts, once each
    for block in blocks:
        for kind in ("text", "vision"):
            assert not getattr(block, f"{kind}_gate")._is_initialized()  # released: the kernel reads the prepared
            assert getattr(block, f"{kind}_gate_prepared_0")._is_initialized()
            assert getattr(block, f"{kind}_up_prepared_0", None) is None  # folded into gate's

    def reference(seed: int) -> list[list[int]]:
        plain = ModelRunner(native, arch, config, seed=seed, graph="off")
        plain.load()
        plain.decide()
        return tokens(plain)

    first = tokens(runner)
    assert first == reference(0)
    assert runner.captured, "no decode step was captured: replays went unchecked"
    loaded = fused.prepared
    assert tokens(runner) == first and fused.prepared == loaded  # replays run no preparation
    runner.seed = 1
    runner.reload()
    assert fused.prepared == loaded + 2 * len(blocks)
    again = reference(1)
    assert again != first, "seed 1 gives seed 0's tokens: the reload would go unchecked"
    assert tokens(runner) == again


def test_a_prepare_for_moe_takes_the_weights_only() -> None:
    from fd_core.errors import PluginError

    with pytest.raises(PluginError, match=r"called as prepare\(gate, up, down\) \(the op's weights\)"):
        check_kernel("fused-moe", "moe_experts", native_ops.moe_experts, True,
                     lambda gate, up, down, chosen, weights: (gate, up, down))
