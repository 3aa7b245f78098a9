"""One rank's side of a run: from the plan it received, its plugins, backend, model loaded and decided, its
generation engine, and what it reports (timings, memory) when asked."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fd_core.config import ParallelConfig
from fd_core.detection import DEFAULT_KV_BLOCK_SIZE
from fd_core.errors import PlatformError
from fd_core.host.backend import Backend, load_backend
from fd_core.host.loading import PluginSet, load_plugins
from fd_core.lifecycle import EndReason, RankContext
from fd_core.runtime import progress
from fd_core.runtime.engine.loop import Engine
from fd_core.runtime.engine.runner import ModelRunner
from fd_core.runtime.kernel_checks import kernel_canary
from fd_core.runtime.memory import local_rank, local_ranks
from fd_core.runtime.plan import Plan, plugin_env
from fd_core.runtime.procstats import peak_resident_bytes, resident_bytes
from fd_core.runtime.report import capture_report


@dataclass
class RankWorker:
    """A rank with its model loaded and its graph decision made, ready to generate."""

    rank: int
    tp: int
    plan: Plan
    backend: Backend
    runner: ModelRunner
    engine: Engine
    log: Callable[[str], None]
    context: RankContext
    # When the run's clock started (fd's own start, else this rank's), and what the rank held on entry.
    started: float = 0.0
    entry_rss: int = 0
    reports: dict[str, Any] = field(default_factory=dict)
    ended: bool = False

    @classmethod
    def start(
        cls, plan: Plan, rank: int = 0, tp: int = 1, group: Any = None, *, plugins: PluginSet | None = None,
        backend: Backend | None = None, before: Mapping[str, float] | None = None,
        on_started: Callable[[Backend, RankContext], None] | None = None,
    ) -> "RankWorker":
        """Select the platform, load the planned model and decide on graphs; progress lines from rank 0.

        `plugins` are the planning process's own (a rank in it discovers none again; `backend`, its
        Backend, when this rank's parallel layout is the planning one's); a rank in another process
        discovers them once. `before` holds phases the caller timed before this (the rendezvous), and
        their start as "at".
        """
        entered = time.time()
        # What this rank holds before any work of its own: a forked rank shares its parent's imports
        # and holds less than a freshly started process that imported paddle.
        entry_rss = resident_bytes()
        run = plan.run
        if plugins is None:
            progress.report("loading plugins")
            try:
                # The others' detections were asked in planning.
                plugins = load_plugins(plugin_env(run.platform), planned=plan.platform)
            except PlatformError as exc:
                # Only the planned platform is asked again: its detection said yes in planning and no here.
                raise PlatformError(
                    f"rank {rank}: the run was planned on {plan.platform!r}, which this rank could not select ({exc}); "
                    f"a platform's fd_platform_detect must answer the same every time (or force one with FD_PLATFORM)"
                ) from None
        parallel = ParallelConfig(tp_size=tp, tp_rank=rank, group=group)
        if backend is None or backend.parallel != parallel:
            backend = load_backend(parallel, plugins=plugins)
        if backend.platform != plan.platform:
            # Detection that answers differently from one call to the next would run ranks on two platforms.
            raise PlatformError(
                f"rank {rank} selected platform {backend.platform!r}, but the run was planned on {plan.platform!r}; "
                f"a platform's fd_platform_detect must answer the same every time (or force one with FD_PLATFORM)"
            )
        arch = plan.architecture(plugins)
        if backend.detection.device:
            import paddle

            # The device type the platform named: a host platform on a machine with a device build of
            # paddle still runs on the host; a device type without an index resolves to the device the
            # launcher selected for this rank (paddle reads it from the rank's environment).
            paddle.set_device(backend.detection.device)
        threads = plan.threads
        context = RankContext(
            rank=rank, world_size=tp, local_rank=local_rank(rank, tp), local_world_size=local_ranks(tp),
            platform=backend.platform, device=backend.detection.device, model=arch.name, dtype=plan.config.dtype,
            threads=threads.per_rank if threads is not None else 1,
            threads_chosen=threads.chosen if threads is not None else False,
        )
        # The platform's own start of the rank (a device bound, a runtime started, thread pools sized), after fd
        # selected the device type and before any tensor of the run: its failure stops the rank, named, and every
        # plugin's fd_rank_end still runs (a start may have half happened).
        try:
            backend.rank_start(context)
            if on_started is not None:  # whoever ends this rank on a signal (serve_rank) learns what to end
                on_started(backend, context)
            worker = cls._load(plan, rank, tp, backend, arch, context, entered, entry_rss, before)
            if run.kv_transport is not None:
                assert run.kv_listen is not None, "plan_run names the instance's transfer address"
                factory, _ = plugins.transports[run.kv_transport]
                worker.engine.transport = factory(run.kv_listen, rank)
                worker.engine.transfer_timeout = run.kv_timeout
            return worker
        except BaseException as exc:
            backend.rank_end(context, end_reason(exc))
            raise

    @classmethod
    def _load(
        cls, plan: Plan, rank: int, tp: int, backend: Backend, arch: Any, context: RankContext, entered: float,
        entry_rss: int, before: Mapping[str, float] | None,
    ) -> "RankWorker":
        """The rest of start(), once the platform started the rank."""
        run = plan.run

        def log(message: str) -> None:
            if rank == 0 and run.progress:
                print(f"fd: {message}", file=sys.stderr, flush=True)

        # Before any weight is read: a platform whose all-reduce does not sum stops the run here.
        progress.report("checking the all-reduce")
        backend.check_collective()
        runner = ModelRunner(backend, arch, plan.config, run.checkpoint, run.seed, run.graph, log, run.allow_non_finite)
        # Start-up as phases, in the order they happened: the process's start, imports and the plan up to
        # starting the ranks ("start"); starting them ("spawn"); the rendezvous; then plugin discovery and
        # the backend on this rank ("setup").
        before = dict(before or {})
        started = run.started_at if run.started_at is not None else entered
        rank_start = before.pop("at", entered)
        spawned = run.spawned_at if run.spawned_at is not None else rank_start
        early: dict[str, float] = {}
        if run.started_at is not None or run.spawned_at is not None:
            early["start"] = max(0.0, spawned - started)
        if run.spawned_at is not None:
            early["spawn"] = max(0.0, rank_start - spawned)
        runner.timings = {**early, **before, "setup": time.time() - entered}
        log(f"loading {arch.name} ({run.checkpoint or 'seeded random weights'}) on {backend.platform}, tp={tp}")
        if run.kernel_canary:
            _kernel_canary(runner, plan, context)
        progress.report("loading weights")
        runner.load()
        log(f"loaded {arch.name} on {backend.platform} (tp={tp}) in {runner.timings['load']:.2f}s")
        runner.decide()
        tokenizer = plan.checkpoint.tokenizer_if_any() if plan.checkpoint is not None else None
        settings = plan.settings
        assert settings is not None, "plan_run resolves the settings"
        engine = Engine(runner, tokenizer, settings.max_batch, memory=plan.memory, rank=context,
                        max_prefill_tokens=settings.max_prefill_tokens,
                        max_prefill_prompts=settings.max_prefill_prompts, prefix_caching=run.prefix_caching,
                        speculation=run.speculation, proposer=_draft_proposer(plan, backend, context, log))
        return cls(rank, tp, plan, backend, runner, engine, log, context, started, entry_rss)

    def end(self, reason: EndReason = "normal") -> None:
        """The rank ends: the platform's fd_rank_end (bounded in time), once."""
        if not self.ended:
            self.ended = True
            if self.engine.transport is not None:
                self.engine.transport.close()
            self.backend.rank_end(self.context, reason)

    def reload(self) -> None:
        """A weight update on this rank: graphs cleared, weights released, cleaned, loaded again; cached prefixes
        forgotten (their keys and values came from the old weights)."""
        self.runner.reload()
        self.engine.forget_prefixes()

    def describe(self) -> dict[str, Any]:
        """What a caller reads back: platform, model, graph decision, all-reduce binding and timings so far."""
        assert self.runner.decision is not None
        return {
            "rank": self.rank,
            "platform": self.backend.platform,
            "model": self.plan.model,
            "tp": self.tp,
            "graph": self.runner.decision.to_dict(),
            "capture": capture_report(self.engine.capture_sizes, self.engine.max_batch, self.engine.eager_steps),
            "all_reduce": self.backend.all_reduce_binding,
            "kernels": self.backend.kernels.providers(),
            "timings_s": {k: round(v, 4) for k, v in self._timings().items()},
            "dtype": self.plan.config.dtype,
            "quantization": self.plan.config.quantization,
            "quantization_group": self.plan.config.quantization_group if self.plan.config.quantization else None,
            "float_embeddings": self.plan.config.float_embeddings,
            "threads": self.plan.threads.to_dict() if self.plan.threads is not None else None,
            "memory": self.plan.memory.to_dict() if self.plan.memory is not None else None,
            "kv_cache": self.engine.kv_stats(),
            "speculative": self.engine.speculation_stats(),
        }

    def _timings(self) -> dict[str, float]:
        """The runner's phases, and the eager steps that checked each captured graph's first replay."""
        checked = getattr(self.runner.graphs, "seconds", 0.0)
        return {**self.runner.timings, **({"replay_check": checked} if checked else {})}

    def report(self) -> dict[str, Any]:
        """describe(), with this rank's speed, time to first token (from the run's start) and memory."""
        engine, model = self.engine, self.runner.model
        assert model is not None
        first_token_s = (engine.first_token_at or time.time()) - self.started
        return {
            **self.describe(),
            # What the memory target compares the peak with: this rank's weights (as held: prepared or quantized ones
            # in buffers, their parameters released) and KV cache.
            "weight_bytes": _held_bytes(model),
            "kv_cache_bytes": getattr(model, "cache_bytes", lambda: 0)(),
            "entry_rss_bytes": self.entry_rss,
            "tokens_per_s": round(engine.tokens_per_s, 2),
            "time_to_first_token_s": round(first_token_s, 4),
            "decode_core_share": round(engine.decode_core_s / engine.decode_s, 3) if engine.decode_s > 0 else None,
            "decode_step_ms": _step_breakdown(engine),
            "finished_at": time.time(),
            "rss_bytes": resident_bytes(),
            "peak_rss_bytes": peak_resident_bytes(),
        }


