"""The conformance suite: subclass `PlatformSuite` and provide the `platform_name` and `capabilities` fixtures."""

from __future__ import annotations

import os
from typing import Any

import pytest

from fd_core.capabilities import Capabilities
from fd_core.config import ModelConfig, ParallelConfig
from fd_core.detection import Detection
from fd_core.plugins import PluginSet, _impl_function, load_plugins, new_plugin_manager, validate_module

ALL_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
SHAPES: tuple[tuple[int, ...], ...] = ((0,), (1,), (3, 5), (64, 64))
PROBE = "conformance_probe"


_RANK_RUNS: dict[tuple[str, tuple[Any, ...], bool], list[dict[str, Any]]] = {}


def _plugins_for(platform: str) -> PluginSet:
    return load_plugins({**os.environ, "FD_PLATFORM": platform})


def _two_rank_results(platform: str, cases: tuple[Any, ...], with_graph: bool) -> list[dict[str, Any]]:
    """Spawn two real ranks once per platform and case list; the results are shared by the checks."""
    key = (platform, cases, with_graph)
    if key not in _RANK_RUNS:
        from fd_core.distributed import spawn_ranks
        from fd_core.testing.ranks import all_reduce_on_rank

        plugins = _plugins_for(platform)
        _RANK_RUNS[key] = spawn_ranks(all_reduce_on_rank, (platform, cases, with_graph), 2, plugins.detection.dist_backend)
    return _RANK_RUNS[key]


def _head(array: Any) -> str:
    """The first few values of an array, for a one-line failure message."""
    flat = list(array.reshape(-1)[:4])
    return "[" + ", ".join(f"{v:g}" for v in flat) + (", ...]" if array.size > 4 else "]")


class _Base:
    @pytest.fixture
    def platform_name(self) -> str:
        """The entry-point name of the platform under test (as FD_PLATFORM takes it)."""
        raise NotImplementedError("provide a `platform_name` fixture returning your platform's entry-point name")

    @pytest.fixture
    def capabilities(self) -> Capabilities:
        """A Capabilities instance stating what the platform supports; unsupported checks skip."""
        return Capabilities()

    @pytest.fixture
    def plugins(self, platform_name: str) -> PluginSet:
        """The installed plugins with the platform under test selected."""
        return _plugins_for(platform_name)

    @pytest.fixture
    def platform_module(self, plugins: PluginSet, platform_name: str) -> Any:
        return plugins.record(platform_name).module

    @pytest.fixture
    def hardware(self, plugins: PluginSet, platform_name: str) -> Detection:
        """The platform's detection; checks that run on the device skip when it is not here."""
        detection = plugins.detection
        if not detection.detected:
            pytest.skip(f"{platform_name}: hardware not detected here ({detection.reason}); runs on the device only")
        return detection


class ContractTests(_Base):
    """Detection and the shape of the hook implementations."""

    def test_detection_is_well_formed(self, platform_module: Any, platform_name: str) -> None:
        detect = _impl_function(platform_module, "fd_platform_detect")
        assert detect is not None, f"{platform_name}: implement fd_platform_detect()"
        answer = detect()
        assert isinstance(answer, Detection), f"{platform_name}: fd_platform_detect must return fd_core.Detection, got {type(answer).__name__}"
        assert isinstance(answer.priority, int), f"{platform_name}: Detection.priority must be an int"
        assert answer.reason.strip(), f"{platform_name}: Detection.reason must say what was (or was not) seen"
        if answer.detected:
            assert answer.dist_backend, f"{platform_name}: a detected platform's Detection.dist_backend must name its paddle.distributed backend"

    def test_hooks_match_the_specs(self, platform_module: Any, platform_name: str) -> None:
        validate_module(platform_name, platform_module)
        pm = new_plugin_manager()
        pm.register(platform_module, name=platform_name)
        pm.check_pending()
        for hook in ("fd_platform_detect", "fd_all_reduce"):
            assert _impl_function(platform_module, hook) is not None, f"{platform_name}: a platform must implement {hook}"

    def test_selected_by_fd_platform(self, plugins: PluginSet, platform_name: str) -> None:
        assert plugins.platform == platform_name
        assert plugins.record(platform_name).active


