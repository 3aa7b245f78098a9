"""VL models: the image changes the output and is spliced in at its placeholders, one token per merged patch block.

An image without (or with the wrong number of) placeholders is refused, as the references refuse it.
"""

from __future__ import annotations

import numpy as np
import pytest

from fd_models.layers.rows import Rows


def test_output_depends_on_the_image(vl_arch, kit) -> None:
    model = kit.build_loaded(vl_arch)
    ids, image = kit.prompt(vl_arch)
    rows = Rows(model, ids.shape[0], 40)
    first = rows.prefill(ids, image).numpy()
    second = rows.prefill(ids, image * 0.5 + 0.25).numpy()
    text_only = rows.prefill(ids, None).numpy()
    assert np.abs(first - second).max() > 1e-4
    assert np.abs(first - text_only).max() > 1e-4


def test_an_image_without_placeholders_is_refused(vl_arch, kit) -> None:
    model = kit.build_loaded(vl_arch)
    ids, image = kit.prompt(vl_arch, with_placeholders=False)
    rows = Rows(model, ids.shape[0], 40)
    with pytest.raises(ValueError, match=rf"needs 1 run\(s\) of image placeholder tokens \(\d+\) of {kit.image_tokens(vl_arch)} token"):
        rows.prefill(ids, image)


def test_a_wrong_number_of_placeholders_is_refused(vl_arch, kit) -> None:
    model = kit.build_loaded(vl_arch)
    ids, image = kit.prompt(vl_arch)
    ids[:, 2] = 1  # one placeholder short
    rows = Rows(model, ids.shape[0], 40)
    with pytest.raises(ValueError, match="placeholder"):
        rows.prefill(ids, image)


def test_prompts_of_a_batch_must_place_the_image_alike(vl_arch, kit) -> None:
    model = kit.build_loaded(vl_arch)
    ids, image = kit.prompt(vl_arch)
    ids[1] = np.roll(ids[1], 1)  # the second prompt's image starts one token later
    rows = Rows(model, ids.shape[0], 40)
    with pytest.raises(ValueError, match="same positions"):
        rows.prefill(ids, image)


def test_one_image_serves_the_whole_batch(vl_arch, kit) -> None:
    model = kit.build_loaded(vl_arch)
    ids, image = kit.prompt(vl_arch)
    ids[1] = ids[0]
    rows = Rows(model, ids.shape[0], 40)
    logits = rows.prefill(ids, image[:1]).numpy()
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-6)


def test_each_prompt_sees_its_own_image(vl_arch, kit) -> None:
    model = kit.build_loaded(vl_arch)
    ids, image = kit.prompt(vl_arch)
    ids[1] = ids[0]
    rows = Rows(model, ids.shape[0], 40)
    logits = rows.prefill(ids, image).numpy()  # two different pictures
    assert np.abs(logits[0] - logits[1]).max() > 1e-4


def test_vision_weights_are_replicated(vl_arch, kit) -> None:
    specs = kit.build_loaded(vl_arch).weight_specs()
    vision = {n: s for n, s in specs.items() if "visual" in n or "vision_model" in n or "resampler" in n}
    assert vision and all(s.split_axis is None for s in vision.values())
