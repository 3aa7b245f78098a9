"""Chat templates rendered and tokenized as transformers does; image placeholders expanded; sampling settings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fd_core import native_ops
from fd_core.errors import ConfigError
from fd_core.runtime import SamplingParams, load_tokenizer
from fd_core.runtime.checkpoint import Checkpoint
from fd_core.runtime.engine.sampling import Sampler
from fd_core.runtime.request import chat_prompt
from fd_core.runtime.text.chat import expand_placeholders, load_chat_template, render_chat, user_message
from kit import tokenizer_dirs, transformers_tokenizer  # noqa: F401 - fixtures

MESSAGES = ["Hello there", "Café 🙂 日本語"]


@pytest.mark.parametrize(("kind", "images"), [("bpe", 0), ("bpe", 2), ("sp", 0)])
def test_chat_template_renders_and_tokenizes_as_transformers(
    tokenizer_dirs: dict[str, Path], transformers_tokenizer, kind: str, images: int,
) -> None:
    directory = tokenizer_dirs[kind]
    ours, reference = load_tokenizer(directory), transformers_tokenizer(directory)
    for text in MESSAGES:
        messages = [user_message(text, images)]
        want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert render_chat(load_chat_template(directory), messages, ours.special_tokens()) == want
        want_ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        want_ids = want_ids["input_ids"] if not isinstance(want_ids, list) else want_ids
        assert chat_prompt(ours, Checkpoint(str(directory), {}, {}, None), text, images) == list(want_ids)


def test_templates_are_found_where_transformers_saves_them(tmp_path: Path) -> None:
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]})
    )
    assert load_chat_template(tmp_path) == "A"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "C"}))
    assert load_chat_template(tmp_path) == "C"
    (tmp_path / "chat_template.jinja").write_text("D")
    assert load_chat_template(tmp_path) == "D"


def test_a_template_that_fails_is_one_line_with_its_error() -> None:
    with pytest.raises(ConfigError) as caught:
        render_chat("{{ raise_exception('only user and assistant roles\\nare supported') }}", [user_message("x")], {})
    assert "only user and assistant roles are supported" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="failed to render"):
        render_chat("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}", [user_message("x")], {})


def test_each_placeholder_expands_to_its_pictures_tokens() -> None:
    assert expand_placeholders([7, 9, 5, 9, 8], 9, [2, 3]) == [7, 9, 9, 5, 9, 9, 9, 8]
    # Already expanded (runs, not one per picture): left for the model's check to judge.
    assert expand_placeholders([9, 9, 9, 9], 9, [4]) == [9, 9, 9, 9]


def test_greedy_is_argmax_and_sampling_is_seeded() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)) * 2
    assert Sampler(SamplingParams(), range(3)).choose(logits, native_ops.sample) == list(logits.argmax(-1))

    def draw(seed: int, **kw: float) -> list[list[int]]:
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, **kw), range(3))
        return [sampler.choose(logits, native_ops.sample) for _ in range(20)]

    assert draw(1) == draw(1) and draw(1) != draw(2)
    assert {t for step in draw(1, top_k=1) for t in step} <= set(logits.argmax(-1))
    assert {t for step in draw(1, top_p=1e-6) for t in step} <= set(logits.argmax(-1))
    top3 = np.argsort(-logits, axis=-1)[:, :3]
    assert all(t in top3[b] for step in draw(5, top_k=3) for b, t in enumerate(step))


def _nucleus_by_full_sort(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The top-p set as the op's semantics state it: the whole vocabulary sorted by descending probability (ties in
    id order), the smallest prefix whose mass reaches top_p."""
    order = np.argsort(-probs, kind="stable")
    return order[: int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1]


@pytest.mark.parametrize("vocab", [7, 300, 103_424])
def test_top_p_keeps_what_a_full_sort_keeps(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native sample op looks for the top-p set among the most probable tokens first: on peaked and flat rows, with
    ties (rounded logits) and masses the first candidates do not reach, every draw equals the one over the set a full
    sort gives (the full sort substituted into the same op)."""
    rng = np.random.default_rng(vocab)
    rows, settings = [], []
    for trial in range(60):
        row = rng.standard_normal(vocab) * [0.3, 3.0, 30.0][trial % 3]
        rows.append(np.round(row) if trial % 4 == 0 else row)
        settings.append((float(rng.choice([0.5, 1.0, 2.0])), int(rng.choice([0, 0, 5])),
                         float(rng.choice([0.3, 0.9, 0.999, 0.999999])), float(rng.random())))
    fast = [native_ops.sample(np.asarray([row]), t, k, p, [u])[0] for row, (t, k, p, u) in zip(rows, settings, strict=True)]
    monkeypatch.setattr(native_ops, "_nucleus", _nucleus_by_full_sort)
    sorted_ = [native_ops.sample(np.asarray([row]), t, k, p, [u])[0] for row, (t, k, p, u) in zip(rows, settings, strict=True)]
    assert fast == sorted_
    # The cases reach past the first candidates (a flat row at top_p near 1), and the draws are not all the argmax.
    flat = np.full(vocab, 1 / vocab)
    assert native_ops._nucleus(flat, 0.999999).size == _nucleus_by_full_sort(flat, 0.999999).size
    assert _nucleus_by_full_sort(flat, 0.999999).size >= min(vocab, native_ops.NUCLEUS_CANDIDATES)
    assert sum(f != int(np.argmax(r)) for f, r in zip(fast, rows, strict=True)) > 10


def test_sampling_settings_are_checked() -> None:
    for bad, says in (
        ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop": ("",)}, "stop"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a finite number"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"), ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"min_tokens": 20}, "min_tokens must be in 0..max_new_tokens (16)"), ({"min_tokens": 1.5}, "min_tokens"),
        ({"logit_bias": {3: 101}}, "logit_bias[3] must be a number in [-100, 100]"),
        ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"3": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": [(3, 1), (3, 2)]}, "names a token id twice"), ({"logit_bias": 5}, "must map token ids"),
    ):
        with pytest.raises(ConfigError) as caught:
            SamplingParams(**bad)  # type: ignore[arg-type]
        assert says in str(caught.value) and "\n" not in str(caught.value), (bad, str(caught.value))


def test_logit_bias_is_plain_sorted_pairs_from_a_mapping_or_pairs() -> None:
    """A mapping and the same pairs give one value (hashable, picklable to the ranks)."""
    import pickle

    given = SamplingParams(logit_bias={9: -1, 2: 3.5})
    assert given.logit_bias == ((2, 3.5), (9, -1.0)) == SamplingParams(logit_bias=[(9, -1), (2, 3.5)]).logit_bias
    assert pickle.loads(pickle.dumps(given)) == given and hash(given) == hash(SamplingParams(logit_bias={2: 3.5, 9: -1}))
    assert not SamplingParams().processed and SamplingParams(min_tokens=1).processed
    assert not SamplingParams(min_p=0.5).processed  # greedy: min_p keeps the likeliest, which greedy takes anyway


def test_generation_config_defaults_apply_only_where_not_given() -> None:
    defaults = {"do_sample": True, "temperature": 0.8, "top_p": 0.9}
    assert SamplingParams().with_defaults(defaults, ()).temperature == 0.8
    assert (SamplingParams(temperature=0.5).with_defaults(defaults, ("temperature",))
            == SamplingParams(temperature=0.5, top_p=0.9))
    assert SamplingParams().with_defaults({**defaults, "do_sample": False}, ()) == SamplingParams()