class AllReduceTests(_Base):
    """fd_all_reduce sums over the group and returns the result, at world size 1 and 2."""

    def test_one_rank_returns_the_input_untouched(self, plugins: PluginSet) -> None:
        from fd_core.backend import Backend

        backend = Backend(plugins, ParallelConfig(tp_size=1))
        marker = object()
        assert backend.all_reduce(marker) is marker, "with one rank the Backend's all-reduce must be the identity"

    @pytest.fixture
    def two_ranks(self, platform_name: str, capabilities: Capabilities, hardware: Detection) -> list[dict[str, Any]]:
        if 2 not in capabilities.world_sizes:
            pytest.skip(f"{platform_name}: capabilities.world_sizes {capabilities.world_sizes} has no 2")
        cases = tuple((shape, dtype) for dtype in ALL_DTYPES if dtype in capabilities.dtypes for shape in SHAPES)
        return _two_rank_results(platform_name, cases, capabilities.graphs)

    @pytest.mark.parametrize("dtype", ALL_DTYPES)
    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
    def test_two_ranks_sum(self, two_ranks: list[dict[str, Any]], capabilities: Capabilities, platform_name: str, shape: tuple[int, ...], dtype: str) -> None:
        import numpy as np

        from fd_core.testing.ranks import expected_sum

        if dtype not in capabilities.dtypes:
            pytest.skip(f"{platform_name}: {dtype} not declared in capabilities.dtypes")
        cases = [(s, d) for d in ALL_DTYPES if d in capabilities.dtypes for s in SHAPES]
        index = cases.index((shape, dtype))
        want = expected_sum(shape, dtype, 2)
        for run in two_ranks:
            got = run["results"][index]
            where = f"{platform_name}: all-reduce of {dtype}{list(shape)} on rank {run['rank']}"
            assert "error" not in got, f"{where} failed: {got.get('error')}"
            assert got["shape"] == list(shape), f"{where} returned shape {got['shape']}, expected {list(shape)}"
            assert got["dtype"] == dtype, f"{where} returned dtype {got['dtype']}, expected {dtype}"
            value = np.asarray(got["value"]).reshape(shape)
            rtol = 1e-2 if dtype in ("float16", "bfloat16") else 1e-6
            assert np.allclose(value, want, rtol=rtol), f"{where} returned a wrong sum: {_head(value)}, expected {_head(want)}"
            if capabilities.in_place or got["same_object"]:
                after = np.asarray(got["input_after"]).reshape(shape)
                assert np.allclose(after, want, rtol=rtol), f"{where}: the result is declared in place but the input tensor holds {_head(after)}, expected {_head(want)}"

    def test_all_reduce_inside_a_captured_graph(self, two_ranks: list[dict[str, Any]], capabilities: Capabilities, platform_name: str) -> None:
        import numpy as np

        if not capabilities.graphs:
            pytest.skip(f"{platform_name}: capabilities.graphs is False")
        for run in two_ranks:
            graph = run["graph"]
            if not graph["allowed"]:
                pytest.skip(f"{platform_name} does not capture graphs at tp=2: {graph['summary']}")
            assert graph["replay"] is not None, f"{platform_name}: graph backend has(key) is False right after capture"
            assert np.allclose(graph["replay"], graph["eager"], rtol=1e-5), f"{platform_name}: replaying a captured all-reduce differs from eager on rank {run['rank']}"


class CleanupTests(_Base):
    """fd_clean_memory_fragments is safe with and without a state dict, and idempotent."""

    def test_cleanup_is_idempotent(self, plugins: PluginSet, hardware: Detection) -> None:
        import paddle

        state = {"w": paddle.ones([8, 8]), "b": paddle.zeros([8])}
        for state_dict in (None, None, state, state, {}):
            plugins.pm.hook.fd_clean_memory_fragments(state_dict=state_dict)


