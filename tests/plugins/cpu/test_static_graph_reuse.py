"""The cpu static-graph backend reuses a model's traced program across captures; reloaded weights must be used."""

from __future__ import annotations

from fd_core.host.backend import load_backend
from fd_core.runtime.engine.loop import Engine
from fd_core.runtime.engine.runner import ModelRunner
from fd_core.runtime.plan import model_config_for
from fd_core.runtime.request import Request

REQUEST = Request.greedy([[5, 6, 7]], 6)


def runner_for(backend, graph: str, seed: int) -> ModelRunner:
    arch = backend.plugins.registry.get("ernie4_5")
    runner = ModelRunner(backend, arch, model_config_for(arch, None), seed=seed, graph=graph)
    runner.load()
    runner.decide()
    return runner


def tokens(runner: ModelRunner) -> list[int]:
    return Engine(runner).generate(REQUEST)[0].token_ids


def test_recapture_after_reloading_other_weights_decodes_with_the_new_weights(monkeypatch) -> None:
    import paddle

    traces = []
    to_static = paddle.jit.to_static
    monkeypatch.setattr(paddle.jit, "to_static", lambda *a, **k: traces.append(a) or to_static(*a, **k))
    backend = load_backend()
    eager = {seed: tokens(runner_for(backend, "off", seed)) for seed in (0, 1)}
    assert eager[0] != eager[1], "the two seeds must give different tokens for this test to mean anything"
    runner = runner_for(backend, "auto", 0)
    assert runner.decision.allowed
    assert tokens(runner) == eager[0]
    for seed in (1, 0, 1):
        runner.seed = seed
        runner.reload()
        assert tokens(runner) == eager[seed], f"after reloading seed {seed}"
    assert len(traces) == 1, "every capture after the first must reuse the one traced program"
