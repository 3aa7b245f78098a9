"""The cpu platform's matrix product: a one-row product split across the rank's compute threads.

MKL runs a one-row product (a decode step's x [1, K] times a weight) on one thread whatever thread
count it is given, and on the machine docs/benchmarks.md measures one thread reads memory markedly
slower than two do: a tp=1 decode step left a core idle. Paddle releases the GIL while an op
computes, so the calling thread and the pool's workers each multiply by one contiguous block of
the weight's rows at once: for `x @ W` the blocks split the sum over K (the parts are added in
float32), for `x @ W^T` they split the outputs (the parts are concatenated). The split is only
taken eagerly, for one row, for a weight of at least SPLIT_MIN_BYTES, with more than one compute
thread (fd_core.kernels.compute_threads, which the engine sets for each phase; at most the usable
cores); everything else is Paddle's own product.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import queue
import threading
from typing import Any, Callable

from fd_core.detection import affinity_cores
from fd_core.graphs import capturing
from fd_core.kernels import compute_threads
from fd_plugins.cpu.cores import cgroup_cpu_limit, usable_cores

Call = tuple[Callable[..., Any], tuple[Any, ...]]

# Below this much weight a split's two hand-offs cost more than the second thread's reading saves: on the
# 2-core guest docs/benchmarks.md measures, waking a sleeping thread is costly, and a split of a weight
# that does not fit the cache broke even at 8 MiB (slower below it, faster above; docs/benchmarks.md has
# the figures).
SPLIT_MIN_BYTES = 8 << 20


class _Pool:
    """Daemon threads that run the parts of split products; grown to the largest split asked for."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[int, Call, queue.SimpleQueue[tuple[int, bool, Any]]]] = queue.SimpleQueue()
        self.workers: list[threading.Thread] = []
        self.lock = threading.Lock()

    def run(self, parts: list[Call]) -> list[Any]:
        """Each part's result, in order: the first computed on the calling thread, the others on the workers.

        A part is a function and its arguments, made ready by the caller: a worker holds the GIL only
        to call into Paddle and back (each hand-over of the GIL between threads waits for a wake-up).
        """
        with self.lock:
            while len(self.workers) < len(parts) - 1:
                worker = threading.Thread(target=self._serve, name=f"fd-cpu-product-{len(self.workers) + 1}",
                                          daemon=True)
                worker.start()
                self.workers.append(worker)
        replies: queue.SimpleQueue[tuple[int, bool, Any]] = queue.SimpleQueue()
        for index, part in enumerate(parts[1:], 1):
            self.jobs.put((index, part, replies))
        results: list[Any] = [None] * len(parts)
        failure: BaseException | None = None
        try:
            results[0] = parts[0][0](*parts[0][1])
        except BaseException as exc:  # noqa: BLE001 - raised once every worker's part is back: none outlives the call
            failure = exc
        for _ in parts[1:]:
            index, ok, value = replies.get()
            if ok:
                results[index] = value
            elif failure is None:
                failure = value
        if failure is not None:
            raise failure
        return results

    def _serve(self) -> None:
        while True:
            index, part, replies = self.jobs.get()
            try:
                reply: tuple[int, bool, Any] = (index, True, part[0](*part[1]))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                reply = (index, False, exc)
            # Dropped before replying: a part holds a view of its weight, which would keep the weight's
            # memory alive until this worker's next job (a released or reloaded model's embedding, say).
            part = None  # type: ignore[assignment]
            replies.put(reply)
            reply = replies = None  # type: ignore[assignment]


_POOL = _Pool()