def end_reason(error: BaseException | None) -> EndReason:
    """How a rank that stopped on `error` ended: a stop signal or an interrupt is "signal", any other error "error"."""
    from fd_core.runtime.ranks.spawn import Terminated

    if error is None:
        return "normal"
    return "signal" if isinstance(error, (Terminated, KeyboardInterrupt)) else "error"


def _kernel_canary(runner: ModelRunner, plan: Plan, context: RankContext) -> None:
    """The model built (not loaded) and the non-native kernels it and the engine call checked against fd's native ops
    (kernel_checks.kernel_canary), each timed as a phase: before any weight is read, a kernel that differs stops the
    rank in one line instead of giving plausible, wrong tokens."""
    progress.report("checking the kernels against fd's native ops")
    begin = time.perf_counter()
    # What runner.load() would build first; built here, the model tells which optional ops it calls (experts, a tower).
    model = runner.model = runner.arch.build_model(runner.config, runner.backend)
    runner.add_time("build", time.perf_counter() - begin)
    begin = time.perf_counter()
    block_size = plan.memory.block_size if plan.memory is not None else DEFAULT_KV_BLOCK_SIZE
    kernel_canary(runner.backend.ops, runner.backend.platform, runner.config, block_size, tp=context.world_size,
                  threads=context.threads, model=model, speculative=plan.run.speculation is not None)
    runner.add_time("kernel_canary", time.perf_counter() - begin)


