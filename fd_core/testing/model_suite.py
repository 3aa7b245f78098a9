"""The conformance suite for model packages: subclass `ModelSuite` and provide the `architecture_name` fixture.

Every check generates through the session `fd run` and `LLM` use (the plan, its ranks, the engine), on the
architecture's tiny preset and on its `odd_preset` when it declares one:

- tp: tp=2 over two real ranks (graphs off and on) gives tp=1's tokens;
- graph: a captured decode step gives the eager tokens;
- continuous batching: prompts joining a running batch (prefilled into free cache rows, decoding at their
  own positions, the cache growing under them) give their tokens alone;
- graph clear: `fd_clear_graphs` really drops what was captured, a replay after it is refused, decoding
  after it is eager and gives the same tokens;
- reload: weight-update cycles (clear, release, load) keep the tokens; a seeded random checkpoint
  written by `fd save-random` loads back to the same tokens;
- reference: a tiny random model built and saved by transformers (the architecture's `reference`
  class) gives the reference's greedy tokens through `fd run`'s path. Without transformers, or
  without a reference class, it is skipped as "not verified", which `fd check` never counts as a pass.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import pytest

from fd_core.errors import RankError, install_hint
from fd_core.host.loading import PluginSet, load_plugins
from fd_core.models import Architecture

PROMPT = (5, 17, 42, 99, 7, 300)
STEPS = 12
# Reference parity: float32 on both sides with different kernels, so logits agree to rounding. A greedy
# token match means something only where every step's best and second-best logits are further apart
# than that; seeds are tried in order until one gives such a model.
LOGIT_TOL = 2e-4
MIN_MARGIN = 20 * LOGIT_TOL
REFERENCE_SEEDS = range(8)
# Weight-only quantization against the float32 reference: logits compared at each of QUALITY_STEPS steps along the
# reference's greedy tokens; per scheme, the least cosine similarity at any step, the least mean over the steps and the
# least share of steps whose argmax agrees. Set for the suite's tiny reference models (hidden sizes of 64: a 4-bit
# channel of 64 values is coarse, and their top logits lie close), measured in docs/quantization.md; a quantizer whose
# scales are off by 2x or taken along the wrong axis fails them (tests/models/test_quantization.py).
QUALITY_STEPS = 32
QUALITY_BOUNDS = {"wint8": (0.99, 0.998, 0.85), "wint4": (0.5, 0.8, 0.25)}
# Marks a skip `fd check` reports as unverified (exit 3 unless --allow-unverified), never as a pass.
NOT_VERIFIED = "not verified:"

# Results by (architecture, config index, what): computed once per session and shared by the checks,
# their failure too, so that one broken run is one failure, not one re-run per dependent check.
_RUNS: dict[tuple[str, int, str], Any] = {}


def reference_class(arch: Architecture, transformers: Any) -> str | None:
    """The transformers class name the architecture is compared with: its `reference`, else its first alias
    transformers defines."""
    if arch.reference is not None:
        return arch.reference or None
    return next((alias for alias in arch.aliases if getattr(transformers, alias, None) is not None), None)


def _prompt(arch: Architecture, index: int) -> tuple[int, ...]:
    vocab = int(_config_data(arch, index).get("text_config", _config_data(arch, index)).get("vocab_size", 512))
    return tuple(t % vocab for t in PROMPT)


def _config_data(arch: Architecture, index: int) -> Mapping[str, Any]:
    return arch.preset if index == 0 or arch.odd_preset is None else arch.odd_preset


def _cached(key: tuple[str, int, str], compute: Any) -> Any:
    """`compute()` once per key; a failure is kept and re-raised as a one-line failure of each check that needs it."""
    if key not in _RUNS:
        try:
            _RUNS[key] = compute()
        except Exception as exc:  # noqa: BLE001 - kept: every check that depends on the run reports it
            _RUNS[key] = exc
    result = _RUNS[key]
    if isinstance(result, BaseException):
        pytest.fail(f"{key[0]}: {key[2]} failed: {type(result).__name__}: {result}", pytrace=False)
    return result


class ModelSuite:
    """Every model check; subclass it as `TestMyModel` and provide `architecture_name`."""

    @pytest.fixture
    def architecture_name(self) -> str:
        """The registered name (or alias) of the architecture under test."""
        raise NotImplementedError(
            "provide an `architecture_name` fixture returning your architecture's registered name"
        )

    @pytest.fixture
    def plugins(self) -> PluginSet:
        """The installed plugins (FD_PLATFORM and FD_PLUGINS apply)."""
        return load_plugins()

    @pytest.fixture
    def architecture(self, plugins: PluginSet, architecture_name: str) -> Architecture:
        return plugins.registry.get(architecture_name)

    @pytest.fixture(params=[0, 1], ids=["preset", "odd_preset"])
    def config_index(self, request: pytest.FixtureRequest, architecture: Architecture) -> int:
        """0: the tiny preset; 1: the architecture's `odd_preset`."""
        if request.param == 1 and architecture.odd_preset is None:
            pytest.skip(f"{architecture.name} declares no odd_preset (a second config to check)")
        return int(request.param)

    @pytest.fixture
    def source(self, architecture: Architecture, config_index: int, plugins: PluginSet) -> dict[str, Any]:
        """What a RunConfig loads: the preset (seeded random weights), or the `odd_preset` written by save-random."""
        if config_index == 0:
            return {"model": architecture.name, "checkpoint": None}

        def write() -> str:
            from fd_core.runtime.save_random import save_random_checkpoint

            root = Path(tempfile.mkdtemp(prefix=f"fd-model-suite-{architecture.name}-"))
            atexit.register(shutil.rmtree, root, ignore_errors=True)  # shared by the session's checks, then removed
            data = {**_config_data(architecture, config_index), "architectures": [architecture.name]}
            (root / "config.json").write_text(json.dumps(data))
            return str(save_random_checkpoint(
                architecture.name, str(root / "checkpoint"), seed=0, config_path=str(root / "config.json")
            ))

        return {
            "model": None,
            "checkpoint": _cached((architecture.name, config_index, "writing the config's checkpoint"), write),
        }

    # -- runs shared by the checks -----------------------------------------------------------------

    def _plan(
        self, plugins: PluginSet, arch: Architecture, index: int, source: Mapping[str, Any], **settings: Any
    ) -> Any:
        from fd_core.runtime.plan import RunConfig, plan_run

        run = RunConfig(
            tp=settings.pop("tp", 1), steps=STEPS, prompt_ids=_prompt(arch, index), progress=False, **source, **settings
        )
        return plan_run(run, plugins)

    def _runner(
        self, plugins: PluginSet, arch: Architecture, index: int, source: Mapping[str, Any], graph: str
    ) -> Any:
        """A ModelRunner of the architecture's plan on the platform, loaded and decided (graph "auto" or "off")."""
        from fd_core.host.backend import Backend
        from fd_core.runtime.engine.runner import ModelRunner

        plan = self._plan(plugins, arch, index, source, graph=graph)
        runner = ModelRunner(Backend(plugins), arch, plan.config, plan.run.checkpoint, graph=graph)
        runner.load()
        runner.decide()
        return runner

    def _verifies(self, plugins: PluginSet, arch: Architecture, index: int, source: Mapping[str, Any]) -> bool:
        """Whether the architecture's model has prefill_every, which speculative decoding verifies proposals with."""
        from fd_core.host.backend import Backend

        def built() -> bool:
            plan = self._plan(plugins, arch, index, source, graph="off")
            return callable(getattr(arch.build_model(plan.config, Backend(plugins)), "prefill_every", None))

        return bool(_cached((arch.name, index, "whether the model has prefill_every"), built))

    def _tp1(
        self, plugins: PluginSet, arch: Architecture, index: int, source: Mapping[str, Any], graph: str
    ) -> dict[str, Any]:
        from fd_core.runtime.job import run_plan

        return _cached((arch.name, index, f"the tp=1 run with --graph {graph}"),
                       lambda: run_plan(self._plan(plugins, arch, index, source, graph=graph), plugins)[0])

    # -- the checks ----------------------------------------------------------------------------------

    def test_tp1_tokens_vary(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, source: dict[str, Any]
    ) -> None:
        """Tokens that never change would make every equality of the suite vacuous."""
        tokens = self._tp1(plugins, architecture, config_index, source, "off")["tokens"]
        assert len(set(tokens)) > 2, (
            f"{architecture.name}: the seeded random model's greedy tokens {tokens} hardly change, so the tp, graph "
            f"and reload checks compare nothing; give the preset initializer_range 0.2 (or check the head and the "
            f"weights it loads)"
        )

    def test_tp2_equals_tp1(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, source: dict[str, Any]
    ) -> None:
        """Two real ranks, each holding its slice of every split weight, graphs off and on (speculative decoding with
        n-gram proposals too), give tp=1's tokens (and the same tokens on both ranks: the session checks every sequence
        that ends)."""
        from fd_core.errors import FdError
        from fd_core.runtime.job import run_plan

        want = self._tp1(plugins, architecture, config_index, source, "off")["tokens"]
        verifies = self._verifies(plugins, architecture, config_index, source)
        for graph in ("off", "on"):
            try:
                plan = self._plan(plugins, architecture, config_index, source, tp=2, graph=graph,
                                  speculative="ngram" if graph == "on" and verifies else None)
            except FdError as exc:
                pytest.skip(
                    f"{architecture.name}: tp=2 is not possible here, so there is no tp to compare with tp=1 ({exc})"
                )
            try:
                got = run_plan(plan, plugins)[0]
            except RankError as exc:  # the ranks disagreed, or one failed
                raise AssertionError(
                    f"{architecture.name}: tp=2 (--graph {graph}) failed: {exc}; a split weight, its split axis or an "
                    f"all-reduce of the model is wrong"
                ) from None
            spec = ", --speculative ngram" if plan.run.speculative else ""
            assert got["tokens"] == want, (
                f"{architecture.name}: tp=2 (--graph {graph}{spec}) gives "
                f"{got['tokens']}, tp=1 gives {want}; a split weight, its split axis or an all-reduce of the model is "
                f"wrong"
            )

    def test_graph_on_equals_graph_off(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, source: dict[str, Any]
    ) -> None:
        """A captured decode step (replayed) gives the eager tokens."""
        if not architecture.graph_capable:
            pytest.skip(f"{architecture.name} is registered with graph_capable=False")
        eager = self._tp1(plugins, architecture, config_index, source, "off")
        graphs = self._tp1(plugins, architecture, config_index, source, "on")
        if not graphs["graph"]["allowed"]:
            pytest.skip(f"{architecture.name}: no graph is captured here: {graphs['graph']['summary']}")
        assert graphs["tokens"] == eager["tokens"], (
            f"{architecture.name}: with the captured decode graph the tokens are {graphs['tokens']}, eager "
            f"{eager['tokens']}; the captured step depends on Python-side state or on shapes that change"
        )

    def test_graph_clear_really_clears(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, source: dict[str, Any]
    ) -> None:
        """After fd_clear_graphs nothing is captured, a replay is refused, and decoding is eager with the same
        tokens."""
        from fd_core.host.backend import Backend
        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.runner import ModelRunner
        from fd_core.runtime.request import Request

        if not architecture.graph_capable:
            pytest.skip(f"{architecture.name} is registered with graph_capable=False")
        plan = self._plan(plugins, architecture, config_index, source, graph="on")
        backend = Backend(plugins)
        if backend.graph_mode is None:
            pytest.skip(f"platform {backend.platform} captures no graphs")
        spies: list[RecordingGraphs] = []
        real = backend.graph_backend

        def recording() -> Any:
            spies.append(RecordingGraphs(real()))
            return spies[-1]

        backend.graph_backend = recording  # type: ignore[method-assign]
        runner = ModelRunner(backend, architecture, plan.config, plan.run.checkpoint, graph="on")
        runner.load()
        if not runner.decide().allowed:
            pytest.skip(
                f"{architecture.name}: no graph is captured here: "
                f"{runner.decision.summary() if runner.decision else ''}"
            )
        engine, request = Engine(runner), Request.greedy(plan.request.prompts, STEPS)
        before = engine.generate(request)[0].token_ids
        assert spies and spies[-1].replays, f"{architecture.name}: decode did not replay its captured graph"
        spy, model = spies[-1], runner.model
        assert model is not None
        backend.clear_graphs(model)  # raises PluginError when no hook handles the model
        assert spy.clears, f"{architecture.name}: fd_clear_graphs returned True but never cleared the graph backend"
        assert not any(spy.has(k) for k in spy.keys), (
            f"{architecture.name}: fd_clear_graphs returned True but the graphs are still captured"
        )
        key = next(iter(spy.inputs))
        try:
            spy.inner.replay(key, spy.inputs[key])
        except Exception:  # noqa: BLE001 - any refusal will do; replaying a cleared graph must not succeed
            pass
        else:
            raise AssertionError(f"{architecture.name}: a replay of {key} still ran after fd_clear_graphs")
        replays = spy.replays
        after = engine.generate(request)[0].token_ids
        assert spy.replays == replays, f"{architecture.name}: decode still replayed a graph after fd_clear_graphs"
        assert after == before, (
            f"{architecture.name}: decoding after fd_clear_graphs gives {after}, with graphs {before}"
        )

    def test_sequences_joining_a_running_batch_get_their_alone_tokens(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, source: dict[str, Any]
    ) -> None:
        """Continuous batching through the engine (graphs where allowed): prompts prefilled into their own blocks while
        others decode (two of unequal lengths together), each at its own position, one into blocks another left:
        each gives its tokens alone."""
        from fd_core.runtime.engine.loop import Engine, Job
        from fd_core.runtime.engine.sampling import SamplingParams
        from fd_core.runtime.request import Request

        if config_index:
            pytest.skip("checked on the preset only: rows and positions do not depend on the sizes")
        runner = self._runner(plugins, architecture, config_index, source, "auto")
        engine = Engine(runner, max_batch=4)
        base = list(_prompt(architecture, config_index))
        prompts = [base, base[:3], base[::-1][:4], base[1:], base[:2]]
        jobs = [
            Job(i, tuple(p), SamplingParams(max_new_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, (10, 4, 7, 6, 5), strict=True))
        ]
        alone = [engine.generate(Request((j.prompt,), j.sampling))[0].token_ids for j in jobs]
        got: dict[int, list[int]] = {}
        arrivals = {0: [0], 1: [1], 3: [2, 3], 4: [4]}
        step = 0
        while step <= max(arrivals) or engine.pending:
            for i in arrivals.get(step, []):
                engine.add(jobs[i])
            got.update({e.key: e.done.token_ids for e in engine.step() if e.done is not None})
            step += 1
        for i, job in enumerate(jobs):
            assert got[i] == alone[i], (
                f"{architecture.name}: prompt {list(job.prompt)} gives {got[i]} when it joins a running batch, "
                f"{alone[i]} alone; a row's keys and values are written or read through another row's blocks "
                f"(prefill's or decode_step's block tables, slots or positions)"
            )

    def test_a_prompt_scored_in_its_prefill_equals_one_scored_a_step(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, source: dict[str, Any]
    ) -> None:
        """A model's prefill_every (contract 1.5, optional): a prompt's logprobs scored in its prefill chunks (every
        position's logits) equal those scored a token a decode step (the path a model without it takes), position by
        position, and so do the tokens after it; chunks of 3 tokens, so that positions cross chunks."""
        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.sampling import SamplingParams
        from fd_core.runtime.request import Request

        if config_index:
            pytest.skip("checked on the preset only: positions do not depend on the sizes")
        runner = self._runner(plugins, architecture, config_index, source, "off")
        model = runner.model
        if not callable(getattr(model, "prefill_every", None)):
            pytest.skip(f"{architecture.name} has no prefill_every: its prompts are scored a token a decode step")
        prompt = tuple(list(_prompt(architecture, config_index)) * 2)
        request = Request((prompt,), SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=3))

        def scored(by_step: bool) -> Any:
            engine = Engine(runner, max_batch=2, max_prefill_tokens=3, prefix_caching=False)
            if by_step:
                engine.runner.model.prefill_every = None  # type: ignore[union-attr]
            try:
                return engine.generate(request)[0]
            finally:
                if by_step:
                    del engine.runner.model.prefill_every  # type: ignore[union-attr]

        every, step = scored(False), scored(True)
        assert every.token_ids == step.token_ids, (
            f"{architecture.name}: after a prompt scored in its prefill the tokens are {every.token_ids}, scored a "
            f"step {step.token_ids}"
        )
        assert len(every.prompt_logprobs) == len(prompt) == len(step.prompt_logprobs)
        for position, (a, b) in enumerate(zip(every.prompt_logprobs[1:], step.prompt_logprobs[1:], strict=True), 1):
            assert a.token == b.token == prompt[position]
            assert abs(a.logprob - b.logprob) <= 1e-3 and [t for t, _ in a.top] == [t for t, _ in b.top], (
                f"{architecture.name}: prefill_every scores prompt position {position} as {a.logprob:.5f} "
                f"(top {[t for t, _ in a.top]}), a decode step as {b.logprob:.5f} (top {[t for t, _ in b.top]}): "
                f"its logits [B, S, vocab] are not each position's (off by one, or padding's)"
            )

    def test_shared_prefixes_chunks_and_preemption_keep_the_tokens(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, source: dict[str, Any]
    ) -> None:
        """The paged cache's ways of saving work compute what the plain path computes (graphs where allowed), compared
        by every chosen token's logits, not only the tokens: prompts whose first blocks are found cached (a shared
        prefix) against prefix caching off; prompts prefilled 5 tokens a step beside running decodes against unchunked;
        sequences preempted when the pool runs out (and recomputed) against room for all."""
        import numpy as np

        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.sampling import SamplingParams
        from fd_core.runtime.memory import MemoryPlan
        from fd_core.runtime.request import Request

        if config_index:
            pytest.skip("checked on the preset only: blocks and chunks do not depend on the sizes")
        runner = self._runner(plugins, architecture, config_index, source, "auto")
        vocab = int(runner.config.vocab_size)
        # Tokens drawn at random: a prompt of a few repeated tokens would hold the same values at every period, and a
        # sequence reading the wrong positions of it would go unnoticed.
        draw = np.random.default_rng(0).integers(1, vocab, size=200).tolist()
        sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)

        def run(request: Request, **options: Any) -> tuple[list[list[int]], dict[int, list[Any]], Engine]:
            engine = Engine(runner, trace={}, **options)
            tokens = [c.token_ids for c in engine.generate(request)]
            assert engine.trace is not None
            return tokens, engine.trace, engine

        def differs(got: dict[int, list[Any]], want: dict[int, list[Any]]) -> str | None:
            for key, rows in want.items():
                for step, (a, b) in enumerate(zip(got[key], rows, strict=True)):
                    scale = max(1.0, float(np.abs(b).max()))
                    if float(np.abs(a - b).max()) > LOGIT_TOL * scale:
                        return f"prompt {key + 1}, token {step + 1}: logits differ by {float(np.abs(a - b).max()):.2e}"
            return None

        # Three prompts over three blocks of 16 each, the last two sharing the first's first 32 tokens.
        first = draw[:40]
        shared = Request((tuple(first), tuple(first[:32] + draw[40:49]), tuple(first[:35] + draw[49:52])), sampling)
        want_tokens, want, _ = run(shared, prefix_caching=False)
        # One at a time, so that the later prompts find the first's blocks cached.
        tokens, got, engine = run(shared, max_batch=1)
        hits = engine.kv_stats()["prefix_cache_hit_tokens"]
        assert hits == 64, (
            f"{architecture.name}: two prompts sharing 2 full blocks with the first found {hits} tokens cached"
        )
        problem = differs(got, want) or (None if tokens == want_tokens else "the tokens differ")
        assert problem is None, (
            f"{architecture.name}: with their shared prefix found cached the prompts compute something else than whole "
            f"({problem}); a sequence reads cached blocks at the wrong positions (block tables, prefix lengths)"
        )
        tokens, got, _ = run(shared, max_prefill_tokens=5, prefix_caching=False)
        problem = differs(got, want) or (None if tokens == want_tokens else "the tokens differ")
        assert problem is None, (
            f"{architecture.name}: prefilled 5 tokens a step the prompts compute something else than unchunked "
            f"({problem}); paged_prefill_attention does not see a chunk's cached prefix (prefix_lens, causal positions)"
        )
        # Three prompts of 30 tokens admitted into 2 blocks each of a pool of 6; at position 32 each needs a third: the
        # latest admitted are preempted and recomputed.
        short = Request(tuple(tuple(draw[60 + 30 * i: 90 + 30 * i]) for i in range(3)), sampling)
        want_tokens, want, _ = run(short, prefix_caching=False)
        tight = MemoryPlan(1.0, runner.config.dtype, 1, 0, 1, block_size=16, blocks=6, blocks_from="the suite")
        tokens, got, engine = run(short, memory=tight, prefix_caching=False)
        assert engine.preemptions > 0, f"{architecture.name}: a pool of 6 blocks preempted nothing"
        problem = differs(got, want) or (None if tokens == want_tokens else "the tokens differ")
        assert problem is None, (
            f"{architecture.name}: with sequences preempted and recomputed the prompts compute something else than "
            f"with room for all ({problem}); a recomputed sequence does not continue where it stopped"
        )

    def test_speculative_decoding_gives_the_tokens_of_plain_decoding(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, source: dict[str, Any]
    ) -> None:
        """Speculative decoding through the model's prefill_every (graphs where allowed for the plain steps): three
        prompts decoding together, each step's proposals their known continuation with one wrong at a changing place
        (rows accept 0 to 4 of them, or propose nothing), give plain decoding's tokens and logits, position by
        position, in fewer model steps than tokens; with n-gram proposals, the same tokens; with the model as its own
        draft (a second copy in an engine of its own), the same tokens and every proposal accepted."""
        import numpy as np

        from fd_core.runtime.engine.draft import DraftProposer
        from fd_core.runtime.engine.loop import Engine
        from fd_core.runtime.engine.sampling import SamplingParams
        from fd_core.runtime.engine.speculation import ReplayProposer, Speculation
        from fd_core.runtime.request import Request

        if config_index:
            pytest.skip("checked on the preset only: positions do not depend on the sizes")
        runner = self._runner(plugins, architecture, config_index, source, "auto")
        draft = DraftProposer(Engine(self._runner(plugins, architecture, config_index, source, "auto")))
        if not callable(getattr(runner.model, "prefill_every", None)):
            pytest.skip(f"{architecture.name} has no prefill_every, which speculative decoding verifies with")
        vocab = int(runner.config.vocab_size)
        draw = np.random.default_rng(1).integers(1, vocab, size=60).tolist()
        # The last prompt quotes itself, so that n-gram proposals find something.
        prompts = (tuple(draw[:30]), tuple(draw[30:35]), tuple(draw[35:47] + draw[35:47]))
        request = Request(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
        plain = Engine(runner, trace={})
        want = [c.token_ids for c in plain.generate(request)]
        known = dict(zip(prompts, want, strict=True))
        for proposer in (ReplayProposer(known, wrong=(1, 2, 0, 9, 3)), None, draft):
            engine = Engine(runner, trace={}, speculation=Speculation("ngram", 4))
            if proposer is not None:
                engine.proposer = proposer
            got = [c.token_ids for c in engine.generate(request)]
            how = ("n-gram proposals" if proposer is None else "the model as its own draft" if proposer is draft
                   else "proposals right and wrong at changing places")
            assert got == want, (
                f"{architecture.name}: speculative decoding ({how}) gives {got}, plain decoding {want}; the verify "
                f"step (prefill_every over the cached prefix at positions batch.starts, the proposals' slots) "
                f"computes something else than a decode step"
            )
            if proposer is draft:
                assert 0 < engine.spec_accepted == engine.spec_proposed, (
                    f"{architecture.name}: as its own draft the model had {engine.spec_accepted} of "
                    f"{engine.spec_proposed} proposals accepted; a model must agree with itself"
                )
            elif proposer is not None:
                assert 0 < engine.spec_accepted < engine.spec_proposed and engine.spec_steps < sum(map(len, want))
                assert engine.trace is not None and plain.trace is not None
                for key, rows in plain.trace.items():
                    for step, (a, b) in enumerate(zip(engine.trace[key], rows, strict=True)):
                        error = float(np.abs(a - b).max())
                        assert error <= LOGIT_TOL * max(1.0, float(np.abs(b).max())), (
                            f"{architecture.name}: speculative decoding's logits of prompt {key + 1}, token {step + 1} "
                            f"differ from plain decoding's by {error:.2e}"
                        )

    def test_reload_cycles_keep_the_tokens(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, source: dict[str, Any]
    ) -> None:
        """`fd run --reload-cycles 2` (graphs on where allowed): clear, release, load, capture again; the same tokens
        each cycle."""
        from fd_core.runtime.job import run_plan

        graph = "on" if architecture.graph_capable else "off"
        plan = self._plan(plugins, architecture, config_index, source, graph=graph, reload_cycles=2)
        try:
            result = run_plan(plan, plugins)[0]
        except RankError as exc:  # run_plan's reload guard: a cycle changed the tokens
            raise AssertionError(
                f"{architecture.name}: {exc}; release_weights/load_weights do not restore the same weights"
            ) from None
        assert [c["tokens_match"] for c in result["reload_cycles"]] == [True, True]
        assert result["tokens"] == self._tp1(plugins, architecture, config_index, source, "off")["tokens"]

    def test_save_random_checkpoint_reloads_the_same_tokens(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, source: dict[str, Any], tmp_path: Path
    ) -> None:
        """`fd save-random` writes the seeded weights in the published layout; `fd run --checkpoint` gives the seeded
        run's tokens."""
        from fd_core.runtime.job import run_plan
        from fd_core.runtime.save_random import save_random_checkpoint

        if config_index != 0:
            pytest.skip("the config's runs are already from a save-random checkpoint")
        want = self._tp1(plugins, architecture, config_index, source, "off")["tokens"]
        directory = _names(
            save_random_checkpoint(architecture.name, str(tmp_path / "checkpoint"), seed=0), architecture
        )
        got = run_plan(
            self._plan(plugins, architecture, 0, {"model": None, "checkpoint": str(directory)}, graph="off"), plugins
        )[0]["tokens"]
        assert got == want, (
            f"{architecture.name}: the checkpoint fd save-random wrote loads back to {got}, the seeded weights give "
            f"{want}; a tensor is saved under a name, shape or layout that loads differently (or is ignored on load)"
        )

    def reference_case(self, architecture: Architecture, config_index: int) -> dict[str, Any]:
        """A tiny random model built by transformers and saved as it saves one: its greedy tokens and every step's
        logits (each step running the whole sequence, no cache), once per session; skips when no reference is
        here."""
        try:
            import torch
            import transformers
        except ImportError as exc:
            pytest.skip(
                f"{NOT_VERIFIED} the reference needs transformers and torch (its host-only build), which are not "
                f"installed here ({exc}); {install_hint('test')}"
            )
        name = reference_class(architecture, transformers)
        if name is None:
            pytest.skip(
                f"{NOT_VERIFIED} {architecture.name} names no reference class that transformers defines "
                f"(set Architecture.reference)"
            )
        model_cls = getattr(transformers, name, None)
        if model_cls is None:
            pytest.skip(f"{NOT_VERIFIED} transformers {transformers.__version__} has no {name}")

        def build() -> dict[str, Any]:
            data = dict(_config_data(architecture, config_index))
            prompt = list(_prompt(architecture, config_index))
            torch.set_num_threads(1)
            best = 0.0
            for seed in REFERENCE_SEEDS:
                model = _reference_model(torch, model_cls, data, seed)
                tokens, logits, margin = _reference_greedy(torch, model, prompt)
                best = max(best, margin)
                if margin > MIN_MARGIN:
                    break
            else:
                raise AssertionError(
                    f"no seed of {list(REFERENCE_SEEDS)} keeps the reference's top-2 logits {MIN_MARGIN:g} apart "
                    f"(best {best:.2e}); widen initializer_range in the preset"
                )
            scratch = Path(tempfile.mkdtemp(prefix=f"fd-reference-{architecture.name}-"))
            atexit.register(shutil.rmtree, scratch, ignore_errors=True)
            directory = scratch / "reference"
            model.save_pretrained(str(directory))
            for file_name, content in architecture.preset_files.items():
                (directory / file_name).write_text(json.dumps(dict(content)))
            _names(directory, architecture)
            return {"name": name, "seed": seed, "directory": directory, "prompt": prompt, "tokens": tokens,
                    "logits": logits}

        return dict(_cached((architecture.name, config_index, "building the transformers reference"), build))

    def _logits_along(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, reference: Mapping[str, Any],
        steps: int, **settings: Any,
    ) -> tuple[list[int], list[Any]]:
        """`fd run --tp 1`'s greedy tokens on the reference checkpoint, then its logits at each of `steps` steps along
        the reference's own tokens (each prefix prefilled again into the engine's cache once the run is done)."""
        import numpy as np

        from fd_core.kvcache import KVBatch
        from fd_core.runtime.session import Session

        source = {"model": None, "checkpoint": str(reference["directory"])}
        plan = self._plan(plugins, architecture, config_index, source, graph="auto", **settings)
        with Session(plan, plugins) as session:  # what `fd run --tp 1` runs
            got = session.generate(plan.request)[0].token_ids
            assert session.worker is not None
            model, block_size = session.worker.runner.model, session.worker.runner.block_size
        assert model is not None
        sequence = [*reference["prompt"], *reference["tokens"]]
        logits = []
        for step in range(steps):
            ids = sequence[: len(reference["prompt"]) + step]
            batch = KVBatch.contiguous(1, 0, len(ids), block_size, -(-len(ids) // block_size))
            out = model.prefill(np.asarray([ids], dtype="int64"), None, batch).astype("float32").numpy()[0]
            logits.append(np.asarray(out, dtype=np.float64))
        return got, logits

    def test_reference_greedy_tokens(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, tmp_path: Path | None = None
    ) -> None:
        """A tiny random model built and saved by transformers gives the reference's first-step logits (to rounding) and
        greedy tokens through `fd run`'s path. (`tmp_path` is unused, kept for callers of the 1.0 signature: the
        reference checkpoint is saved once a session, in reference_case.)"""
        import numpy as np

        reference = self.reference_case(architecture, config_index)
        name, seed, tokens = reference["name"], reference["seed"], reference["tokens"][:STEPS]
        got, [ours] = self._logits_along(plugins, architecture, config_index, reference, 1)
        first = reference["logits"][0]
        scale = max(1.0, float(np.abs(first).max()))
        worst = float(np.abs(ours - first).max())
        assert worst <= LOGIT_TOL * scale, (
            f"{architecture.name}: on a checkpoint saved by transformers' {name} (seed {seed}) fd's first-step logits "
            f"differ from the reference's by {worst:.2e} (tolerance {LOGIT_TOL * scale:.1e}); the model computes "
            f"something else than the reference (rotary layout, norms, biases, a weight's layout)"
        )
        assert got == tokens, (
            f"{architecture.name}: on a checkpoint saved by transformers' {name} (seed {seed}) fd gives {got}, the "
            f"reference {tokens}; the model computes something else than the reference (rotary layout, norms, biases, "
            f"a weight's layout)"
        )

    @pytest.mark.parametrize("scheme", list(QUALITY_BOUNDS))
    def test_quantized_logits_stay_near_the_reference(
        self, plugins: PluginSet, architecture: Architecture, config_index: int, scheme: str,
        record_property: Any,
    ) -> None:
        """Weight-only quantization on the reference checkpoint, against transformers' float32 logits: at each of
        QUALITY_STEPS steps along the reference's greedy tokens, the cosine similarity of the two logit vectors and
        whether their argmax agrees; the worst cosine and the share agreeing must stay within QUALITY_BOUNDS (the
        figures are `fd check --model`'s detail for this check)."""
        import numpy as np

        if not architecture.quantizable:
            pytest.skip(f"{architecture.name} does not quantize its weights (its Architecture is not quantizable=True)")
        reference = self.reference_case(architecture, config_index)
        _, ours = self._logits_along(plugins, architecture, config_index, reference, QUALITY_STEPS,
                                     quantization=scheme)
        theirs = reference["logits"]
        cosines = [float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) for a, b in zip(ours, theirs, strict=True)]
        agree = sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(ours, theirs, strict=True)) / len(ours)
        least, least_mean, least_agree = QUALITY_BOUNDS[scheme]
        mean = float(np.mean(cosines))
        figures = (f"{scheme}: logits cosine min {min(cosines):.5f}, mean {mean:.5f}; greedy agreement {agree:.0%} "
                   f"over {len(ours)} steps")
        record_property("figures", figures)
        assert min(cosines) >= least and mean >= least_mean and agree >= least_agree, (
            f"{architecture.name} under --quantization {scheme}: {figures}, against transformers' float32 reference "
            f"({reference['name']}, seed {reference['seed']}); the bounds are cosine min >= {least}, mean >= "
            f"{least_mean} and agreement >= {least_agree:.0%}: the quantizer or the quant_matmul kernel loses more "
            f"than weight-only quantization should"
        )


def _names(directory: Path, arch: Architecture) -> Path:
    """The checkpoint's config.json made to name the architecture under test: its published class name
    (`architectures`) may be an alias another registered architecture holds (a variant of the same model)."""
    path = Path(directory) / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "architectures": [arch.name]}))
    return Path(directory)


