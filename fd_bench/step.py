"""Where a decode step's time goes: the model loaded as `fd run` loads it (RankWorker, the engine's own loop), its
layers' calls timed in place, each call's time counted once (a call's own time, less the timed calls inside it).

    python -m fd_bench.step CHECKPOINT TP STEPS PROMPT_IDS [GRAPH [THREADS [BATCH]]]

BATCH copies of the prompt decode together (default 1). Prints one JSON line per rank 0: milliseconds a decode
step in each part, the step's total and the
all-reduce's own waits (cpu platform). Eager unless GRAPH is "on" (a static program hides its ops:
only the step's total is timed then). `fd bench --rows step` runs it at tp=1 and tp=2.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from typing import Any, Callable

# The parts, in the order they are printed; "other" is the step less every timed part.
PARTS = {
    "linear": "matrix work: q/k/v/o and MLP projections",
    "lm_head": "LM head and logits",
    "embedding": "embedding",
    "attention": "attention op",
    "rotary": "rotary op",
    "norm": "RMSNorm op",
    "silu_mul": "silu and multiply op",
    "kv_write": "KV-cache writes",
    "all_reduce": "all-reduce (its own code, waits included)",
    "sample": "sampling and the non-finite check",
    "other": "the rest: Python, op dispatch, residual adds, reshapes, mask and rope tables",
}


class StepTimer:
    """Exclusive time per part: a timed call's time less the timed calls it made."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._inner: list[float] = []
        self.active = False
        self.generating = False
        self.shm: dict[str, float] = {}

    def wrap(self, owner: Any, attr: str, part: str) -> None:
        """Replace `owner.attr` (an instance's callable attribute) with a timed call of it; nothing when the owner has
        none (an older tree's layer, run for a comparison)."""
        if not hasattr(owner, attr):
            return
        fn: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            # Inside a decode step; the sampling between steps (of the previous step's logits) while generating.
            if not (self.active or (part == "sample" and self.generating)):
                return fn(*args, **kwargs)
            start = time.perf_counter()
            self._inner.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                inner = self._inner.pop()
                self.seconds[part] += spent - inner
                self.calls[part] += 1
                if self._inner:
                    self._inner[-1] += spent

        setattr(owner, attr, timed)


