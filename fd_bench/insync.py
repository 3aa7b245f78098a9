"""What tensor parallelism's all-reduces alone cost a decode step: the matrix-vector ceiling's products on two ranks,
with and without the all-reduces a tp=2 step makes between them, and nothing else.

    python -m fd_bench.insync CONFIG [REPEATS]

Two gloo ranks (spawned as `fd run --tp 2` spawns them) each hold their half of every weight matrix of the
config, laid out as tensor parallelism splits them: q, k, v, gate and up by output columns, o and down by
input rows, the LM head by vocabulary. A pass is one one-row product per matrix. "In step" adds the 2L + 2
all-reduces of a tp=2 step through the cpu platform's all-reduce: the embedding's, each layer's after o and
after down ([1, hidden] partial sums), and the LM head's full-vocabulary logits. "Free" is the same
products, the two ranks started together and never waiting for each other: the 2-process ceiling. The
modes alternate pass by pass; each pass starts after a barrier. Prints one JSON line: passes per second
of each mode (slowest rank), the in-step / free ratio, each rank's waits per in-step pass, and what one
small op costs right after a product against right after another small op (the cache the product evicted).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from fd_bench.matvec import shapes

PER_LAYER = 7  # fd_bench.matvec.shapes lists each layer's q, k, v, o, gate, up, down
REDUCED_AFTER = (3, 6)  # o and down: their outputs are partial sums over the ranks


def _layout(config: dict[str, Any]) -> list[tuple[int, int]]:
    """The (in, out) of each matrix a tp=2 rank holds, in step order, the LM head last: the ceiling's matrices
    (fd_bench.matvec.shapes) halved as tensor parallelism halves them, o and down by inputs, the rest by outputs."""
    whole = shapes(config)
    halves = [(k // 2, n) if i % PER_LAYER in REDUCED_AFTER else (k, n // 2) for i, (k, n) in enumerate(whole[:-1])]
    hidden, vocab = whole[-1]
    # the LM head as fd holds it (the tied embedding's table [hidden, vocab / 2]): x @ W
    return [*halves, (hidden, vocab // 2)]


def _rank(config: dict[str, Any], repeats: int) -> dict[str, Any]:
    import paddle
    import paddle.distributed as dist
    import paddle.nn.functional as F
    from paddle.base import core

    from fd_core.runtime.ranks.spawn import init_rank
    from fd_plugins.cpu.platform import fd_all_reduce
    from fd_plugins.cpu.shm import group_state

    rank, _ = init_rank()
    paddle.set_device("cpu")
    core.set_num_threads(1)  # as a tp=2 rank's one-row products run on a 2-core host
    layout = _layout(config)
    weights = [paddle.randn([k, n]) for k, n in layout]  # [in, out]: x @ W, as fd holds them
    *layers, head = weights
    hidden, vocab_half = layout[-1]
    inputs = {k: paddle.randn([1, k]) for k, _ in layout}
    embedded = inputs[hidden]
    calls: list[int] = []

    def run(in_step: bool) -> None:
        if in_step:
            fd_all_reduce(embedded.clone(), None)
        for i, w in enumerate(layers):
            out = paddle.matmul(inputs[w.shape[0]], w)
            if in_step and i % PER_LAYER in REDUCED_AFTER:
                fd_all_reduce(out, None)
        logits = paddle.matmul(embedded, head)
        if in_step:
            start = rank * vocab_half
            fd_all_reduce(F.pad(logits, [0, 0, start, vocab_half * 2 - start - vocab_half], value=0.0), None)
        logits.numpy()

    times: dict[bool, list[float]] = {True: [], False: []}
    waits: list[float] = []
    for i in range(repeats + 1):  # the first round warms both modes up
        for in_step in (True, False) if i % 2 == 0 else (False, True):
            dist.barrier()
            state = group_state(None)
            before = state.stats() if state is not None else None
            start = time.perf_counter()
            run(in_step)
            spent = time.perf_counter() - start
            after = group_state(None).stats() if in_step else None  # type: ignore[union-attr]
            if i and in_step and before is not None and after is not None:
                waits.append(after["wait_s"] - before["wait_s"])
                # Shared-memory and gloo calls both: the gloo path serves a group whose segment could not be set up.
                calls.append(after["calls"] + after["fallback_calls"] - before["calls"] - before["fallback_calls"])
            if i:
                times[in_step].append(spent)
    cold, warm = _small_op_costs(layers[4], inputs[hidden])  # the first layer's gate
    return {"rank": rank, "in_step_s": statistics.median(times[True]), "free_s": statistics.median(times[False]),
            "wait_ms_per_pass": statistics.median(waits) * 1e3, "all_reduces_per_pass": statistics.median(calls),
            "small_op_after_product_us": cold, "small_op_after_small_op_us": warm}


def _small_op_costs(weight: Any, x: Any, samples: int = 200) -> tuple[float, float]:
    """Median microseconds of one [1, hidden] add right after a product by `weight`, and right after another add."""
    import paddle

    small = paddle.randn([1, x.shape[-1]])
    cold, warm = [], []
    for _ in range(samples):
        paddle.matmul(x, weight)
        start = time.perf_counter()
        small + small  # noqa: B018 - the op timed
        cold.append(time.perf_counter() - start)
        small + small  # noqa: B018 - warms the add's path
        start = time.perf_counter()
        small + small  # noqa: B018 - the op timed
        warm.append(time.perf_counter() - start)
    return statistics.median(cold) * 1e6, statistics.median(warm) * 1e6


def main(argv: list[str]) -> int:
    from fd_core.host.paddle_logs import quiet_paddle_logs
    from fd_core.runtime.ranks.spawn import spawn_ranks

    quiet_paddle_logs()
    config = json.loads(open(argv[0]).read())
    repeats = int(argv[1]) if len(argv) > 1 else 10
    import paddle.distributed  # noqa: F401 - imported before the fork, as fd run does

    ranks = spawn_ranks(_rank, (config, repeats), 2, "gloo", start_method="fork")
    in_step, free = max(r["in_step_s"] for r in ranks), max(r["free_s"] for r in ranks)
    print(json.dumps({"passes_per_s": 1 / in_step, "free_passes_per_s": 1 / free, "in_step_over_free": free / in_step,
                      "repeats": repeats, "ranks": ranks}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
