"""VL models: the image changes the output and is spliced in at its placeholders.

Without placeholders, the ERNIE-4.5-VL stand-in prepends the image; Qwen3-VL, as published, refuses it.
"""

from __future__ import annotations

import numpy as np
import pytest


def test_output_depends_on_the_image(vl_arch, kit) -> None:
    model = kit.build_loaded(vl_arch)
    ids, image = kit.prompt(vl_arch)
    model.allocate_cache(ids.shape[0], 40)
    first = model.prefill(ids, image).numpy()
    second = model.prefill(ids, image * 0.5 + 1.0).numpy()
    text_only = model.prefill(ids, None).numpy()
    assert np.abs(first - second).max() > 1e-4
    assert np.abs(first - text_only).max() > 1e-4


def test_without_placeholders_the_image_is_prepended(vl_arch, kit) -> None:
    if vl_arch.name == "qwen3_vl":
        pytest.skip("Qwen3-VL places an image only at its placeholder tokens (see the next test)")
    model = kit.build_loaded(vl_arch)
    ids, image = kit.prompt(vl_arch, with_placeholders=False)
    patches = model.vision.num_patches
    assert model.prefill_length(ids, image) == ids.shape[1] + patches
    assert model.prefill_length(ids, None) == ids.shape[1]
    logits, tokens = kit.greedy(model, ids, image)
    assert tokens.shape == (ids.shape[0], 4) and np.isfinite(logits[-1]).all()


def test_qwen3_vl_refuses_an_image_without_placeholders(kit) -> None:
    arch = next(a for a in kit.architectures() if a.name == "qwen3_vl")
    model = kit.build_loaded(arch)
    ids, image = kit.prompt(arch, with_placeholders=False)
    assert model.prefill_length(ids, image) == ids.shape[1]
    model.allocate_cache(ids.shape[0], 40)
    with pytest.raises(ValueError, match="needs one run of 4 image placeholder tokens"):
        model.prefill(ids, image)


def test_a_wrong_number_of_placeholders_is_refused(vl_arch, kit) -> None:
    model = kit.build_loaded(vl_arch)
    ids, image = kit.prompt(vl_arch)
    ids[0, 2] = 1  # one placeholder short in the first row
    model.allocate_cache(ids.shape[0], 40)
    with pytest.raises(ValueError, match="placeholder"):
        model.prefill(ids, image)


def test_one_image_serves_the_whole_batch(vl_arch, kit) -> None:
    model = kit.build_loaded(vl_arch)
    ids, image = kit.prompt(vl_arch)
    ids[1] = ids[0]
    model.allocate_cache(ids.shape[0], 40)
    logits = model.prefill(ids, image[:1]).numpy()
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-6)


def test_vision_weights_are_replicated(vl_arch, kit) -> None:
    specs = kit.build_loaded(vl_arch).weight_specs()
    vision = {n: s for n, s in specs.items() if "visual" in n or "vision_model" in n or "resampler" in n}
    assert vision and all(s.split_axis is None for s in vision.values())
