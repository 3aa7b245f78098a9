"""One rank's side of a run: from the plan it received, its plugins, backend, model loaded and decided,
and its generation engine."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from fd_core.config import ParallelConfig
from fd_core.errors import PlatformError
from fd_core.host.backend import Backend, load_backend
from fd_core.host.loading import PluginSet, load_plugins
from fd_core.host.output import fd_stdout
from fd_core.runtime import progress
from fd_core.runtime.engine.loop import Completion, Engine
from fd_core.runtime.engine.runner import ModelRunner
from fd_core.runtime.plan import Plan, plugin_env
from fd_core.runtime.request import Request
from fd_core.runtime.threads import apply_threads


def print_text(index: int, text: str) -> None:
    """Stream new text to stdout as it is produced (rank 0 of an interactive run)."""
    out = fd_stdout()  # the real stdout: what plugins print goes to stderr meanwhile
    out.write(text)
    out.flush()


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

    @classmethod
    def start(
        cls, plan: Plan, rank: int = 0, tp: int = 1, group: Any = None, entered: float | None = None, plugins: PluginSet | None = None
    ) -> "RankWorker":
        """Select the platform, load the planned model and decide on graphs; progress lines from rank 0.

        `plugins` are the planning process's own (a rank in it discovers none again); a rank in another
        process discovers them once. `entered` (time.time()) is when this rank's work began: the time up
        to the model's build is its "setup" phase.
        """
        entered = time.time() if entered is None else entered
        run = plan.run
        if plugins is None:
            progress.report("loading plugins")
            try:
                plugins = load_plugins(plugin_env(run.platform), planned=plan.platform)  # the others' detections were asked in planning
            except PlatformError as exc:
                # Only the planned platform is asked again: its detection said yes in planning and no here.
                raise PlatformError(
                    f"rank {rank}: the run was planned on {plan.platform!r}, which this rank could not select ({exc}); "
                    f"a platform's fd_platform_detect must answer the same every time (or force one with FD_PLATFORM)"
                ) from None
        backend = load_backend(ParallelConfig(tp_size=tp, tp_rank=rank, group=group), plugins=plugins)
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
        if plan.threads is not None:
            # The plan's compute threads per rank (fd_core.runtime.threads.decide_threads), before any weight is read.
            apply_threads(plan.threads)

        def log(message: str) -> None:
            if rank == 0 and run.progress:
                print(f"fd: {message}", file=sys.stderr, flush=True)

        # Before any weight is read: a platform whose all-reduce does not sum stops the run here.
        progress.report("checking the all-reduce")
        backend.check_collective()
        runner = ModelRunner(backend, arch, plan.config, run.checkpoint, run.seed, run.graph, log, run.allow_non_finite)
        runner.timings["setup"] = time.time() - entered
        log(f"loading {arch.name} ({run.checkpoint or 'seeded random weights'}) on {backend.platform}, tp={tp}")
        progress.report("loading weights")
        runner.load()
        log(f"loaded {arch.name} on {backend.platform} (tp={tp}) in {runner.timings['load']:.2f}s")
        runner.decide()
        tokenizer = plan.checkpoint.tokenizer_if_any() if plan.checkpoint is not None else None
        return cls(rank, tp, plan, backend, runner, Engine(runner, tokenizer, run.max_batch, memory=plan.memory, threads=plan.threads), log)

    def generate(self, request: Request, on_text: Callable[[int, str], None] | None = None) -> list[Completion]:
        """Every prompt's completion; progress lines around it."""
        self.log(f"generating for {len(request.prompts)} prompt(s)")
        outputs = self.engine.generate(request, on_text)
        self.log(f"generated {sum(len(c.token_ids) for c in outputs)} tokens at {self.engine.tokens_per_s:.1f} tokens/s")
        return outputs

    def describe(self) -> dict[str, Any]:
        """What a caller reads back: platform, model, graph decision, all-reduce binding and timings so far."""
        assert self.runner.decision is not None
        return {
            "rank": self.rank,
            "platform": self.backend.platform,
            "model": self.plan.model,
            "tp": self.tp,
            "graph": self.runner.decision.to_dict(),
            "all_reduce": self.backend.all_reduce_binding,
            "kernels": self.backend.kernels.providers(),
            "timings_s": {k: round(v, 4) for k, v in self.runner.timings.items()},
            "dtype": self.plan.config.dtype,
            "threads": self.plan.threads.to_dict() if self.plan.threads is not None else None,
            "memory": self.plan.memory.to_dict() if self.plan.memory is not None else None,
        }
