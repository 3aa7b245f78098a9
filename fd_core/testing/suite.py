"""The conformance suite: subclass `PlatformSuite` and provide the `platform_name` and `capabilities` fixtures."""

from __future__ import annotations

import os
from typing import Any

import pytest

from fd_core.capabilities import Capabilities
from fd_core.config import ModelConfig, ParallelConfig
from fd_core.detection import Detection
from fd_core.plugins import PluginSet, impl_function, load_plugins, new_plugin_manager, validate_module
from fd_core.testing.kernels import KernelTests

ALL_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
SHAPES: tuple[tuple[int, ...], ...] = ((0,), (1,), (3, 5), (64, 64))
PROBE = "conformance_probe"


# Two-rank runs by (platform, cases, graph): spawned once per session, their failure too, so that one
# broken collective is one spawn and one clear failure, not one re-spawn per dependent check.
_RANK_RUNS: dict[tuple[str, tuple[Any, ...], bool], list[dict[str, Any]] | BaseException] = {}
_REPORTED: set[tuple[str, tuple[Any, ...], bool]] = set()


def _plugins_for(platform: str) -> PluginSet:
    return load_plugins({**os.environ, "FD_PLATFORM": platform})


def _two_rank_results(platform: str, cases: tuple[Any, ...], with_graph: bool) -> list[dict[str, Any]]:
    """Spawn two real ranks once per platform and case list; the results are shared by the checks."""
    key = (platform, cases, with_graph)
    if key not in _RANK_RUNS:
        from fd_core.runtime.distributed import spawn_ranks
        from fd_core.testing.ranks import all_reduce_on_rank

        plugins = _plugins_for(platform)
        try:
            _RANK_RUNS[key] = spawn_ranks(all_reduce_on_rank, (platform, cases, with_graph), 2, plugins.detection.dist_backend)
        except Exception as exc:  # noqa: BLE001 - kept: the dependent checks report it without spawning again
            _RANK_RUNS[key] = exc
    result = _RANK_RUNS[key]
    if isinstance(result, BaseException):
        if key in _REPORTED:  # one failure, reported once; the checks that depend on the run skip
            pytest.skip(f"{platform}: the two-rank run failed (reported by the first check that needed it)")
        _REPORTED.add(key)
        pytest.fail(f"{platform}: the two-rank run failed: {result}", pytrace=False)
    return result


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
        detect = impl_function(platform_module, "fd_platform_detect")
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
            assert impl_function(platform_module, hook) is not None, f"{platform_name}: a platform must implement {hook}"

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
            rtol = capabilities.rtol(dtype)
            assert np.allclose(value, want, rtol=rtol), f"{where} returned a wrong sum: {_head(value)}, expected {_head(want)}"
            if capabilities.in_place or got["same_object"]:
                after = np.asarray(got["input_after"]).reshape(shape)
                assert np.allclose(after, want, rtol=rtol), (
                    f"{where}: the result is declared in place but the input tensor holds {_head(after)}, expected {_head(want)}"
                )

    def test_all_reduce_inside_a_captured_graph(self, two_ranks: list[dict[str, Any]], capabilities: Capabilities, platform_name: str) -> None:
        import numpy as np

        if not capabilities.graphs:
            pytest.skip(f"{platform_name}: capabilities.graphs is False")
        if 2 not in capabilities.graph_world_sizes:
            pytest.skip(f"{platform_name}: capabilities.graph_world_sizes {capabilities.graph_world_sizes}: graphs are not captured at tp=2")
        for run in two_ranks:
            graph = run["graph"]
            if not graph["allowed"]:
                pytest.skip(f"{platform_name} does not capture graphs at tp=2: {graph['summary']}")
            assert graph["replay"] is not None, f"{platform_name}: graph backend has(key) is False right after capture"
            assert np.allclose(graph["replay"], graph["eager"], rtol=1e-5), (
                f"{platform_name}: replaying a captured all-reduce differs from eager on rank {run['rank']}"
            )


