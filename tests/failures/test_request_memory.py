"""Request after request, the engine must not keep memory for each one (issue 38).

What was found: Paddle 3.3.1's Tensor constructor, which paddle.to_tensor calls with keyword arguments, never
releases the list of its keyword names (about 100 bytes a tensor, for good). A decode step made its five inputs
(token ids, positions, slots, block tables, context lengths) with paddle.to_tensor, and a penalized sequence's
step its arrays and logits row, so one rank grew by about 4.4 MB per 1,000 requests of 8 tokens (5.3 MB with
graphs on), linearly. They are now made with paddle.empty and set_value (fd_core.models.host_tensor),
which copy the same array without the constructor.

Counted with tracemalloc rather than RSS, so that a busy machine cannot move the figure: the allocations made
in a window of requests that are still alive after it.
"""

from __future__ import annotations

import gc
import itertools
import tracemalloc
from pathlib import Path
from typing import Callable

import numpy as np

from fd_core.runtime import LLM, SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
PENALIZED = SamplingParams(max_new_tokens=8, ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.5)
WARM_UP, REQUESTS = 30, 30
# Retained allocations per request allowed. The leak left about 156 a request here (82 a greedy request of 8
# tokens, more with penalties): 4,685 in the window. After the fix 260 to 420 stay in the window, fewer in a later
# one (what Paddle and numpy happen to hold at the snapshot, not a growth). The bound is about a quarter of the
# leak's count and three times the fix's.
PER_REQUEST = 40


def _retained(run: Callable[[], object], times: int, this_thread: bool = False) -> int:
    """Allocations made by `times` calls of `run` that are still alive after them (tracemalloc). `this_thread`: only
    those whose stack holds this file, leaving out what other threads of the process allocate meanwhile (a test
    module run before this one in the same process may have left some running)."""
    gc.collect()
    tracemalloc.start(64 if this_thread else 1)
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(times):
            run()
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    if not this_thread:
        return sum(stat.count_diff for stat in after.compare_to(before, "filename"))
    return sum(stat.count_diff for stat in after.compare_to(before, "traceback")
               if any(frame.filename == __file__ for frame in stat.traceback))


def test_host_tensor_copies_as_to_tensor_does_and_keeps_nothing() -> None:
    import paddle

    from fd_core.models import host_tensor

    for array in [np.arange(6, dtype=np.int64).reshape(2, 3), np.array(7, dtype=np.int64),
                  np.zeros((2, 0), dtype=np.int64), np.array([[True, False]]),
                  np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2], np.ones(3, dtype=np.float32)]:
        made, expected = host_tensor(array), paddle.to_tensor(array)
        assert (made.dtype, made.shape, made.place, made.stop_gradient) == (
            expected.dtype, expected.shape, expected.place, expected.stop_gradient)
        assert np.array_equal(made.numpy(), array)
    source = np.arange(4, dtype=np.int64)
    copy = host_tensor(source)
    source[0] = 99
    assert int(copy.numpy()[0]) == 0, "a copy, as paddle.to_tensor makes, not a view of the array"

    array = np.arange(24, dtype=np.int64).reshape(4, 6)
    for _ in range(100):
        host_tensor(array)
    kept = _retained(lambda: host_tensor(array), 2000, this_thread=True)
    leaked = _retained(lambda: paddle.to_tensor(array), 2000, this_thread=True)  # the count sees Paddle's leak
    assert leaked > 1000, leaked
    # Paddle's leak is two allocations a call; what else this thread allocates and keeps meanwhile (caches warmed by a
    # busy machine's timing) stays in the low hundreds.
    assert kept < 500, f"2000 tensors made from an array left {kept} allocations alive (paddle.to_tensor: ~4000)"


def test_requests_do_not_keep_memory(tmp_path: Path) -> None:
    """Greedy and penalized requests in turn (the penalties make tensors of their own each step)."""
    from fd_core.serve.tiny import write_tiny_checkpoint

    turns = itertools.cycle([GREEDY, PENALIZED])

    def request() -> None:
        llm.generate("Hello world", next(turns))

    with LLM(write_tiny_checkpoint(tmp_path / "tiny"), tp=1, graph="off") as llm:
        for _ in range(WARM_UP):
            request()
        kept = _retained(request, REQUESTS)
    assert kept < PER_REQUEST * REQUESTS, (
        f"{REQUESTS} requests of 8 tokens left {kept} allocations alive ({kept / REQUESTS:.0f} a request; "
        f"at most {PER_REQUEST} allowed): memory grows with every request"
    )