def instrument(worker: Any, timer: StepTimer) -> Callable[[], float]:
    """Time every part of `worker`'s model in place; returns a function giving the decode steps' total seconds."""
    from fd_core.runtime.engine import loop as engine
    from fd_models.layers.attention import Attention
    from fd_models.layers.mlp import SwiGLUMLP
    from fd_models.layers.norm import RMSNorm
    from fd_models.layers.parallel import (
        ColumnParallelLinear,
        ParallelLMHead,
        ReplicatedLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    model = worker.runner.model
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
            timer.wrap(layer, "forward", "linear")
        elif isinstance(layer, ParallelLMHead):
            timer.wrap(layer, "forward", "lm_head")
        elif isinstance(layer, VocabParallelEmbedding):
            timer.wrap(layer, "forward", "embedding")
        elif isinstance(layer, Attention):
            timer.wrap(layer, "paged_attention", "attention")
            timer.wrap(layer, "paged_prefill_attention", "attention")
            timer.wrap(layer, "paged_packed_attention", "attention")
            timer.wrap(layer, "write_kv_cache", "kv_write")
            timer.wrap(layer, "rotary_embedding", "rotary")
            if layer.fused:  # its projections are its own matrices, not linear layers
                timer.wrap(layer, "qkv_product", "linear")
                timer.wrap(layer, "o_product", "linear")
        elif isinstance(layer, RMSNorm):
            timer.wrap(layer, "rms_norm", "norm")
        elif isinstance(layer, SwiGLUMLP):
            timer.wrap(layer, "silu_and_mul", "silu_mul")
            if layer.fused:  # its projections are its own matrices, not linear layers
                timer.wrap(layer, "gate_up_product", "linear")
                timer.wrap(layer, "down_product", "linear")
    timer.wrap(worker.backend, "all_reduce", "all_reduce")
    timer.wrap(engine, "check_finite", "sample")
    timer.wrap(worker.backend.ops, "sample", "sample")
    steps = {"seconds": 0.0, "count": 0}
    decode = model.decode_step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        if not timer.generating:
            return decode(*args, **kwargs)
        timer.active = True
        before = _shm_stats()
        start = time.perf_counter()
        try:
            return decode(*args, **kwargs)
        finally:
            steps["seconds"] += time.perf_counter() - start
            steps["count"] += 1
            timer.active = False
            after = _shm_stats()
            if before is not None and after is not None:  # the all-reduce's own counters, decode steps only
                for key in ("calls", "waits", "wait_s", "slept_s"):
                    timer.shm[key] = timer.shm.get(key, 0) + after[key] - before[key]

    model.decode_step = timed_step
    return lambda: steps["seconds"]


def _shm_stats() -> dict[str, Any] | None:
    try:
        from fd_plugins.cpu.shm import group_state
    except ImportError:
        return None
    state = group_state(None)
    return None if state is None else state.stats()


def measure_rank(plan: Any, rank: int = 0, tp: int = 1, group: Any = None) -> dict[str, Any]:
    """One rank's breakdown: load as fd run does, time a first generation's decode (warm-up), then a second one's."""
    from fd_core.runtime.ranks.worker import RankWorker

    worker = RankWorker.start(plan, rank, tp, group)
    worker.engine.generate(plan.request)  # warm-up: first calls, allocations
    timer = StepTimer()
    total = instrument(worker, timer)
    timer.generating = True
    engine = worker.engine
    decoded, spent, core = engine.decoded_tokens, engine.decode_s, engine.decode_core_s
    out = worker.engine.generate(plan.request)
    timer.generating = False
    steps = plan.request.sampling.max_new_tokens - 1
    step_s = total() / max(1, steps)
    parts = {k: v / max(1, steps) * 1e3 for k, v in timer.seconds.items()}
    # Every step samples once, the last one included (its logits come from the last decode step):
    # per decode step, one sampling.
    if "sample" in parts:
        parts["sample"] *= steps / (steps + 1)
    # The sample op and the finite check run outside decode_step (on the previous step's logits): add them to the step.
    inside = sum(v for k, v in parts.items() if k != "sample")
    parts["other"] = step_s * 1e3 - inside
    result: dict[str, Any] = {
        "rank": rank,
        "tp": tp,
        "threads": plan.threads.per_rank if plan.threads is not None else None,
        "graph": worker.runner.decision.summary() if worker.runner.decision is not None else None,
        "step_ms": step_s * 1e3 + parts.get("sample", 0.0),
        "parts_ms": {k: round(parts.get(k, 0.0), 4) for k in PARTS},
        "calls_per_step": {k: v / max(1, steps) for k, v in timer.calls.items()},
        "tokens_per_s": (engine.decoded_tokens - decoded) / max(1e-9, engine.decode_s - spent),
        "core_share": (engine.decode_core_s - core) / max(1e-9, engine.decode_s - spent),
        "tokens": out[0].token_ids,
    }
    if timer.shm:
        result["shm"] = {
            "calls_per_step": timer.shm["calls"] / max(1, steps),
            "wait_ms_per_step": timer.shm["wait_s"] / max(1, steps) * 1e3,
            "slept_ms_per_step": timer.shm["slept_s"] / max(1, steps) * 1e3,
            "waits_per_step": timer.shm["waits"] / max(1, steps),
        }
    return result


def spawned(plan: Any) -> dict[str, Any]:
    """A spawned rank's breakdown."""
    from fd_core.runtime.ranks.spawn import init_rank

    rank, world = init_rank()
    return measure_rank(plan, rank, world)


def main(argv: list[str]) -> int:
    from fd_core.host.paddle_logs import quiet_paddle_logs
    from fd_core.runtime.plan import RunConfig, plan_run
    from fd_core.runtime.ranks.spawn import spawn_ranks

    quiet_paddle_logs()
    checkpoint, tp, steps, prompt = argv[0], int(argv[1]), int(argv[2]), tuple(int(t) for t in argv[3].split(","))
    graph = argv[4] if len(argv) > 4 else "off"
    threads = int(argv[5]) if len(argv) > 5 and argv[5] != "-" else None
    batch = int(argv[6]) if len(argv) > 6 else 1
    source: dict[str, Any] = {"model": "ernie4_5"} if checkpoint == "-" else {"model": "", "checkpoint": checkpoint}
    plan = plan_run(RunConfig(tp=tp, steps=steps, id_prompts=(prompt,) * batch, graph=graph, progress=False,
                              threads=threads, **source))
    if tp == 1:
        results = [measure_rank(plan)]
    else:
        import paddle.distributed  # noqa: F401 - imported before the fork, as fd run does

        results = spawn_ranks(spawned, (plan,), tp, plan.dist_backend, start_method="fork")
    print(json.dumps({"ranks": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