def _draft_proposer(plan: Plan, backend: Backend, context: RankContext, log: Any) -> Any:
    """Speculative decoding's draft model loaded on this rank beside the model, in an engine of its own with as many
    cache blocks as the model's (the memory plan counts both); None without a draft."""
    draft = plan.draft
    if draft is None:
        return None
    from fd_core.runtime.engine.draft import DraftProposer

    run, settings = plan.run, plan.settings
    assert settings is not None
    arch = backend.plugins.registry.get(draft.model)
    directory = run.draft_checkpoint
    log(f"loading the draft model {arch.name} ({directory}) on {backend.platform}")
    progress.report("loading the draft model")
    runner = ModelRunner(backend, arch, draft.config, directory, run.seed, run.graph, log, run.allow_non_finite,
                         graph_namespace="draft")
    runner.load()
    runner.decide()
    engine = Engine(runner, None, settings.max_batch, memory=plan.memory, rank=context,
                    max_prefill_tokens=settings.max_prefill_tokens, prefix_caching=True)
    return DraftProposer(engine)


def _held_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers that hold storage."""
    tensors = [*model.parameters(), *getattr(model, "buffers", lambda: [])()]
    return sum(t.numel().item() * t.element_size() for t in tensors if t._is_initialized())


def _step_breakdown(engine: Engine) -> dict[str, float] | None:
    """A decode step's milliseconds: the whole, choosing the token (the non-finite check and sampling), and the model
    step with the loop around it."""
    if not engine.choose_calls or engine.decode_s <= 0:
        return None
    steps = max(1, engine.choose_calls - 1)  # the first choice (of the prefill's logits) is not decode time
    choose = engine.choose_s * steps / engine.choose_calls
    return {"step": round(engine.decode_s / steps * 1e3, 3), "choose": round(choose / steps * 1e3, 3),
            "model_and_loop": round((engine.decode_s - choose) / steps * 1e3, 3)}