def _forget_pool() -> None:
    # A forked child has none of its parent's threads: it starts a pool of its own when it first splits.
    global _POOL
    _POOL = _Pool()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def split_count(x: Any, weight: Any, element_bytes: int | None = None) -> int:
    """How many threads `x @ weight` is split across: 1 unless eager, one row, a large weight (counted at
    `element_bytes` an element, by default its own) and more than one compute thread."""
    import paddle

    threads = compute_threads()
    if threads < 2 or not paddle.in_dynamic_mode() or capturing() or not isinstance(x, paddle.Tensor):
        return 1
    size = math.prod(weight.shape) * (element_bytes or weight.element_size())
    if math.prod(x.shape[:-1]) != 1 or size < SPLIT_MIN_BYTES:
        return 1
    # A count the user chose may exceed the cores: more parts than cores only add hand-offs.
    return min(threads, _cores(), weight.shape[0])


@functools.cache
def _cores() -> int:
    return usable_cores(affinity_cores(), cgroup_cpu_limit())


def prepare_matmul(weight: Any, transpose_weight: bool) -> Any:
    """A weight MLAS serves (fd_plugins.cpu.mlas.serves) as its prepared product; any other weight as it is."""
    from fd_plugins.cpu.memory import return_freed_memory
    from fd_plugins.cpu.mlas import MlasProduct, serves

    if not serves(weight):
        return weight
    # The weight prepared before this one has just been released: its pages go back now, so that loading holds one
    # float weight at a time beyond the packed ones (fd_plugins.cpu.memory.return_freed_memory).
    return_freed_memory()
    return MlasProduct(weight, transpose_weight)


def matmul(x: Any, weight: Any, transpose_weight: bool) -> Any:
    """x [..., K] @ weight [K, N] (or weight [N, K] transposed): through MLAS for a weight prepared for it, else a
    one-row product on every compute thread, else Paddle's."""
    import paddle

    from fd_plugins.cpu.mlas import MlasProduct

    if isinstance(weight, MlasProduct):
        return weight(x)
    parts = split_count(x, weight)
    if parts < 2:
        return paddle.matmul(x, weight, transpose_y=transpose_weight)
    rows = weight.shape[0]
    bounds = [rows * i // parts for i in range(parts + 1)]
    spans = list(itertools.pairwise(bounds))
    blocks = [weight[a:b] for a, b in spans]  # row blocks of a dense matrix: views, no copy
    if transpose_weight:
        # paddle.matmul(x, y, transpose_x, transpose_y): positional, as a part is a function and its arguments.
        return paddle.concat(_POOL.run([(paddle.matmul, (x, block, False, True)) for block in blocks]), axis=-1)
    flat = x.reshape([rows])
    sums = _POOL.run([(paddle.matmul, (flat[a:b], block)) for block, (a, b) in zip(blocks, spans, strict=True)])
    wide = x.dtype in (paddle.float16, paddle.bfloat16)  # the op adds a split sum's parts in float32 or wider
    total = paddle.add_n([s.astype("float32") for s in sums] if wide else sums)
    return (total.astype(x.dtype) if wide else total).reshape([*x.shape[:-1], weight.shape[1]])


# Output rows a quantized product dequantizes at once: a float32 block of them (256 x 4 KiB at K = 1024) stays in the
# cache for the product that reads it, and Paddle's per-op cost is paid once per block, not per row.
QUANT_BLOCK_ROWS = 256


def prepare_quant(weight: Any, scales: Any, bits: int) -> tuple[Any, Any]:
    """fd's quantized form as this kernel takes it: MLAS's product (fd_plugins.cpu.mlas.MlasQuantProduct, no scales
    beside it) where MLAS serves the weight; else Paddle's blocks: wint8 as it is, wint4 repacked so that byte j of a
    row holds columns j (low four bits) and j + ceil(K / 2) (high four), so a block unpacks into two halves of the row
    with two shifts each and no interleaving; the scales per output channel. A grouped weight stays in fd's form: a
    block of its rows is widened and scaled by group (_grouped_rows)."""
    from fd_plugins.cpu.memory import return_freed_memory
    from fd_plugins.cpu.mlas import MlasQuantProduct, quant_block

    rows = weight.shape[0]
    groups = 1 if len(scales.shape) == 1 else scales.shape[1]
    columns = weight.shape[1] * (2 if bits == 4 else 1)
    block = quant_block(rows, columns, groups)
    if block is not None:
        return_freed_memory()  # as prepare_matmul does
        return MlasQuantProduct(weight, scales, bits, block), None
    if groups > 1 or bits == 8:
        return weight, scales
    import paddle

    from fd_core.quantization import pack_int4, unpack_int4

    half = weight.shape[1]
    values = unpack_int4(weight, 2 * half)  # [N, 2 * half]: an odd K's padding column is zero
    halves = paddle.stack([values[:, :half], values[:, half:]], axis=-1).reshape([weight.shape[0], -1])
    return pack_int4(halves), scales


def _quant_rows(x32: Any, weight: Any, bits: int, start: int, stop: int) -> Any:
    """x32 [..., K] times rows [start, stop) of the prepared values, unscaled: float32 [..., stop - start]."""
    import paddle

    four: Any = paddle.full([], 4, dtype="int8") if bits == 4 else None
    half = weight.shape[1]
    parts = []
    for a in range(start, stop, QUANT_BLOCK_ROWS):
        rows = weight[a : min(stop, a + QUANT_BLOCK_ROWS)]
        if bits == 8:
            parts.append(paddle.matmul(x32, rows.astype("float32"), transpose_y=True))
            continue
        low = paddle.bitwise_right_shift(paddle.bitwise_left_shift(rows, four), four)
        high = paddle.bitwise_right_shift(rows, four)[:, : x32.shape[-1] - half]
        parts.append(paddle.matmul(x32[..., :half], low.astype("float32"), transpose_y=True)
                     + paddle.matmul(x32[..., half:], high.astype("float32"), transpose_y=True))
    return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=-1)


