"""Work run on spawned ranks by the runner tests (importable by module name in the rank processes)."""

from __future__ import annotations

from typing import Any

PROMPT = [3, 14, 15, 92, 65]
STEPS = 6


def image_for(arch: Any, seed: int) -> Any:
    """A random image [1, C, H, W] in [0, 1] for a VL preset (None for a text model)."""
    import numpy as np

    if not arch.multimodal:
        return None
    vision = arch.preset["vision_config"]
    size = vision.get("image_size", 32)
    return np.random.default_rng(seed + 7).random((1, vision["in_channels"], size, size), dtype=np.float32)


def prompt_for(arch: Any) -> list[int]:
    """PROMPT, with the image's placeholder tokens after its second token for a VL preset."""
    if not arch.multimodal:
        return list(PROMPT)
    vision = arch.preset["vision_config"]
    unit = vision["patch_size"] * vision.get("spatial_merge_size", 1)
    count = (vision.get("image_size", 32) // unit) ** 2
    return PROMPT[:2] + [arch.preset["image_token_id"]] * count + PROMPT[2:]


def generate(backend: Any, arch_name: str, graph: str, image_seed: int = 0) -> dict[str, Any]:
    """Load the preset with seeded weights, take the decision, prefill logits and greedy tokens (through the engine)."""
    import numpy as np

    from fd_core.kvcache import KVBatch
    from fd_core.runtime.engine.loop import Engine
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for
    from fd_core.runtime.request import Request

    arch = backend.plugins.registry.get(arch_name)
    config = model_config_for(arch, None)
    runner = ModelRunner(backend, arch, config, graph=graph)
    runner.load()
    decision = runner.decide()
    image = image_for(arch, image_seed)
    prompt = prompt_for(arch)
    ids = np.asarray([prompt], dtype="int64")
    tokens = Engine(runner).generate(Request.greedy([prompt], STEPS, [] if image is None else [image[0]]))[0].token_ids
    # The prompt prefilled again into the engine's cache (nothing runs there now): its first-step logits.
    width = -(-ids.shape[1] // runner.block_size)
    logits = runner.model.prefill(ids, image, KVBatch.contiguous(1, 0, ids.shape[1], runner.block_size, width)).numpy()
    return {"logits": logits, "tokens": tokens, "graph": decision.allowed}

