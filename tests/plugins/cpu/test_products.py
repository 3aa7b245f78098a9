"""The cpu platform's matrix product: a one-row product split across the rank's compute threads, checked against a
product computed in numpy (float64), not against itself."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import numpy as np
import paddle
import pytest

from fd_core.graphs import capture_scope
from fd_core.kernels import compute_threads, set_compute_threads
from fd_plugins.cpu import products
from fd_plugins.cpu.products import SPLIT_MIN_BYTES, matmul, split_count

RNG = np.random.default_rng(7)


def _t(*shape: int) -> Any:
    return paddle.to_tensor(RNG.standard_normal(shape).astype("float32"))


@pytest.fixture
def threads():
    held = compute_threads()
    yield set_compute_threads
    set_compute_threads(held)


def _expected(x: Any, w: Any, transpose: bool) -> np.ndarray:
    weight = w.numpy().astype(np.float64)
    return x.numpy().astype(np.float64) @ (weight.T if transpose else weight)


@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize(("x_shape", "w_shape", "transpose"), [
    ((1, 1, 1024), (1024, 2048 + 13), False),  # q/k/v- and MLP-like: the sum over K split
    ((1, 1, 2048 + 13), (2048 + 13, 1024), False),  # an odd K
    ((1, 1024), (4096 + 13, 1024), True),  # the LM head's: the outputs split
])
def test_a_split_product_matches_numpy(
    threads, monkeypatch: pytest.MonkeyPatch, count: int, x_shape, w_shape, transpose: bool,
) -> None:
    monkeypatch.setattr(products, "_cores", lambda: 8)  # as on a host with more cores than parts
    x, w = _t(*x_shape), _t(*w_shape)
    threads(count)
    assert split_count(x, w) == count  # the split path, not paddle's own product
    got = matmul(x, w, transpose)
    assert list(got.shape) == [*x_shape[:-1], w_shape[0] if transpose else w_shape[1]] and got.dtype == paddle.float32
    np.testing.assert_allclose(got.numpy(), _expected(x, w, transpose), rtol=1e-4, atol=1e-4)


def test_a_float64_split_keeps_float64_sums(threads, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parts of a split sum are added in float32 only for a narrower dtype:
    a float64 product stays float64-exact."""
    monkeypatch.setattr(products, "_cores", lambda: 2)
    x, w = _t(1, 1, 2048).astype("float64"), _t(2048, 1024).astype("float64")
    threads(2)
    assert split_count(x, w) == 2
    got = matmul(x, w, False)
    assert got.dtype == paddle.float64
    np.testing.assert_allclose(got.numpy(), _expected(x, w, False), rtol=1e-12, atol=1e-10)


def test_what_is_not_split(threads, monkeypatch: pytest.MonkeyPatch) -> None:
    big, x = _t(1024, 2048), _t(1, 1, 1024)
    monkeypatch.setattr(products, "_cores", lambda: 2)
    threads(1)
    assert split_count(x, big) == 1  # one compute thread
    threads(2)
    assert split_count(x, big) == 2
    threads(8)
    assert split_count(x, big) == 2  # never more parts than usable cores
    assert split_count(_t(2, 1, 1024), big) == 1  # two rows: MKL threads those itself
    small = _t(64, 64)
    assert 64 * 64 * 4 < SPLIT_MIN_BYTES and split_count(_t(1, 64), small) == 1
    with capture_scope():
        assert split_count(x, big) == 1  # a capture traces Paddle's own product


def test_the_parts_run_at_once_on_two_threads() -> None:
    """Each part waits for the other at a barrier: a pool that ran them one after the other would time out."""
    pool = products._Pool()
    barrier = threading.Barrier(2, timeout=10)

    def part(tag: str) -> tuple[str, int]:
        barrier.wait()
        return tag, threading.get_ident()

    (a, first), (b, second) = pool.run([(part, ("a",)), (part, ("b",))])
    assert (a, b) == ("a", "b") and first == threading.get_ident() and second != first


def test_a_part_that_fails_raises_in_the_caller_and_the_pool_goes_on() -> None:
    pool = products._Pool()

    def boom() -> None:
        raise ValueError("part failed")

    with pytest.raises(ValueError, match="part failed"):
        pool.run([(int, ("1",)), (boom, ())])
    with pytest.raises(ValueError, match="part failed"):
        pool.run([(boom, ()), (int, ("2",))])
    assert pool.run([(int, ("3",)), (int, ("4",)), (int, ("5",))]) == [3, 4, 5]


def test_a_worker_keeps_nothing_of_a_part_after_it() -> None:
    """A part's arguments (views of a weight, in a product) are not held by the worker once the call returns."""
    import gc
    import weakref

    class Held:
        pass

    pool = products._Pool()
    first, second = Held(), Held()
    gone = weakref.ref(second)
    assert pool.run([(id, (first,)), (id, (second,))]) == [id(first), id(second)]
    del second
    gc.collect()
    assert gone() is None, "the pool's worker still holds its last part's arguments"


def test_a_model_decodes_the_same_tokens_with_its_products_split(threads, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny preset with every one-row product split (no size floor): the tokens of Paddle's own products."""
    from fd_core.host.backend import load_backend
    from fd_core.lifecycle import RankContext
    from fd_core.runtime.engine.loop import Engine
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for
    from fd_core.runtime.request import Request
    from fd_plugins.cpu.threads import apply_threads

    backend = load_backend(env={"FD_PLATFORM": "cpu"})
    arch = backend.plugins.registry.get("ernie4_5")
    runner = ModelRunner(backend, arch, model_config_for(arch, None), seed=0, graph="off")
    runner.load()
    runner.decide()
    calls: list[int] = []
    count = products.split_count
    monkeypatch.setattr(products, "split_count", lambda x, w: calls.append(n := count(x, w)) or n)
    monkeypatch.setattr(products, "_cores", lambda: 2)
    request = Request.greedy([[5, 6, 7, 8]], 6)
    try:
        plain = Engine(runner, rank=RankContext(threads=1)).generate(request)
        assert calls and set(calls) == {1}
        calls.clear()
        monkeypatch.setattr(products, "SPLIT_MIN_BYTES", 0)
        split = Engine(runner, rank=RankContext(threads=2)).generate(request)
        assert 2 in calls  # the decode steps' products were split
    finally:
        apply_threads(1)
    assert [c.token_ids for c in split] == [c.token_ids for c in plain]


def _split_in_child(queue: Any) -> None:
    set_compute_threads(2)
    x, w = paddle.ones([1, 1, 2048]), paddle.ones([2048, 1024])
    queue.put(float(matmul(x, w, False).numpy().max()))


def test_a_forked_rank_splits_with_threads_of_its_own(threads) -> None:
    threads(2)
    matmul(_t(1, 1, 1024), _t(1024, 2048), False)  # the parent's pool has a worker now; a fork does not copy it
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_split_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=30) == 2048.0
    finally:
        child.join(10)
        if child.is_alive():  # a child waiting on its parent's (absent) worker: not left running
            child.kill()
            child.join()
    assert child.exitcode == 0
