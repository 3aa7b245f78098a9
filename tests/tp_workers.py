"""Work run on spawned ranks by the runner tests (importable by module name in the rank processes)."""

from __future__ import annotations

from typing import Any

PROMPT = [3, 14, 15, 92, 65]
STEPS = 6


def image_for(arch: Any, config: Any, seed: int) -> Any:
    from fd_core.runner import synthetic_image

    return synthetic_image(config, seed) if arch.multimodal else None


def generate(backend: Any, arch_name: str, graph: str, image_seed: int = 0) -> dict[str, Any]:
    """Load the preset with seeded weights, take the decision, prefill logits and greedy tokens."""
    import numpy as np

    from fd_core.runner import ModelRunner, model_config_for

    arch = backend.plugins.registry.get(arch_name)
    config = model_config_for(arch, None)
    runner = ModelRunner(backend, arch, config, graph=graph)
    runner.load()
    decision = runner.decide()
    image = image_for(arch, config, image_seed)
    ids = np.asarray([PROMPT], dtype="int64")
    runner.prepare(runner.model.prefill_length(ids, image) + STEPS)
    logits = runner.model.prefill(ids, image).numpy()
    tokens = runner.generate(PROMPT, STEPS, image).tokens
    return {"logits": logits, "tokens": tokens, "graph": decision.allowed}


def tp_rank(arch_names: list[str]) -> dict[str, Any]:
    """On each of the spawned ranks: every architecture, eager and with graphs."""
    from fd_core.backend import load_backend
    from fd_core.config import ParallelConfig
    from fd_core.distributed import init_rank

    rank, world = init_rank()
    backend = load_backend(ParallelConfig(tp_size=world, tp_rank=rank))
    return {name: {mode: generate(backend, name, mode) for mode in ("off", "auto")} for name in arch_names}