def _grouped_rows(x32: Any, weight: Any, scales: Any, bits: int, start: int, stop: int) -> Any:
    """x32 [..., K] times rows [start, stop) of a weight in fd's grouped form, scaled: a block of rows widened to
    float32 and multiplied by its groups' scales, never the whole weight: float32 [..., stop - start]."""
    import paddle

    from fd_core.quantization import unpack_int4

    columns = x32.shape[-1]
    groups = scales.shape[1]
    parts = []
    for a in range(start, stop, QUANT_BLOCK_ROWS):
        b = min(stop, a + QUANT_BLOCK_ROWS)
        values = weight[a:b] if bits == 8 else unpack_int4(weight[a:b], columns)
        wide = values.astype("float32").reshape([b - a, groups, columns // groups]) * scales[a:b].unsqueeze(-1)
        parts.append(paddle.matmul(x32, wide.reshape([b - a, columns]), transpose_y=True))
    return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=-1)


def quant_matmul(x: Any, weight: Any, scales: Any, bits: int) -> Any:
    """x [..., K] times the prepared quantized weight [N, K] transposed: through MLAS where prepared for it; else a
    block's values are widened to float32 and multiplied, the scales applied once to the result (never the whole
    weight dequantized); a one-row product's blocks are shared among the compute threads, as matmul's are."""
    import paddle

    from fd_plugins.cpu.mlas import MlasQuantProduct

    if isinstance(weight, MlasQuantProduct):
        return weight(x)
    x32 = x if x.dtype == paddle.float32 else x.astype("float32")
    rows = weight.shape[0]
    grouped = len(scales.shape) > 1  # and no MLAS block for it
    parts = min(split_count(x, weight, element_bytes=4), rows)
    spans = list(itertools.pairwise([rows * i // parts for i in range(max(parts, 1) + 1)]))
    product = (functools.partial(_grouped_rows, x32, weight, scales, bits) if grouped
               else functools.partial(_quant_rows, x32, weight, bits))
    out = product(*spans[0]) if len(spans) == 1 else paddle.concat(_POOL.run([(product, s) for s in spans]), axis=-1)
    if not grouped:
        out = out * scales
    return out if out.dtype == x.dtype else out.astype(x.dtype)
