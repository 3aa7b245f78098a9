"""The conformance suite: subclass `PlatformSuite` and provide the `platform_name` and `capabilities` fixtures."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest

from fd_core.capabilities import Capabilities
from fd_core.config import ModelConfig, ParallelConfig
from fd_core.detection import Detection
from fd_core.error_lines import error_line
from fd_core.host.loading import PluginSet, load_plugins, new_plugin_manager
from fd_core.host.records import impl_function
from fd_core.host.validation import validate_module
from fd_core.lifecycle import RankContext
from fd_core.models import Architecture
from fd_core.testing.kernels import KernelTests

ALL_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
SHAPES: tuple[tuple[int, ...], ...] = ((0,), (1,), (3, 5), (64, 64))
PROBE = "conformance_probe"
# How long a two-rank run may go without progress before it is stopped (seconds).
STALL_ENV = "FD_CHECK_STALL_S"
_MiB = 1 << 20


def _label(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _all_reduce_catalogue() -> list[tuple[str, tuple[int, ...], str, str, int]]:
    """Every all-reduce case: (id, shape, dtype, layout, calls in a row).

    The shapes are what the registered architectures reduce (3-D activations [batch, tokens, hidden]
    at decode and prefill, float32 logits [batch, vocab]) at the tiny presets (hidden 64, vocab 512)
    and at the published 0.3B size (hidden 1024, vocab 103424); non-contiguous views; sizes on both
    sides of 1 MiB (a common fast-path limit) and up to 32 MiB; one shape
    reduced several times in a row with fresh values; hundreds of calls in sequence.
    """
    cases: list[tuple[str, tuple[int, ...], str, str, int]] = []
    for dtype in ALL_DTYPES:
        cases += [(f"{_label(s)}-{dtype}", s, dtype, "contiguous", 1) for s in SHAPES]
        cases += [
            (f"decode-2x1x64-{dtype}", (2, 1, 64), dtype, "contiguous", 1),
            (f"prefill-2x7x64-{dtype}", (2, 7, 64), dtype, "contiguous", 1),
            (f"slice-6x8-{dtype}", (6, 8), dtype, "slice", 1),
            (f"transpose-5x3x8-{dtype}", (5, 3, 8), dtype, "transpose", 1),
            (f"repeated-8x-2x1x64-{dtype}", (2, 1, 64), dtype, "contiguous", 8),
        ]
    for dtype in ("float32", "float16", "bfloat16"):
        cases.append((f"above-1MiB-1x600x1024-{dtype}", (1, 600, 1024), dtype, "contiguous", 1))
    cases += [
        ("logits-2x512-float32", (2, 512), "float32", "contiguous", 1),
        ("logits-0.3b-4x103424-float32", (4, 103424), "float32", "contiguous", 1),
        ("decode-0.3b-4x1x1024-float32", (4, 1, 1024), "float32", "contiguous", 1),
        ("prefill-0.3b-1x512x1024-float32", (1, 512, 1024), "float32", "contiguous", 1),
        ("1MiB-less-4B-float32", (_MiB // 4 - 1,), "float32", "contiguous", 1),
        ("1MiB-float32", (_MiB // 4,), "float32", "contiguous", 1),
        ("1MiB-plus-4B-float32", (_MiB // 4 + 1,), "float32", "contiguous", 1),
        ("4MiB-float32", (4, _MiB // 4), "float32", "contiguous", 1),
        ("32MiB-float32", (8, 4, _MiB // 4), "float32", "contiguous", 1),
        ("slice-above-1MiB-512x1024-float32", (512, 1024), "float32", "slice", 1),
        ("300-calls-1x1x64-float32", (1, 1, 64), "float32", "contiguous", 300),
    ]
    return cases


ALL_REDUCE_CASES = _all_reduce_catalogue()
CASE_IDS = [c[0] for c in ALL_REDUCE_CASES]


@dataclass
class _RankRun:
    """What a two-rank run (or the re-runs after it stopped) told about each check, by check id."""

    outcomes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Checks with no outcome, and why: the run stopped inside that check, or before it.
    stopped: dict[str, str] = field(default_factory=dict)


# Two-rank runs by (platform, cases, graph dtypes): spawned once per session and case list. A run
# that stops (a hang, a crash) is spawned again without the check it stopped in, at most
# _MAX_SPAWNS times, so one broken case is reported under its own name and the others still run.
_RANK_RUNS: dict[tuple[str, tuple[Any, ...], tuple[str, ...]], _RankRun] = {}
_MAX_SPAWNS = 3


def _plugins_for(platform: str) -> PluginSet:
    return load_plugins({**os.environ, "FD_PLATFORM": platform})


def _stall_seconds() -> float:
    raw = os.environ.get(STALL_ENV, "").strip()
    try:
        return float(raw) if raw else 60.0
    except ValueError:
        raise ValueError(f"{STALL_ENV}={raw!r} is not a number of seconds") from None


def _read_outcomes(out_dir: str) -> tuple[dict[str, dict[int, dict[str, Any]]], set[str]]:
    done: dict[str, dict[int, dict[str, Any]]] = {}
    started: set[str] = set()
    for rank in (0, 1):
        try:
            with open(os.path.join(out_dir, f"rank{rank}.jsonl")) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by the rank's end
            if "start" in entry:
                started.add(entry["start"])
            else:
                done.setdefault(entry.pop("case"), {})[rank] = entry
    return done, started


def _two_rank_results(platform: str, cases: tuple[Any, ...], graph_dtypes: tuple[str, ...]) -> _RankRun:
    """Spawn two real ranks once per platform and case list; each check reads its own outcome."""
    key = (platform, cases, graph_dtypes)
    if key in _RANK_RUNS:
        return _RANK_RUNS[key]
    from fd_core.runtime.ranks.spawn import spawn_ranks
    from fd_core.testing.ranks import all_reduce_on_rank

    run = _RANK_RUNS[key] = _RankRun()
    plugins = _plugins_for(platform)
    stall = _stall_seconds()
    hint = f"set {STALL_ENV} (now {stall:g}) if it is only slow"
    todo_cases, todo_graphs = list(cases), list(graph_dtypes)
    retried_start = False
    for _ in range(_MAX_SPAWNS):
        names = [c.name for c in todo_cases] + [f"graph-{d}" for d in todo_graphs]
        if not names:
            break
        out_dir = tempfile.mkdtemp(prefix="fd-check-")
        try:
            spawn_ranks(all_reduce_on_rank, (platform, tuple(todo_cases), tuple(todo_graphs), out_dir), 2,
                        plugins.detection.dist_backend, stall=stall, stall_hint=hint)
            error = None
        except Exception as exc:  # noqa: BLE001 - kept: the checks it concerns report it
            error = f"{type(exc).__name__}: {exc}"
        finally:
            done, started = _read_outcomes(out_dir)
            shutil.rmtree(out_dir, ignore_errors=True)
        for name in names:
            if len(done.get(name, {})) == 2:
                run.outcomes[name] = [done[name][0], done[name][1]]
        left = [n for n in names if n not in run.outcomes]
        if not left:
            break
        if error is None:
            error = "the ranks ended without reporting it"
        culprit = next((n for n in left if n in started), None)
        if culprit is None and not started and not retried_start:
            # Nothing ran: a rank died while the group formed (seen under heavy load as SIGABRT in the
            # rendezvous). Start once more before blaming the platform for every check.
            retried_start = True
            continue
        if culprit is None:
            # Nothing ran: the ranks did not start, or failed before the first all-reduce.
            for name in left:
                run.stopped[name] = f"the two-rank run failed before any all-reduce: {error}"
            break
        run.stopped[culprit] = f"the two-rank run stopped in this check: {error}"
        todo_cases = [c for c in todo_cases if c.name in left and c.name != culprit]
        todo_graphs = [d for d in todo_graphs if f"graph-{d}" in left and f"graph-{d}" != culprit]
    for name in [c.name for c in cases] + [f"graph-{d}" for d in graph_dtypes]:
        if name not in run.outcomes and name not in run.stopped:
            run.stopped[name] = (
                f"not run: the two-rank run stopped {_MAX_SPAWNS} times before it (see the checks that failed first)"
            )
    return run


def _outcomes(run: _RankRun, name: str, platform: str) -> list[dict[str, Any]]:
    if name in run.stopped:
        pytest.fail(f"{platform}: {run.stopped[name]}", pytrace=False)
    return run.outcomes[name]


def _describe_wrong(wrong: dict[str, Any]) -> str:
    return (
        f"{wrong['wrong']} of {wrong['size']} elements outside the tolerance; first at index {wrong['index']}: "
        f"got {wrong['got']:.9g}, expected {wrong['want']:.9g} (tolerance {wrong['tolerance']:.3g}); "
        f"largest error {wrong['max_error']:.3g} at index {wrong['max_index']}"
    )


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

    @pytest.fixture
    def started_rank(self, plugins: PluginSet, hardware: Detection) -> Iterator[RankContext]:
        """A check that creates tensors runs in a started rank, as a run's do: the platform's fd_rank_start before it,
        its fd_rank_end after (and, just before, fd_before_step at one thread: the suite's own count again)."""
        from fd_core.host.backend import Backend

        backend = Backend(plugins)
        rank = RankContext(platform=plugins.platform, device=hardware.device)
        backend.rank_start(rank)
        try:
            yield rank
        finally:
            try:
                backend.before_step(rank, None)
            finally:
                backend.rank_end(rank, "normal")


class ContractTests(_Base):
    """Detection and the shape of the hook implementations."""

    def test_detection_is_well_formed(self, platform_module: Any, platform_name: str) -> None:
        detect = impl_function(platform_module, "fd_platform_detect")
        assert detect is not None, f"{platform_name}: implement fd_platform_detect()"
        answer = detect()
        assert isinstance(answer, Detection), (
            f"{platform_name}: fd_platform_detect must return fd_core.Detection, got {type(answer).__name__}"
        )
        assert isinstance(answer.priority, int), f"{platform_name}: Detection.priority must be an int"
        assert answer.reason.strip(), f"{platform_name}: Detection.reason must say what was (or was not) seen"
        if answer.detected:
            assert answer.dist_backend, (
                f"{platform_name}: a detected platform's Detection.dist_backend must name its paddle.distributed "
                f"backend"
            )

    def test_detection_answers_the_same_every_time(self, platform_module: Any, platform_name: str) -> None:
        """fd run asks in the parent and again in every rank: a platform that answers differently runs ranks on two
        platforms."""
        detect = impl_function(platform_module, "fd_platform_detect")
        assert detect is not None, f"{platform_name}: implement fd_platform_detect()"
        # Every field but the reason and the free memory, which may change from one moment to the next.
        fields = ("detected", "priority", "device", "dist_backend", "max_ranks", "dtypes")
        # A fresh process's first answers (what a rank sees), then this process's later ones.
        fresh = _fresh_detections(platform_module.__name__, fields, 3)
        answers = fresh + [[_plain(getattr(detect(), f, None)) for f in fields] for _ in range(3)]
        for call, answer in enumerate(answers[1:], 2):
            changed = [
                f"{f}={b!r} (first call: {a!r})" for f, a, b in zip(fields, answers[0], answer, strict=True) if a != b
            ]
            where = (
                f"call {call} in a new process" if call <= len(fresh)
                else f"a later call in the checking process (after {len(fresh)} in a new one)"
            )
            assert not changed, (
                f"{platform_name}: fd_platform_detect answered differently on {where}: {', '.join(changed)}"
            )

    def test_detection_dist_backend_is_one_paddle_accepts(self, hardware: Detection, platform_name: str) -> None:
        """The ranks rendezvous with Detection.dist_backend (the two-rank checks use it); paddle.distributed must
        accept it."""
        from fd_core.runtime.ranks.spawn import dist_backend_problem

        problem = dist_backend_problem(hardware.dist_backend)
        assert problem is None, f"{platform_name}: Detection.dist_backend={hardware.dist_backend!r}: {problem}"

    def test_detection_dtypes_are_summed(
        self, hardware: Detection, capabilities: Capabilities, platform_name: str
    ) -> None:
        """A model computes in the Detection's dtypes, so the all-reduce must sum each (checked by the two-rank
        sums)."""
        missing = [d for d in hardware.dtypes if d not in capabilities.dtypes]
        assert not missing, (
            f"{platform_name}: Detection.dtypes {tuple(hardware.dtypes)} lists {', '.join(missing)}, which "
            f"capabilities.dtypes {capabilities.dtypes} does not declare; the all-reduce of those dtypes would go "
            f"unchecked"
        )

    def test_hooks_match_the_specs(self, platform_module: Any, platform_name: str) -> None:
        validate_module(platform_name, platform_module)
        pm = new_plugin_manager()
        pm.register(platform_module, name=platform_name)
        pm.check_pending()
        for hook in ("fd_platform_detect", "fd_all_reduce"):
            assert impl_function(platform_module, hook) is not None, (
                f"{platform_name}: a platform must implement {hook}"
            )

    def test_selected_by_fd_platform(self, plugins: PluginSet, platform_name: str) -> None:
        assert plugins.platform == platform_name
        assert plugins.record(platform_name).active


    def test_a_rank_starts_steps_and_ends_in_time(self, plugins: PluginSet, hardware: Detection) -> None:
        """The lifecycle hooks as a run calls them (fd_rank_start, fd_before_step for a prefill and for decode steps of
        1 and 4 rows, fd_rank_end), twice over in one process (an LLM closed and made again), ending for each reason:
        none raises, and fd_rank_end returns within fd's time limit."""
        from fd_core.host.backend import Backend
        from fd_core.lifecycle import END_REASONS, RANK_END_TIMEOUT_S

        backend = Backend(plugins)
        for reason in END_REASONS:
            rank = RankContext(platform=plugins.platform, device=hardware.device, threads=2)
            backend.rank_start(rank)
            try:
                for rows in (None, 1, 4):
                    backend.before_step(rank, rows)
                backend.before_step(dataclasses.replace(rank, threads=1), None)  # the suite's own count again
            finally:
                problems = backend.rank_end(rank, reason)  # type: ignore[arg-type]
            assert not problems, (
                f"{plugins.platform}: ending a rank ({reason!r}) went wrong: {'; '.join(problems)} (fd waits "
                f"{RANK_END_TIMEOUT_S:g} s for fd_rank_end, then ends the rank without it)"
            )

class AllReduceTests(_Base):
    """fd_all_reduce sums over the group and returns the result, at world size 1 and 2."""

    def test_one_rank_returns_the_input_untouched(self, plugins: PluginSet) -> None:
        from fd_core.host.backend import Backend

        backend = Backend(plugins, ParallelConfig(tp_size=1))
        marker = object()
        assert backend.all_reduce(marker) is marker, "with one rank the Backend's all-reduce must be the identity"

    @pytest.fixture
    def two_ranks(self, platform_name: str, capabilities: Capabilities, hardware: Detection) -> _RankRun:
        if 2 not in capabilities.world_sizes:
            pytest.skip(f"{platform_name}: capabilities.world_sizes {capabilities.world_sizes} has no 2")
        from fd_core.testing.ranks import Case

        cases = tuple(
            Case(name, shape, dtype, layout, calls, capabilities.rtol(dtype), capabilities.in_place)
            for name, shape, dtype, layout, calls in ALL_REDUCE_CASES
            if dtype in capabilities.dtypes
        )
        from fd_core.testing.ranks import MODEL_GRAPH

        graph_dtypes: tuple[str, ...] = ()
        if capabilities.graphs and 2 in capabilities.graph_world_sizes:
            graph_dtypes = tuple(d for d in capabilities.graph_dtypes if d in capabilities.dtypes)
            if "float32" in capabilities.dtypes:
                graph_dtypes += (MODEL_GRAPH,)
        return _two_rank_results(platform_name, cases, graph_dtypes)

    @pytest.mark.parametrize("case", CASE_IDS)
    def test_two_ranks_sum(
        self, two_ranks: _RankRun, capabilities: Capabilities, platform_name: str, case: str
    ) -> None:
        """The sum of random values from both ranks, against numpy's float64 sum of the same inputs, within the dtype's
        tolerance."""
        name, shape, dtype, layout, calls = next(c for c in ALL_REDUCE_CASES if c[0] == case)
        if dtype not in capabilities.dtypes:
            pytest.skip(f"{platform_name}: {dtype} not declared in capabilities.dtypes")
        what = (
            f"{dtype}{list(shape)}"
            + ("" if layout == "contiguous" else f" ({layout} view)")
            + (f", {calls} calls in a row" if calls > 1 else "")
        )
        for rank, got in enumerate(_outcomes(two_ranks, name, platform_name)):
            where = f"{platform_name}: all-reduce of {what} on rank {rank}" + (
                f", call {got['call'] + 1}" if calls > 1 and "call" in got else ""
            )
            assert "error" not in got, f"{where} failed: {got['error']}"
            assert "problem" not in got, f"{where} {got['problem']}"
            if "wrong" in got:
                side = (
                    "the input tensor (declared in place, or returned as the result) holds" if got.get("in_input")
                    else "returned a wrong sum:"
                )
                raise AssertionError(f"{where} {side} {_describe_wrong(got['wrong'])}")
            assert got["calls"] == calls, f"{where}: only {got['calls']} of {calls} calls ran"

    def test_all_reduce_inside_a_captured_graph(
        self, two_ranks: _RankRun, capabilities: Capabilities, platform_name: str
    ) -> None:
        import numpy as np

        if not capabilities.graphs:
            pytest.skip(f"{platform_name}: capabilities.graphs is False")
        if 2 not in capabilities.graph_world_sizes:
            pytest.skip(
                f"{platform_name}: capabilities.graph_world_sizes {capabilities.graph_world_sizes}: "
                f"graphs are not captured at tp=2"
            )
        dtypes = [d for d in capabilities.graph_dtypes if d in capabilities.dtypes]
        if not dtypes:
            pytest.skip(
                f"{platform_name}: no dtype of capabilities.graph_dtypes {capabilities.graph_dtypes} "
                f"is in capabilities.dtypes"
            )
        for dtype in dtypes:
            for rank, graph in enumerate(_outcomes(two_ranks, f"graph-{dtype}", platform_name)):
                where = f"{platform_name}: an all-reduce of {dtype} captured in a graph on rank {rank}"
                assert "error" not in graph, f"{where} failed: {graph['error']}"
                if not graph["allowed"]:
                    pytest.skip(f"{platform_name} does not capture graphs at tp=2: {graph['summary']}")
                assert graph["replay"] is not None, (
                    f"{where}: the graph backend's has(key) is False right after capture"
                )
                rtol = max(capabilities.rtol(dtype), 1e-5)
                # Each rank's x @ w is 0.5 * 4 * (rank + 1); summed over two ranks and doubled: 12 in every element.
                want = np.full((2, 4), 12.0)
                for side in ("eager", "replay"):
                    got = np.asarray(graph[side], dtype=np.float64)
                    assert np.allclose(got, want, rtol=rtol), (
                        f"{where}: {side} gives {got.reshape(-1)[:4].tolist()}..., expected 12 in every element"
                    )


    def test_a_model_captured_at_tp2_gives_the_eager_tokens(
        self, two_ranks: _RankRun, capabilities: Capabilities, platform_name: str
    ) -> None:
        """A text architecture's tiny preset at tp=2 on the platform with its kernels, its decode step captured and
        replayed on both ranks: the eager tokens. A kernel whose output only a capture refuses (a strided view fed to
        the all-reduce) fails here rather than in `fd run --tp 2 --graph on`."""
        from fd_core.testing.ranks import MODEL_GRAPH

        if not capabilities.graphs or 2 not in capabilities.graph_world_sizes or "float32" not in capabilities.dtypes:
            pytest.skip(f"{platform_name}: graphs are not captured at tp=2 in float32 (capabilities)")
        for rank, got in enumerate(_outcomes(two_ranks, f"graph-{MODEL_GRAPH}", platform_name)):
            if not got.get("allowed", True):
                pytest.skip(f"{platform_name} does not capture graphs at tp=2: {got['summary']}")
            if "architecture" not in got and "error" not in got:
                pytest.skip("no text architecture that captures graphs is registered")
            where = (f"{platform_name}: {got.get('architecture', 'a model')} at tp=2 with the platform's kernels, its "
                     f"decode step captured, on rank {rank}")
            assert "error" not in got, (
                f"{where} failed: {got['error']}; a kernel's output the capture refuses (a strided view, another "
                f"dtype) fails `fd run --tp 2 --graph on` the same way: fix the kernel"
            )
            assert got["captured"] == got["eager"], f"{where}: tokens {got['captured']}, eager {got['eager']}"


@pytest.mark.usefixtures("started_rank")
class CleanupTests(_Base):
    """fd_clean_memory_fragments takes what the runner passes (None, seeded numpy arrays, paddle tensors, {}), twice."""

    def test_cleanup_takes_every_argument_the_runner_passes(
        self, plugins: PluginSet, platform_name: str, hardware: Detection
    ) -> None:
        import numpy as np
        import paddle

        from fd_core.host.backend import Backend

        backend = Backend(plugins)
        arrays = {"w": np.ones((8, 8), dtype=np.float32)}  # seeded weights are staged as numpy
        for state_dict in (None, None, arrays, {"w": paddle.ones([8, 8]), "b": paddle.zeros([8])}, {}):
            backend.clean_memory_fragments(state_dict)  # a raising hook fails here, named

    def test_cleanup_leaves_live_values_untouched(
        self, plugins: PluginSet, capabilities: Capabilities, platform_name: str, hardware: Detection
    ) -> None:
        """Checked by value against copies: cleanup may release memory, never change a live parameter (nor, unless it
        declares cleanup_releases_state, the tensors it is given)."""
        import numpy as np
        import paddle

        from fd_core.host.backend import Backend

        rng = np.random.default_rng(7)
        layer = paddle.nn.Linear(32, 48)  # live parameters, as a loaded model holds them
        live = {name: p.numpy().copy() for name, p in layer.named_parameters()}
        given = {
            "w": paddle.to_tensor(rng.standard_normal((16, 16)).astype("float32")),
            "b": paddle.to_tensor(rng.standard_normal(16).astype("float32")),
        }
        copies = {k: v.numpy().copy() for k, v in given.items()}
        backend = Backend(plugins)
        for state_dict in (None, {"w": rng.standard_normal((8, 8)).astype("float32")}, given, None):
            backend.clean_memory_fragments(state_dict)
            for name, p in layer.named_parameters():
                assert p._is_initialized(), (
                    f"{platform_name}: fd_clean_memory_fragments({_what(state_dict)}) released a live parameter "
                    f"({name})"
                )
                diff = np.abs(p.numpy() - live[name])
                assert not diff.any(), (
                    f"{platform_name}: fd_clean_memory_fragments({_what(state_dict)}) changed a live parameter "
                    f"({name}): {int((diff > 0).sum())} of {diff.size} values, largest change {float(diff.max()):.3g}"
                )
        if not capabilities.cleanup_releases_state:
            for name, tensor in given.items():
                assert tensor._is_initialized() and np.array_equal(tensor.numpy(), copies[name]), (
                    f"{platform_name}: fd_clean_memory_fragments changed the values of the state dict's {name!r}, "
                    f"and does not declare cleanup_releases_state"
                )

    def test_cleanup_releases_the_state_when_declared(
        self, plugins: PluginSet, capabilities: Capabilities, platform_name: str, hardware: Detection
    ) -> None:
        import paddle

        from fd_core.host.backend import Backend

        state = {"w": paddle.ones([64, 64]), "b": paddle.zeros([64])}
        Backend(plugins).clean_memory_fragments(state)
        kept = [name for name, tensor in state.items() if tensor._is_initialized()]
        if capabilities.cleanup_releases_state:
            assert not kept, (
                f"{platform_name}: declares cleanup_releases_state, but fd_clean_memory_fragments left {kept} "
                f"holding memory"
            )
        else:
            assert set(state) == {"w", "b"}, (
                f"{platform_name}: cleanup without cleanup_releases_state must not change the state dict"
            )


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _fresh_detections(module: str, fields: tuple[str, ...], calls: int) -> list[list[Any]]:
    """`calls` answers of the module's fd_platform_detect in a new Python process, as its first calls (as a rank makes
    them)."""
    import subprocess
    import sys

    code = (
        f"import json, importlib; m = importlib.import_module({module!r}); "
        f"print(json.dumps([[(list(v) if isinstance(v, tuple) else v) "
        f"for v in (getattr(d, f, None) for f in {list(fields)!r})] "
        f"for d in (m.fd_platform_detect() for _ in range({calls}))]))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.fail(f"{module}: fd_platform_detect in a new process failed: {last}", pytrace=False)
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _what(state_dict: Any) -> str:
    return "None" if state_dict is None else (
        "{" + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in state_dict.items()) + "}"
    )


class EligibilityTests(_Base):
    """Every vote is None or a well-formed GraphVote (checked where it is used), for every model and layout."""

    def test_votes_are_well_formed(self, plugins: PluginSet, platform_name: str) -> None:
        from fd_core.host.backend import Backend

        backend = Backend(plugins)
        configs = [ModelConfig(architecture=PROBE)] + [a.preset_config() for a in platform_architectures(plugins)]
        for config in configs:
            for tp in (1, 2):
                # A vote of the wrong type, a veto without a reason or a vote that never returns raises here, naming
                # its plugin.
                decision = backend.graph_decision(config, ParallelConfig(tp_size=tp))
                assert all(isinstance(v.allow, bool) and isinstance(v.reason, str) for v in decision.votes)
                assert decision.allowed == (decision.mode is not None and all(v.allow for v in decision.votes))


@pytest.mark.usefixtures("started_rank")
class GraphBackendTests(_Base):
    """The graph backend replays what eager computes, and clear makes the next call capture again."""

    @pytest.fixture
    def graphs(self, plugins: PluginSet, capabilities: Capabilities, platform_name: str, hardware: Detection) -> Any:
        if not capabilities.graphs:
            pytest.skip(f"{platform_name}: capabilities.graphs is False")
        from fd_core.host.backend import Backend

        return Backend(plugins).graph_backend()

    def test_has_a_mode_and_the_methods(self, graphs: Any, platform_name: str) -> None:
        assert isinstance(graphs.mode, str) and graphs.mode, f"{platform_name}: the graph backend must name its mode"
        for method in ("capture", "replay", "has", "clear"):
            assert callable(getattr(graphs, method, None)), f"{platform_name}: the graph backend lacks {method}()"

    def test_replay_equals_eager_and_clear_recaptures(self, graphs: Any, platform_name: str) -> None:
        check_graph_backend(graphs, platform_name)


def check_graph_backend(graphs: Any, name: str) -> None:
    """The graph-backend contract: capture traces, replay equals eager without running Python, clear drops, capture
    again works."""
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


# The checks that run third-party packages on the platform rather than the platform's own hooks (fd check's verdict
# says when only these failed).
THIRD_PARTY_CHECKS = ("test_installed_model_packages_run_on_this_platform",)


def platform_architectures(plugins: PluginSet) -> list[Architecture]:
    """The architectures a platform is checked with: fd-backends' own (a third party's model package is checked on
    the platform by a check of its own, so that its break is its own)."""
    return [a for a in plugins.registry if plugins.registry.builtin(a.name)]


@pytest.mark.usefixtures("started_rank")
class ModelTests(_Base):
    """Every graph-capable architecture installed has a graph-clear hook that handles its models."""

    def test_installed_model_packages_run_on_this_platform(self, plugins: PluginSet) -> None:
        """Each third-party model package's architectures build from their presets and give the native path's tokens
        on this platform. Apart from the platform's own checks (which run fd-backends' architectures): a failure here
        names the package, and says the platform's checks do not depend on it."""
        from fd_core.errors import FdError
        from fd_core.host.backend import Backend
        from fd_core.host.kernel_table import KernelTable
        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.runner import ModelRunner
        from fd_core.runtime.plan import model_config_for
        from fd_core.runtime.request import Request

        theirs = [a for a in plugins.registry if not plugins.registry.builtin(a.name)]
        if not theirs:
            pytest.skip("no third-party model package is installed")
        backend = Backend(plugins)
        native = Backend(plugins, kernels=KernelTable())
        native.clean_memory_fragments = lambda state_dict=None, after_each=None: None  # type: ignore[method-assign]
        request = Request.greedy([[5, 1, 4, 2, 3]], 6)
        failures = []

        def tokens(arch: Architecture, on: Backend, graph: str) -> list[list[int]]:
            runner = ModelRunner(on, arch, model_config_for(arch, None), graph=graph)
            runner.load()
            runner.decide()
            return [c.token_ids for c in Engine(runner).generate(request)]

        for arch in theirs:
            where = f"model package {arch.package!r} (architecture {arch.name!r})"
            try:
                got, want = tokens(arch, backend, "auto"), tokens(arch, native, "off")
            except (FdError, AssertionError, ValueError, RuntimeError) as exc:
                failures.append(f"{where}: {type(exc).__name__}: {exc}")
                continue
            if got != want:
                failures.append(f"{where}: greedy tokens {got} on {backend.platform}, {want} on the native path")
        assert not failures, (
            f"{failures[0]}; the platform's own checks do not depend on it: fix or uninstall that package"
            + (f" ({len(failures)} package architecture(s) in all)" if len(failures) > 1 else "")
        )

    def test_every_graph_capable_architecture_has_a_clear_hook(self, plugins: PluginSet) -> None:
        for arch in plugins.registry:
            if arch.graph_capable:
                owner = plugins.pm.get_plugin(arch.package)
                assert impl_function(owner, "fd_clear_graphs") is not None, (
                    f"{arch.name} ({arch.package}) has no fd_clear_graphs"
                )

    def test_clear_hook_really_clears_each_captured_model(
        self, plugins: PluginSet, capabilities: Capabilities, hardware: Detection
    ) -> None:
        """Through a recording graph backend: after fd_clear_graphs nothing is captured and decode does not replay."""
        from fd_core.host.backend import Backend
        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.runner import ModelRunner
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
        eager: dict[str, str] = {}
        for arch in platform_architectures(plugins):
            # The engine `fd run` generates through: what is checked here is what runs.
            runner = ModelRunner(backend, arch, model_config_for(arch, None))
            runner.load()
            decision = runner.decide()
            if not decision.allowed:
                eager[arch.name] = decision.summary()
                continue
            engine = Engine(runner)
            before = engine.generate(request)[0].token_ids
            spy = spies[-1]
            assert spy.replays, f"{arch.name}: decode did not replay its captured graph"
            model = runner.model
            assert model is not None
            backend.clear_graphs(model)  # raises PluginError when no hook handles the model
            assert spy.clears and not any(spy.has(k) for k in spy.keys), (
                f"{arch.name}: fd_clear_graphs returned True but the graphs are still captured"
            )
            replays = spy.replays
            after = engine.generate(request)[0].token_ids
            assert spy.replays == replays, f"{arch.name}: decode still replayed a graph after fd_clear_graphs"
            assert after == before, f"{arch.name}: decoding after fd_clear_graphs gives {after}, with graphs {before}"
        if eager and len(eager) == len(platform_architectures(plugins)):
            pytest.skip(
                f"no architecture captures graphs here, so no clear hook was exercised: "
                f"{'; '.join(f'{a}: {w}' for a, w in eager.items())}"
            )


    def test_the_engine_generates_what_the_model_computes_without_a_cache(
        self, plugins: PluginSet, hardware: Detection
    ) -> None:
        """Greedy tokens through the engine `fd run` uses (prefill, cached decode steps, graphs where the decision
        allows them) equal the argmax of a full prefill of the growing sequence: no cache, no decode step, no engine."""
        import numpy as np

        from fd_core.host.backend import Backend
        from fd_core.kvcache import KVBatch
        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.runner import ModelRunner
        from fd_core.runtime.plan import model_config_for
        from fd_core.runtime.request import Request

        backend = Backend(plugins)
        prompt, steps = [1, 2, 3], 4
        for arch in platform_architectures(plugins):
            runner = ModelRunner(backend, arch, model_config_for(arch, None))
            runner.load()
            runner.decide()
            got = Engine(runner).generate(Request.greedy([prompt], steps))[0].token_ids
            model = runner.model
            assert model is not None
            assert len(got) == steps, f"{arch.name}: the engine gave {len(got)} tokens for max_new_tokens={steps}"
            ids = list(prompt)
            for step, token in enumerate(got):
                # The whole sequence prefilled again into blocks of the engine's cache (nothing runs there now).
                width = -(-(len(prompt) + steps) // runner.block_size)
                batch = KVBatch.contiguous(1, 0, len(ids), runner.block_size, width)
                logits = np.asarray(
                    model.prefill(np.asarray([ids], dtype="int64"), None, batch).astype("float32").numpy()[0],
                    dtype=np.float64,
                )
                top2 = np.sort(logits)[-2:]
                # A near-tie may break either way between two correct computations; anything else is a wrong token.
                tie = top2[1] - top2[0] <= 1e-3 * max(1.0, float(np.abs(top2).max()))
                assert token == int(logits.argmax()) or tie, (
                    f"{arch.name} on {backend.platform}: step {step} of the engine chose {token}, but a full prefill "
                    f"of {ids} gives {int(logits.argmax())}; the decode step, the KV cache or a captured graph is wrong"
                )
                ids.append(token)


    def test_the_platform_generates_what_the_native_path_does(self, plugins: PluginSet, hardware: Detection) -> None:
        """Greedy tokens on the platform (its cleanup after loading, its kernels, graphs where the decision allows
        them) equal a run on the native path: the same seeded weights with no platform hook called (no cleanup, the
        native ops, eager decode, one rank). Two prompts decoded together (graphs as decided), then one alone on two
        compute threads and eagerly: the one-row steps where a kernel may split its work
        (fd_core.kernels.compute_threads), each step calling it."""
        from fd_core.host.backend import Backend
        from fd_core.host.kernel_table import KernelTable
        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.runner import ModelRunner
        from fd_core.runtime.plan import model_config_for
        from fd_core.runtime.request import Request

        backend = Backend(plugins)
        native = Backend(plugins, kernels=KernelTable())
        native.clean_memory_fragments = lambda state_dict=None, after_each=None: None  # type: ignore[method-assign]
        together, alone = Request.greedy([[5, 1, 4, 2, 3], [7, 7, 2]], 6), Request.greedy([[5, 1, 4, 2, 3]], 6)
        for arch in platform_architectures(plugins):
            config = model_config_for(arch, None)
            # As a run's rank (started by the started_rank fixture): the platform sets each phase.
            one = RankContext(platform=backend.platform, device=hardware.device, model=arch.name, dtype=config.dtype)
            runner = ModelRunner(backend, arch, config)
            eager = ModelRunner(backend, arch, config, graph="off")
            reference = ModelRunner(native, arch, config, graph="off")
            for each in (runner, eager, reference):
                each.load()
                each.decide()
            for request, ours, threads in ((together, runner, 1), (alone, eager, 2)):
                try:
                    rank = dataclasses.replace(one, threads=threads)
                    got = [c.token_ids for c in Engine(ours, rank=rank).generate(request)]
                finally:
                    backend.before_step(one, None)  # the suite's own thread count again
                want = [c.token_ids for c in Engine(reference).generate(request)]
                how = "one prompt, eager, on 2 compute threads" if threads == 2 else "two prompts together"
                assert got == want, (
                    f"{arch.name} on {backend.platform} ({how}): greedy tokens {got} (kernels "
                    f"{backend.kernels.providers()}), but the native path (the same weights, no platform "
                    f"cleanup, native ops, eager) gives {want}; the platform's cleanup, graphs or kernels change "
                    f"what the model computes"
                )

    def test_speculative_decoding_on_the_platform_gives_the_native_tokens(
        self, plugins: PluginSet, hardware: Detection
    ) -> None:
        """Speculative decoding on the platform (its kernels, accept_draft's included, its cleanup, graphs as decided
        for the plain steps): two prompts decoding together, their proposals their known continuation spoiled at
        changing places, give the native path's greedy tokens."""
        from fd_core.host.backend import Backend
        from fd_core.host.kernel_table import KernelTable
        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.runner import ModelRunner
        from fd_core.runtime.engine.speculation import ReplayProposer, Speculation
        from fd_core.runtime.plan import model_config_for
        from fd_core.runtime.request import Request

        backend = Backend(plugins)
        native = Backend(plugins, kernels=KernelTable())
        native.clean_memory_fragments = lambda state_dict=None, after_each=None: None  # type: ignore[method-assign]
        prompts = [[5, 1, 4, 2, 3, 9, 9, 4], [7, 7, 2]]
        request = Request.greedy(prompts, 10)
        checked = 0
        for arch in platform_architectures(plugins):
            config = model_config_for(arch, None)
            ours, reference = ModelRunner(backend, arch, config), ModelRunner(native, arch, config, graph="off")
            for each in (ours, reference):
                each.load()
                each.decide()
            if not callable(getattr(ours.model, "prefill_every", None)):
                continue
            want = [c.token_ids for c in Engine(reference).generate(request)]
            engine = Engine(ours, speculation=Speculation("ngram", 4))
            engine.proposer = ReplayProposer({tuple(p): w for p, w in zip(prompts, want, strict=True)},
                                             wrong=(1, 3, 0, 9))
            got = [c.token_ids for c in engine.generate(request)]
            assert got == want, (
                f"{arch.name} on {backend.platform} with speculative decoding: greedy tokens {got} (kernels "
                f"{backend.kernels.providers()}), but the native path without it gives {want}; the platform's "
                f"accept_draft, or its paged prefill over a cached prefix at the proposals' positions, differs"
            )
            assert 0 < engine.spec_accepted < engine.spec_proposed
            checked += 1
        if not checked:
            pytest.skip(f"{plugins.platform}: no architecture here has prefill_every, which verifies proposals")

    def test_the_model_path_runs_in_every_claimed_dtype(self, plugins: PluginSet, hardware: Detection) -> None:
        """Each dtype Detection.dtypes claims besides float32 (the first is `fd run`'s default) runs every architecture
        here on the platform (its kernels, cleanup and graphs as decided), and the first step's logits stay near the
        native float32 path's (cosine >= 0.99): a claimed dtype the kernels cannot run fails here, not in `fd run`."""
        import numpy as np

        from fd_core.host.backend import Backend
        from fd_core.host.kernel_table import KernelTable
        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.runner import ModelRunner
        from fd_core.runtime.plan import model_config_for
        from fd_core.runtime.request import Request

        claimed = [d for d in dict.fromkeys(hardware.dtypes) if d != "float32"]
        if not claimed:
            pytest.skip(f"{plugins.platform} computes in float32 only (Detection.dtypes): the native-path checks run "
                        f"it")
        backend = Backend(plugins)
        native = Backend(plugins, kernels=KernelTable())
        native.clean_memory_fragments = lambda state_dict=None, after_each=None: None  # type: ignore[method-assign]
        request = Request.greedy([[5, 1, 4, 2, 3]], 4)

        def first_logits(runner: ModelRunner) -> np.ndarray:
            runner.load()
            runner.decide()
            trace: dict[int, list[Any]] = {}
            Engine(runner, trace=trace).generate(request)
            return np.asarray(trace[0][0], dtype=np.float64)

        for arch in platform_architectures(plugins):
            want = first_logits(ModelRunner(native, arch, model_config_for(arch, None), graph="off"))
            for dtype in claimed:
                try:
                    got = first_logits(ModelRunner(backend, arch, model_config_for(arch, None, dtype)))
                except Exception as exc:  # noqa: BLE001 - reported as the platform's claim that does not hold
                    pytest.fail(
                        f"{plugins.platform} claims {dtype} (Detection.dtypes={tuple(hardware.dtypes)}), but "
                        f"{arch.name} cannot run in it on this platform: {error_line(exc)[:200]}; make its "
                        f"kernels run {dtype} or drop it from Detection.dtypes"
                    )
                finite = bool(np.isfinite(got).all())
                cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want) + 1e-30)) if finite else 0.0
                assert finite and cosine >= 0.99, (
                    f"{arch.name} on {plugins.platform} in {dtype}: the first step's logits "
                    f"{'have cosine ' + format(cosine, '.4f') if finite else 'are not all finite'} against the native "
                    f"float32 path's (cosine at least 0.99 expected)"
                )

    def test_decode_batches_are_captured_at_the_declared_sizes(self, plugins: PluginSet, hardware: Detection) -> None:
        """With Detection.capture_sizes declared, a decode batch between two sizes is padded up to the next and one
        above the largest decodes eagerly: only declared sizes are captured, and both give the native path's tokens."""
        from fd_core.host.backend import Backend
        from fd_core.host.kernel_table import KernelTable
        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.runner import ModelRunner
        from fd_core.runtime.plan import model_config_for
        from fd_core.runtime.request import Request

        sizes = sorted(set(hardware.capture_sizes))
        if not sizes:
            pytest.skip(f"{plugins.platform} declares no capture sizes (Detection.capture_sizes): fd captures powers "
                        f"of two, which the native-path check covers")
        backend = Backend(plugins)
        native = Backend(plugins, kernels=KernelTable())
        native.clean_memory_fragments = lambda state_dict=None, after_each=None: None  # type: ignore[method-assign]
        between = next((n for n in range(1, sizes[-1]) if n not in sizes), None)
        batches = [n for n in (between, sizes[-1] + 1) if n is not None]
        checked = 0
        for arch in platform_architectures(plugins):
            config = model_config_for(arch, None)
            runner = ModelRunner(backend, arch, config)
            reference = ModelRunner(native, arch, config, graph="off")
            for each in (runner, reference):
                each.load()
                each.decide()
            if not runner.graphs_allowed:
                continue
            checked += 1
            for batch in batches:
                request = Request.greedy([[5 + i, 1, 4, 2 + i] for i in range(batch)], 4)
                engine = Engine(runner, max_batch=batch)
                got = [c.token_ids for c in engine.generate(request)]
                want = [c.token_ids for c in Engine(reference, max_batch=batch).generate(request)]
                captured = sorted({rows for rows, _ in runner.captured})
                assert set(captured) <= set(sizes), (
                    f"{arch.name} on {plugins.platform}: decode steps were captured at batch sizes {captured}, but "
                    f"the platform captures only {sizes} (Detection.capture_sizes)"
                )
                above = batch > sizes[-1]
                assert (engine.eager_steps > 0) == above, (
                    f"{arch.name} on {plugins.platform}: a batch of {batch} ran {engine.eager_steps} eager decode "
                    f"step(s); expected {'every step eager (above the largest capture size)' if above else 'none'}"
                )
                assert got == want, (
                    f"{arch.name} on {plugins.platform}: a batch of {batch} prompts "
                    f"({'eager, above' if above else 'padded up to'} the capture sizes {sizes}) gives greedy tokens "
                    f"{got}, but the native path gives {want}"
                )
        if not checked:
            pytest.skip(f"{plugins.platform}'s graph decision captures none of the architectures here")

    def test_quantized_models_generate_what_the_native_path_does(
        self, plugins: PluginSet, hardware: Detection
    ) -> None:
        """Under each weight-only quantization (fd_core.quantization.SCHEMES): greedy tokens on the platform (its
        quant_matmul and the weight preparation of its kernels, graphs as decided) equal the native path's on the
        same weights (fd's quantizer, the native quant_matmul, eager, no platform hook), for every architecture; for
        the first, again after a reload of other weights (another seed) into the same model (a preparation that keeps
        the old weights is the kernels' fault, whatever the architecture)."""
        from fd_core.host.backend import Backend
        from fd_core.host.kernel_table import KernelTable
        from fd_core.quantization import DEFAULT_GROUPS, SCHEMES
        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.runner import ModelRunner
        from fd_core.runtime.plan import model_config_for
        from fd_core.runtime.request import Request

        backend = Backend(plugins)
        native = Backend(plugins, kernels=KernelTable())
        native.clean_memory_fragments = lambda state_dict=None, after_each=None: None  # type: ignore[method-assign]
        request = Request.greedy([[5, 1, 4, 2, 3], [7, 7, 2]], 6)
        quantizable = [arch for arch in platform_architectures(plugins) if arch.quantizable]
        for arch in quantizable:
            # Each scheme per output channel and in its default groups (as the kernel in use is given them).
            for scheme, group in [(s, g) for s in SCHEMES for g in (0, backend.ops.quant_group(DEFAULT_GROUPS[s]))]:
                config = model_config_for(arch, None).with_overrides(quantization=scheme, quantization_group=group)
                runner = ModelRunner(backend, arch, config)
                runner.load()
                runner.decide()
                got, want = [], []
                # The second seed: other weights reloaded into the same model, prepared again.
                for seed in (0, 1) if arch is quantizable[0] else (0,):
                    if seed:
                        runner.seed = seed
                        runner.reload()
                    reference = ModelRunner(native, arch, config, seed=seed, graph="off")
                    reference.load()
                    reference.decide()
                    got.append([c.token_ids for c in Engine(runner).generate(request)])
                    want.append([c.token_ids for c in Engine(reference).generate(request)])
                reloaded = len(want) > 1
                assert got == want and (not reloaded or want[0] != want[1]), (
                    f"{arch.name} under --quantization {scheme} --quantization-group {group} on {backend.platform}: "
                    f"greedy tokens {got[0]}"
                    + (f", after a reload of other weights {got[1]}" if reloaded else "")
                    + f" (kernels {backend.kernels.providers()}), but the native path (fd's quantizer, the native "
                    f"quant_matmul, eager) gives {want[0]}" + (f", then {want[1]}" if reloaded else "")
                    + "; the platform's quant_matmul or weight preparation changes what the model computes, or keeps "
                    "a reload's old weights"
                )


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


class PlatformSuite(
    ContractTests, AllReduceTests, CleanupTests, EligibilityTests, GraphBackendTests, ModelTests, KernelTests
):
    """Every conformance check; subclass it as `TestMyPlatform` and provide `platform_name` and `capabilities`."""

