"""Fixtures for the model-package tests: tiny models per architecture, a simulated tp
group, a to_static graph backend."""

from __future__ import annotations

import importlib
import threading
import types
from typing import Any, Callable

import numpy as np
import pytest

from fd_core.config import ParallelConfig
from fd_core.models import Architecture
from fd_core.runtime.weights import random_state_dict

PLUGINS = ("fd_models.ernie4_5.plugin", "fd_models.ernie4_5_vl.plugin", "fd_models.qwen3_vl.plugin")
BATCH, PROMPT, STEPS, MAX_LEN = 2, 6, 4, 40
SEED = 7


def architectures() -> list[Architecture]:
    """Every architecture the built-in model packages register, through their hooks."""
    found: list[Architecture] = []
    for name in PLUGINS:
        importlib.import_module(name).fd_register_models(found.append)
    return found


def make_ctx(
    tp_size: int = 1, tp_rank: int = 0, all_reduce: Callable[[Any], Any] = lambda t: t,
) -> types.SimpleNamespace:
    """What a model's build receives, without a platform: the layout, an all-reduce, and the native ops."""
    from fd_core import native_ops
    from fd_core.host.kernel_table import KernelTable, Ops

    return types.SimpleNamespace(all_reduce=all_reduce, parallel=ParallelConfig(tp_size, tp_rank),
                                 ops=Ops(KernelTable(), native_ops))


def build_loaded(arch: Architecture, ctx: Any = None) -> Any:
    """Build `arch` from its preset for ctx's rank and load that rank's shard of the seeded weights."""
    from fd_core.runtime.plan import model_config_for

    ctx = ctx or make_ctx()
    model = arch.build(model_config_for(arch, None), ctx)
    model.load_weights(random_state_dict(model.weight_specs(), SEED, ctx.parallel.tp_rank, ctx.parallel.tp_size))
    return model


def image_shape(arch: Architecture) -> tuple[int, int, int]:
    """[C, H, W] of a test image for a VL architecture's preset."""
    vision = arch.preset["vision_config"]
    size = vision.get("image_size", 32)
    return (vision["in_channels"], size, size)


def image_tokens(arch: Architecture) -> int:
    """How many placeholder tokens a test image takes in the prompt."""
    vision = arch.preset["vision_config"]
    _, height, width = image_shape(arch)
    unit = vision["patch_size"] * vision.get("spatial_merge_size", 1)
    return (height // unit) * (width // unit)


def prompt(arch: Architecture, with_placeholders: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """Token ids [BATCH, S] and, for VL models, an image [BATCH, C, H, W] (values in [0,
    1]) whose placeholders are in the prompt."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 400, (BATCH, PROMPT)).astype(np.int64)
    if not arch.multimodal:
        return ids, None
    if with_placeholders:
        slots = np.full((BATCH, image_tokens(arch)), arch.preset["image_token_id"])
        ids = np.concatenate([ids[:, :2], slots, ids[:, 2:]], axis=1)
    image = rng.random((BATCH, *image_shape(arch)), dtype=np.float32)
    return ids, image


def greedy(
    model: Any, ids: np.ndarray, image: np.ndarray | None, steps: int = STEPS,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Prefill then greedy-decode `steps` tokens; every step's logits and the generated tokens [B, steps]."""
    from fd_models.layers.rows import Rows

    rows = Rows(model, ids.shape[0], MAX_LEN)
    logits = rows.prefill(ids, image)
    history, tokens = [logits.numpy()], []
    for _ in range(steps):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token.numpy())
        logits = rows.decode(token)
        history.append(logits.numpy())
    return history, np.concatenate(tokens, axis=1)


class SummingGroup:
    """An all-reduce for `size` ranks run as threads of one process: every rank gets the sum."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Any] = [None] * size

    def all_reduce_for(self, rank: int) -> Callable[[Any], Any]:
        def all_reduce(tensor: Any) -> Any:
            import paddle

            self.slots[rank] = tensor
            self.barrier.wait()
            total = paddle.add_n(list(self.slots))
            self.barrier.wait()  # nobody overwrites a slot before every rank has summed
            return total

        return all_reduce


def run_ranks(size: int, fn: Callable[[Any], Any]) -> list[Any]:
    """fn(ctx) on `size` threads in lockstep over a SummingGroup; the results by rank (errors re-raised)."""
    group = SummingGroup(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(make_ctx(size, rank, group.all_reduce_for(rank)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
            group.barrier.abort()  # release the other rank instead of deadlocking

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


class ToStaticGraphs:
    """A test GraphBackend: paddle.jit.to_static with fixed-shape InputSpecs taken from the example inputs."""

    mode = "static"

    def __init__(self) -> None:
        self.graphs: dict[Any, Any] = {}
        self.replays = 0
        self.clears = 0

    def capture(self, key: Any, fn: Callable[..., Any], inputs: Any) -> None:
        import paddle
        from paddle.static import InputSpec

        spec = [InputSpec(shape=list(x.shape), dtype=x.dtype) for x in inputs]
        static = paddle.jit.to_static(fn, input_spec=spec, full_graph=True)
        static(*inputs)  # trace now, as a capture does
        self.graphs[key] = static

    def replay(self, key: Any, inputs: Any) -> Any:
        self.replays += 1
        return self.graphs[key](*inputs)

    def has(self, key: Any) -> bool:
        return key in self.graphs

    def clear(self) -> None:
        self.graphs.clear()
        self.clears += 1


@pytest.fixture(params=architectures(), ids=lambda a: a.name)
def arch(request: pytest.FixtureRequest) -> Architecture:
    return request.param


@pytest.fixture(params=[a for a in architectures() if a.multimodal], ids=lambda a: a.name)
def vl_arch(request: pytest.FixtureRequest) -> Architecture:
    return request.param


@pytest.fixture
def kit() -> types.SimpleNamespace:
    """The helpers above, for test modules (importing conftest by name is fragile across test dirs)."""
    return types.SimpleNamespace(
        build_loaded=build_loaded, make_ctx=make_ctx, prompt=prompt, greedy=greedy, image_tokens=image_tokens, max_len=MAX_LEN,
        run_ranks=run_ranks, ToStaticGraphs=ToStaticGraphs, architectures=architectures, seed=SEED,
    )