class CleanupTests(_Base):
    """fd_clean_memory_fragments takes what the runner passes (None, seeded numpy arrays, paddle tensors, {}), twice."""

    def test_cleanup_takes_every_argument_the_runner_passes(self, plugins: PluginSet, platform_name: str, hardware: Detection) -> None:
        import numpy as np
        import paddle

        from fd_core.backend import Backend

        backend = Backend(plugins)
        arrays = {"w": np.ones((8, 8), dtype=np.float32)}  # seeded weights are staged as numpy
        for state_dict in (None, None, arrays, {"w": paddle.ones([8, 8]), "b": paddle.zeros([8])}, {}):
            backend.clean_memory_fragments(state_dict)  # a raising hook fails here, named

    def test_cleanup_releases_the_state_when_declared(self, plugins: PluginSet, capabilities: Capabilities, platform_name: str, hardware: Detection) -> None:
        import paddle

        from fd_core.backend import Backend

        state = {"w": paddle.ones([64, 64]), "b": paddle.zeros([64])}
        Backend(plugins).clean_memory_fragments(state)
        kept = [name for name, tensor in state.items() if tensor._is_initialized()]
        if capabilities.cleanup_releases_state:
            assert not kept, f"{platform_name}: declares cleanup_releases_state, but fd_clean_memory_fragments left {kept} holding memory"
        else:
            assert set(state) == {"w", "b"}, f"{platform_name}: cleanup without cleanup_releases_state must not change the state dict"


class EligibilityTests(_Base):
    """Every vote is None or a well-formed GraphVote (checked where it is used), for every model and layout."""

    def test_votes_are_well_formed(self, plugins: PluginSet, platform_name: str) -> None:
        from fd_core.backend import Backend

        backend = Backend(plugins)
        configs = [ModelConfig(architecture=PROBE)] + [a.preset_config() for a in plugins.registry]
        for config in configs:
            for tp in (1, 2):
                # A vote of the wrong type, a veto without a reason or a vote that never returns raises here, naming its plugin.
                decision = backend.graph_decision(config, ParallelConfig(tp_size=tp))
                assert all(isinstance(v.allow, bool) and isinstance(v.reason, str) for v in decision.votes)
                assert decision.allowed == (decision.mode is not None and all(v.allow for v in decision.votes))


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
        check_graph_backend(graphs, platform_name)


def check_graph_backend(graphs: Any, name: str) -> None:
    """The graph-backend contract: capture traces, replay equals eager without running Python, clear drops, capture again works."""
    import numpy as np
    import paddle

    weight = paddle.to_tensor(np.linspace(-1, 1, 16, dtype="float32").reshape(4, 4))
    calls = []

    def fn(x: Any) -> Any:
        calls.append(1)
        return paddle.tanh(paddle.matmul(x, weight)) + 1

    graphs.capture(3, fn, [paddle.ones([3, 4])])
    assert graphs.has(3), f"{name}: has(key) is False right after capture(key)"
    assert calls, f"{name}: capture(key, fn, inputs) did not trace fn (it must run it once, as capture does)"
    probe = paddle.to_tensor(np.arange(12, dtype="float32").reshape(3, 4) / 10)
    traced = len(calls)
    replayed = graphs.replay(3, [probe])
    assert len(calls) == traced, f"{name}: replay ran the Python function again instead of the captured graph"
    assert np.allclose(replayed.numpy(), fn(probe).numpy(), rtol=1e-5), f"{name}: replay differs from eager"
    graphs.clear()
    assert not graphs.has(3), f"{name}: has(key) is still True after clear()"
    try:
        graphs.replay(3, [probe])
    except Exception:  # noqa: BLE001 - any refusal will do; replaying a cleared graph must not succeed
        pass
    else:
        raise AssertionError(f"{name}: replay(key) still ran after clear()")
    graphs.capture(3, fn, [paddle.ones([3, 4])])
    assert graphs.has(3), f"{name}: capture after clear() did not capture again"


