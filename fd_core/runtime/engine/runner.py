"""A model's lifecycle on one rank: build, load, clean, decide, cache and capture, reload; and the graph
state (the decision and what is captured for which batch and cache length), which it alone owns."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fd_core.config import ModelConfig
from fd_core.errors import PluginError
from fd_core.graphs import GraphBackend, GraphDecision, capture_scope
from fd_core.host.backend import Backend
from fd_core.models import Architecture, CausalModel
from fd_core.runtime import progress
from fd_core.runtime.engine.checked_graphs import CheckedGraphs
from fd_core.runtime.weights import CheckpointShards, load_checkpoint, random_state_dict


def _sample(model: Any) -> dict[str, Any]:
    """A few values of every parameter and buffer (the weights prepared from parameters) (at most 64, evenly
    spaced): cheap at any model size, and a hook that rewrites a weight (zeroes, rounds or frees it) changes them."""
    out: dict[str, Any] = {}
    for name, param in [*model.named_parameters(), *model.named_buffers()]:
        if not param._is_initialized():
            out[name] = None
            continue
        flat = param.reshape([-1])
        step = max(1, int(flat.shape[0]) // 64)
        # The strided slice is a view: made contiguous first, it is copied alone; converted as a view
        # (astype, numpy) it copied the whole parameter (the embedding's 404 MiB at ERNIE-4.5-0.3B: the load's peak
        # RSS).
        out[name] = flat[::step].contiguous().astype("float32").numpy().copy()
    return out


def _same(a: Any, b: Any) -> bool:
    import numpy as np

    if a is None or b is None:
        return a is b
    return bool(np.array_equal(a, b, equal_nan=True))


def init_std(config: ModelConfig) -> float | None:
    """The config's `initializer_range` (Hugging Face's name for the init std), if it sets one."""
    value = config.extra.get("initializer_range")
    return None if value is None else float(value)


@dataclass
class ModelRunner:
    """Drives one model through the lifecycle on this rank; the order of steps lives here, not in models.

    Generating is the Engine's (fd_core.runtime.engine.loop): it has the paged cache allocated once and asks for a
    captured decode step per (rows, block-table width) bucket as it needs one.
    """

    backend: Backend
    arch: Architecture
    config: ModelConfig
    # The checkpoint directory, or None for seeded random weights.
    checkpoint: str | None = None
    seed: int = 0
    graph: str = "auto"
    log: Callable[[str], None] = lambda message: None
    allow_non_finite: bool = False
    model: CausalModel | None = None
    decision: GraphDecision | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # The (rows, block-table width) buckets the decode step is captured for (cleared with the graphs).
    captured: set[tuple[int, int]] = field(default_factory=set)
    # The platform's graph backend, one per model: every batch size's captures live in it (keys (batch, length)).
    graphs: GraphBackend | None = None
    # Positions a KV-cache block holds (set by allocate_cache).
    block_size: int = 0
    # Checkpoint tensors present and not loaded (reported once, on the first load).
    unused_tensors: list[str] = field(default_factory=list)
    # The graph keys' namespace when another model shares this rank's graph backend (speculative decoding's draft).
    graph_namespace: str | None = None
    _identity: str | None = None

    def add_time(self, phase: str, seconds: float) -> None:
        """Add `seconds` to a phase's total."""
        self.timings[phase] = self.timings.get(phase, 0.0) + seconds

    def _timed(self, phase: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        self.add_time(phase, time.perf_counter() - start)
        return result

    def read_weights(self) -> Mapping[str, Any]:
        """This rank's shards from the seed (in memory), or from the checkpoint (checked whole, read on access)."""
        assert self.model is not None
        specs = self.model.weight_specs()
        p = self.backend.parallel
        if self.checkpoint is None:
            return random_state_dict(specs, self.seed, p.tp_rank, p.tp_size, init_std(self.config))
        ignored: set[str] = getattr(self.model, "ignored_tensors", lambda: set())()
        return load_checkpoint(
            self.checkpoint, specs, p.tp_rank, p.tp_size, ignored, check_finite=not self.allow_non_finite
        )

    def identity(self) -> str:
        """What this rank computes with, as a hash: the architecture, dtype, tp rank and size, and a sample of every
        weight (_sample). Two instances' ranks that agree hold the same shards of the same weights: a prompt's keys
        and values from one are valid in the other's cache (disaggregation)."""
        if self._identity is None:
            import hashlib

            assert self.model is not None, "load() comes before identity()"
            p = self.backend.parallel
            digest = hashlib.blake2b(f"{self.arch.name}|{self.config.dtype}|{p.tp_rank}/{p.tp_size}".encode(),
                                     digest_size=12)
            for name, values in sorted(_sample(self.model).items()):
                digest.update(name.encode())
                digest.update(b"" if values is None else values.tobytes())
            self._identity = f"{self.arch.name}:{digest.hexdigest()}"
        return self._identity

    def load(self) -> None:
        """Build the model if needed, load weights, then clean memory fragments with what loading left behind."""
        self._identity = None
        if self.model is None:
            self.model = self._timed("build", lambda: self.arch.build_model(self.config, self.backend))
        model = self.model
        shards = self._timed("load", self.read_weights)
        self._timed("load", lambda: model.load_weights(shards))
        # Checkpoints and seeded weights both stream into the parameters a tensor (or a piece of
        # one) at a time and leave nothing staged; the cleanup hooks get the (lazy) mapping loaded from.
        left: Mapping[str, Any] = shards
        if isinstance(shards, CheckpointShards):
            if shards.unused and not self.unused_tensors:
                tied = "lm_head.weight" in shards.unused and self.config.tie_word_embeddings
                self.log(
                    f"checkpoint tensor(s) not used by {self.arch.name}: {', '.join(shards.unused)}"
                    + (" (tie_word_embeddings is true: the head is the embedding)" if tied else "")
                )
            self.unused_tensors = list(shards.unused)
            shards.close()
            left = {}
        before = _sample(model)

        def unchanged(plugin: str) -> None:
            changed = next(
                (name for name, values in _sample(model).items() if not _same(values, before.get(name))), None
            )
            if changed is not None:
                # A cleanup hook may release memory, never change the weights: that would give plausible, wrong tokens.
                raise PluginError(
                    f"plugin {plugin!r}: fd_clean_memory_fragments changed the loaded parameter {changed!r}; "
                    f"cleanup must leave live parameters untouched: fix its hook or uninstall the plugin"
                )

        self._timed("cleanup", lambda: self.backend.clean_memory_fragments(left, unchanged))

    def decide(self) -> GraphDecision:
        """Ask every voter whether decode steps may be captured here; the decision is kept."""
        self.decision = self.backend.graph_decision(self.config, requested=self.graph)
        return self.decision

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        """The paged KV cache, once per run: `num_blocks` blocks of `block_size` positions (block 0 the null block)."""
        assert self.model is not None, "load() comes before allocate_cache()"
        self.model.allocate_kv_cache(num_blocks, block_size)
        self.block_size = block_size
        # New cache tensors: a device graph captured with the old ones would not write these.
        self.captured.clear()

    @property
    def graphs_allowed(self) -> bool:
        """Whether decode steps are captured (the decision allows it)."""
        return self.decision is not None and self.decision.allowed

    def ensure_captured(self, rows: int, width: int) -> None:
        """The decode step captured for `rows` rows and block tables `width` blocks wide, once (until a reload)."""
        model = self.model
        assert model is not None and self.decision is not None, "load() and decide() come before capture"
        if not self.decision.allowed or (rows, width) in self.captured:
            return
        self.log(f"capturing the decode step for batch size {rows}, block tables of {width} ({self.decision.mode})")
        progress.report("capturing")
        if self.graphs is None:
            self.graphs = CheckedGraphs(self.backend.graph_backend(), self.backend.platform, self.graph_namespace)
        graphs = self.graphs
        with capture_scope():
            self._timed("capture", lambda: model.capture(graphs, rows, width))
        self.captured.add((rows, width))

    def reload(self) -> None:
        """A weight update: clear graphs, release weights, clean, load, clean (capture again on next use)."""
        assert self.model is not None
        # Graphs first: a captured graph still points at the weights (releasing first hung FastDeploy).
        self._timed("clear", lambda: self.backend.clear_graphs(self.model))
        self.captured.clear()
        self._timed("release", self.model.release_weights)
        self._timed("cleanup", lambda: self.backend.clean_memory_fragments(None))
        self.load()