class EligibilityTests(_Base):
    """Every vote is None or a GraphVote, and a veto carries its reason."""

    def test_votes_are_well_formed(self, plugins: PluginSet, platform_name: str) -> None:
        from fd_core.backend import Backend

        backend = Backend(plugins)
        configs = [ModelConfig(architecture=PROBE)] + [a.preset_config() for a in plugins.registry]
        for config in configs:
            for tp in (1, 2):
                decision = backend.graph_decision(config, ParallelConfig(tp_size=tp))
                for vote in decision.vetoes:
                    assert vote.reason.strip(), f"{vote.plugin} vetoed {config.architecture} at tp={tp} without a reason"
                if not decision.allowed:
                    assert decision.summary().strip()


class GraphBackendTests(_Base):
    """The graph backend replays what eager computes, and clear makes the next call capture again."""

    @pytest.fixture
    def graphs(self, plugins: PluginSet, capabilities: Capabilities, platform_name: str, hardware: Detection) -> Any:
        if not capabilities.graphs:
            pytest.skip(f"{platform_name}: capabilities.graphs is False")
        from fd_core.backend import Backend

        return Backend(plugins).graph_backend()

    def test_has_a_mode_and_the_methods(self, graphs: Any, platform_name: str) -> None:
        assert isinstance(graphs.mode, str) and graphs.mode, f"{platform_name}: the graph backend must name its mode"
        for method in ("capture", "replay", "has", "clear"):
            assert callable(getattr(graphs, method, None)), f"{platform_name}: the graph backend lacks {method}()"

    def test_replay_equals_eager_and_clear_recaptures(self, graphs: Any, platform_name: str) -> None:
        import numpy as np
        import paddle

        weight = paddle.to_tensor(np.linspace(-1, 1, 16, dtype="float32").reshape(4, 4))
        calls = []

        def fn(x: Any) -> Any:
            calls.append(1)
            return paddle.tanh(paddle.matmul(x, weight)) + 1

        graphs.capture(3, fn, [paddle.ones([3, 4])])
        assert graphs.has(3), f"{platform_name}: has(key) is False right after capture(key)"
        probe = paddle.to_tensor(np.arange(12, dtype="float32").reshape(3, 4) / 10)
        traced = len(calls)
        replayed = graphs.replay(3, [probe])
        assert np.allclose(replayed.numpy(), fn(probe).numpy(), rtol=1e-5), f"{platform_name}: replay differs from eager"
        assert len(calls) == traced + 1, f"{platform_name}: replay ran the Python function again instead of the captured graph"
        graphs.clear()
        assert not graphs.has(3), f"{platform_name}: has(key) is still True after clear()"
        graphs.capture(3, fn, [paddle.ones([3, 4])])
        assert graphs.has(3), f"{platform_name}: capture after clear() did not capture again"


class ModelTests(_Base):
    """Every graph-capable architecture installed has a graph-clear hook that handles its models."""

    def test_every_graph_capable_architecture_has_a_clear_hook(self, plugins: PluginSet) -> None:
        for arch in plugins.registry:
            if arch.graph_capable:
                owner = plugins.pm.get_plugin(arch.package)
                assert _impl_function(owner, "fd_clear_graphs") is not None, f"{arch.name} ({arch.package}) has no fd_clear_graphs"

    def test_clear_hook_handles_each_captured_model(self, plugins: PluginSet, capabilities: Capabilities, hardware: Detection) -> None:
        from fd_core.backend import Backend
        from fd_core.runner import ModelRunner, model_config_for

        backend = Backend(plugins)
        for arch in plugins.registry:
            runner = ModelRunner(backend, arch, model_config_for(arch, None))
            runner.load()
            runner.decide()
            runner.prepare(max_len=24)
            before = runner.generate([1, 2, 3], steps=4).tokens
            model = runner.model
            assert model is not None
            backend.clear_graphs(model)  # raises PluginError when no hook handles the model
            model.allocate_cache(1, 24)
            after = runner.generate([1, 2, 3], steps=4).tokens
            assert after == before, f"{arch.name}: decoding after fd_clear_graphs gives {after}, with graphs {before}"


class PlatformSuite(ContractTests, AllReduceTests, CleanupTests, EligibilityTests, GraphBackendTests, ModelTests):
    """Every conformance check; subclass it as `TestMyPlatform` and provide `platform_name` and `capabilities`."""