class ModelTests(_Base):
    """Every graph-capable architecture installed has a graph-clear hook that handles its models."""

    def test_every_graph_capable_architecture_has_a_clear_hook(self, plugins: PluginSet) -> None:
        for arch in plugins.registry:
            if arch.graph_capable:
                owner = plugins.pm.get_plugin(arch.package)
                assert impl_function(owner, "fd_clear_graphs") is not None, f"{arch.name} ({arch.package}) has no fd_clear_graphs"

    def test_clear_hook_really_clears_each_captured_model(self, plugins: PluginSet, capabilities: Capabilities, hardware: Detection) -> None:
        """Through a recording graph backend: after fd_clear_graphs nothing is captured and decode does not replay."""
        from fd_core.backend import Backend
        from fd_core.runtime.engine import Engine
        from fd_core.runtime.lifecycle import ModelRunner
        from fd_core.runtime.plan import model_config_for
        from fd_core.runtime.request import Request

        backend = Backend(plugins)
        if not capabilities.graphs or backend.graph_mode is None:
            pytest.skip("the platform captures no graphs")
        spies: list[_RecordingGraphs] = []
        real = backend.graph_backend

        def recording() -> Any:
            spies.append(_RecordingGraphs(real()))
            return spies[-1]

        backend.graph_backend = recording  # type: ignore[method-assign]
        request = Request.greedy([[1, 2, 3]], 4)
        for arch in plugins.registry:
            # The engine `fd run` generates through: what is checked here is what runs.
            runner = ModelRunner(backend, arch, model_config_for(arch, None))
            runner.load()
            if not runner.decide().allowed:
                continue
            engine = Engine(runner)
            before = engine.generate(request)[0].token_ids
            spy = spies[-1]
            assert spy.replays, f"{arch.name}: decode did not replay its captured graph"
            model = runner.model
            assert model is not None
            backend.clear_graphs(model)  # raises PluginError when no hook handles the model
            assert spy.clears and not any(spy.has(k) for k in spy.keys), f"{arch.name}: fd_clear_graphs returned True but the graphs are still captured"
            replays = spy.replays
            after = engine.generate(request)[0].token_ids
            assert spy.replays == replays, f"{arch.name}: decode still replayed a graph after fd_clear_graphs"
            assert after == before, f"{arch.name}: decoding after fd_clear_graphs gives {after}, with graphs {before}"


    def test_the_engine_generates_what_the_model_computes_without_a_cache(self, plugins: PluginSet, hardware: Detection) -> None:
        """Greedy tokens through the engine `fd run` uses (prefill, cached decode steps, graphs where the decision
        allows them) equal the argmax of a full prefill of the growing sequence: no cache, no decode step, no engine."""
        import numpy as np

        from fd_core.backend import Backend
        from fd_core.runtime.engine import Engine
        from fd_core.runtime.lifecycle import ModelRunner
        from fd_core.runtime.plan import model_config_for
        from fd_core.runtime.request import Request

        backend = Backend(plugins)
        prompt, steps = [1, 2, 3], 4
        for arch in plugins.registry:
            runner = ModelRunner(backend, arch, model_config_for(arch, None))
            runner.load()
            runner.decide()
            got = Engine(runner).generate(Request.greedy([prompt], steps))[0].token_ids
            model = runner.model
            assert model is not None
            assert len(got) == steps, f"{arch.name}: the engine gave {len(got)} tokens for max_new_tokens={steps}"
            model.allocate_cache(1, len(prompt) + steps)
            ids = list(prompt)
            for step, token in enumerate(got):
                logits = np.asarray(model.prefill(np.asarray([ids], dtype="int64")).astype("float32").numpy()[0], dtype=np.float64)
                top2 = np.sort(logits)[-2:]
                # A near-tie may break either way between two correct computations; anything else is a wrong token.
                tie = top2[1] - top2[0] <= 1e-3 * max(1.0, float(np.abs(top2).max()))
                assert token == int(logits.argmax()) or tie, (
                    f"{arch.name} on {backend.platform}: step {step} of the engine chose {token}, but a full prefill of "
                    f"{ids} gives {int(logits.argmax())}; the decode step, the KV cache or a captured graph is wrong"
                )
                ids.append(token)


class _RecordingGraphs:
    """The platform's graph backend, with its calls counted."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.mode = inner, inner.mode
        self.keys: set[Any] = set()
        self.replays = self.clears = 0

    def capture(self, key: Any, fn: Any, inputs: Any) -> None:
        self.keys.add(key)
        self.inner.capture(key, fn, inputs)

    def replay(self, key: Any, inputs: Any) -> Any:
        self.replays += 1
        return self.inner.replay(key, inputs)

    def has(self, key: Any) -> bool:
        return bool(self.inner.has(key))

    def clear(self) -> None:
        self.clears += 1
        self.inner.clear()


class PlatformSuite(ContractTests, AllReduceTests, CleanupTests, EligibilityTests, GraphBackendTests, ModelTests, KernelTests):
    """Every conformance check; subclass it as `TestMyPlatform` and provide `platform_name` and `capabilities`."""