def _reference_model(torch: Any, model_cls: Any, data: Mapping[str, Any], seed: int) -> Any:
    """transformers' model of the config, seeded; parameters it initialises to zero (biases, say) made random so that
    they count."""
    torch.manual_seed(seed)
    config = model_cls.config_class(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})
    model = model_cls(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() and not param.abs().sum():
                param.copy_(torch.randn_like(param) * 0.05)
    return model


def _reference_greedy(torch: Any, model: Any, prompt: list[int]) -> tuple[list[int], list[Any], float]:
    """QUALITY_STEPS greedy tokens, each step running the whole sequence (no cache: nothing shared with fd's path),
    every step's logits, and the smallest top-2 margin over the first STEPS (the steps the greedy check compares)."""
    ids, margin, every = list(prompt), float("inf"), []
    with torch.no_grad():
        for step in range(max(STEPS, QUALITY_STEPS)):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            every.append(logits.numpy().astype("float64"))
            if step < STEPS:
                top2 = torch.topk(logits, 2).values
                margin = min(margin, float(top2[0] - top2[1]))
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], every, margin


class RecordingGraphs:
    """The platform's graph backend, with its calls counted and each key's last inputs kept."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.mode = inner, inner.mode
        self.keys: set[Any] = set()
        self.inputs: dict[Any, Any] = {}
        self.replays = self.clears = 0

    def capture(self, key: Any, fn: Any, inputs: Any) -> None:
        self.keys.add(key)
        self.inputs[key] = inputs
        self.inner.capture(key, fn, inputs)

    def replay(self, key: Any, inputs: Any) -> Any:
        self.replays += 1
        self.inputs[key] = inputs
        return self.inner.replay(key, inputs)

    def has(self, key: Any) -> bool:
        return bool(self.inner.has(key))

    def clear(self) -> None:
        self.clears += 1
        self.inner.clear()

