"""Every built-in architecture: prefill + greedy decode, tp=2 == tp=1, captured == eager, weight reload, graph clear."""

from __future__ import annotations

import numpy as np
import pytest

TOL = 1e-4


def _captured(arch, kit, batch_size: int | None = None, ctx=None):
    """A loaded model with a cache and a to_static capture for `batch_size` (default: the prompt's)."""
    model = kit.build_loaded(arch, ctx)
    ids, image = kit.prompt(arch)
    graphs = kit.ToStaticGraphs()
    model.allocate_cache(ids.shape[0], 40)
    model.capture(graphs, batch_size or ids.shape[0])
    return model, ids, image, graphs


def test_prefill_then_greedy_decode(arch, kit) -> None:
    model = kit.build_loaded(arch)
    ids, image = kit.prompt(arch)
    history, tokens = kit.greedy(model, ids, image)
    vocab = arch.preset_config().vocab_size
    assert all(step.shape == (ids.shape[0], vocab) and step.dtype == np.float32 for step in history)
    assert all(np.isfinite(step).all() for step in history)
    assert tokens.shape == (ids.shape[0], 4) and tokens.min() >= 0 and tokens.max() < vocab


def test_tp2_shards_match_tp1(arch, kit) -> None:
    """Two rank models in threads, summing through a barrier all-reduce, reproduce the tp=1 logits."""
    ids, image = kit.prompt(arch)
    ref_logits, ref_tokens = kit.greedy(kit.build_loaded(arch), ids, image)
    ranks = kit.run_ranks(2, lambda ctx: kit.greedy(kit.build_loaded(arch, ctx), ids, image))
    for logits, tokens in ranks:
        for got, want in zip(logits, ref_logits, strict=True):
            np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
        np.testing.assert_array_equal(tokens, ref_tokens)


def test_captured_decode_matches_eager(arch, kit, monkeypatch) -> None:
    ids, image = kit.prompt(arch)
    eager_logits, eager_tokens = kit.greedy(kit.build_loaded(arch), ids, image)
    model, ids, image, graphs = _captured(arch, kit)
    # After capture, decode must replay the static program, never re-run the Python layers.
    text_model = getattr(model, "language_model", model).model
    monkeypatch.setattr(type(text_model), "forward", _forbidden_after_capture(type(text_model).forward))
    captured_logits, captured_tokens = kit.greedy(model, ids, image)
    assert graphs.replays == 4
    np.testing.assert_array_equal(captured_tokens, eager_tokens)
    for got, want in zip(captured_logits, eager_logits, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_rank_of_two_decode_traces_like_eager(arch, kit) -> None:
    """The tp>1 paths (masked vocab lookup, padded logits, reductions) trace under to_static too."""
    ctx = kit.make_ctx(2, 1)  # identity all-reduce: one rank's partial sums, compared graph vs eager
    ids, image = kit.prompt(arch)
    eager_logits, _ = kit.greedy(kit.build_loaded(arch, ctx), ids, image)
    model, _, _, graphs = _captured(arch, kit, ctx=ctx)
    captured_logits, _ = kit.greedy(model, ids, image)
    assert graphs.replays == 4
    for got, want in zip(captured_logits, eager_logits, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _forbidden_after_capture(forward):
    """Wrap TextModel.forward: allowed for prefill (S > 1), an error for an eager decode step."""

    def guarded(self, embeds, *args, **kwargs):
        if embeds.shape[1] == 1:
            raise AssertionError("decode ran eagerly although a graph was captured for this batch size")
        return forward(self, embeds, *args, **kwargs)

    return guarded


def test_release_then_load_gives_same_output(arch, kit) -> None:
    from fd_core.runtime.weights import random_state_dict

    model = kit.build_loaded(arch)
    ids, image = kit.prompt(arch)
    before, _ = kit.greedy(model, ids, image, steps=2)
    model.release_weights()
    assert not any(p._is_initialized() for p in model.parameters())
    model.load_weights(random_state_dict(model.weight_specs(), kit.seed))
    after, _ = kit.greedy(model, ids, image, steps=2)
    for got, want in zip(after, before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_clear_graphs_hook_drops_graphs_and_recapture_works(arch, kit) -> None:
    import importlib

    plugin = importlib.import_module(f"fd_models.{arch.name}.plugin")
    model, ids, image, graphs = _captured(arch, kit)
    kit.greedy(model, ids, image, steps=1)
    assert graphs.replays == 1

    assert plugin.fd_clear_graphs(model) is True
    assert graphs.clears == 1 and not graphs.graphs
    lm = getattr(model, "language_model", model)
    assert lm.graphs is None
    eager, _ = kit.greedy(model, ids, image, steps=2)
    assert graphs.replays == 1  # ran eagerly

    model.capture(graphs, ids.shape[0])
    replayed, _ = kit.greedy(model, ids, image, steps=2)
    assert graphs.replays == 3
    for got, want in zip(replayed, eager, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_other_packages_clear_hooks_ignore_the_model(arch, kit) -> None:
    import importlib

    model = kit.build_loaded(arch)
    for other in kit.architectures():
        if other.name != arch.name:
            assert importlib.import_module(f"fd_models.{other.name}.plugin").fd_clear_graphs(model) is None


def test_decode_without_capture_for_this_batch_runs_eager(arch, kit) -> None:
    model, ids, image, graphs = _captured(arch, kit, batch_size=1)  # not the prompt's batch size
    kit.greedy(model, ids, image, steps=1)
    assert graphs.replays == 0


def test_prefill_requires_a_cache(arch, kit) -> None:
    model = kit.build_loaded(arch)
    ids, image = kit.prompt(arch)
    with pytest.raises(RuntimeError, match="allocate_cache"):
        model.prefill(ids, image)


def test_captured_buckets_of_cache_length_match_eager(kit) -> None:
    """A cache longer than the smallest bucket is captured once per bucket; decode crosses from one to the next."""
    from fd_models.layers.decoder import BUCKET_MIN, cache_buckets

    arch = kit.architectures()[0]
    max_len = BUCKET_MIN + 8
    assert cache_buckets(max_len) == [BUCKET_MIN, max_len]
    ids = np.arange(1, BUCKET_MIN - 2, dtype=np.int64).reshape(1, -1)  # decode passes position BUCKET_MIN

    def decode(model) -> list[np.ndarray]:
        model.allocate_cache(1, max_len)
        logits, out = model.prefill(ids), []
        for step in range(6):
            token = logits.argmax(-1, keepdim=True)
            logits = model.decode_step(token, ids.shape[1] + step)
            out.append(logits.numpy())
        return out

    eager = decode(kit.build_loaded(arch))
    model = kit.build_loaded(arch)
    graphs = kit.ToStaticGraphs()
    model.allocate_cache(1, max_len)
    model.capture(graphs, 1)
    assert sorted(graphs.graphs) == [(1, BUCKET_MIN), (1, max_len)]
    captured = decode(model)
    assert graphs.replays == 6
    for got, want in zip(captured, eager, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_decode_writes_the_cache_in_place(kit) -> None:
    """The step writes its keys and values into the same cache tensors, at its position only."""
    arch = kit.architectures()[0]
    model = kit.build_loaded(arch)
    ids, _ = kit.prompt(arch)
    model.allocate_cache(ids.shape[0], 40)
    model.prefill(ids)
    caches = list(model._caches)
    before = caches[0].numpy().copy()
    model.decode_step(np.zeros((ids.shape[0], 1), dtype=np.int64), ids.shape[1])
    assert all(a is b for a, b in zip(model._caches, caches, strict=True))
    after = caches[0].numpy()
    changed = np.flatnonzero(np.any(after != before, axis=(0, 1, 3)))  # caches [B, kv_heads, T, d]
    assert changed.tolist() == [ids.shape[1]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_checkpoint_pieces_fill_the_parameters_exactly(kit, tmp_path, monkeypatch, dtype: str, tp_rank: int) -> None:
    """Pieces of a few rows each (read with pread, widened from bfloat16) fill every shard as one whole
    read does, after a release too."""
    import paddle

    from fd_core.runtime import weights

    arch = kit.architectures()[0]
    ctx = kit.make_ctx(2, tp_rank)
    model = kit.build_loaded(arch, ctx)
    state = weights.random_state_dict(model.weight_specs(), kit.seed)
    weights.save_checkpoint(tmp_path / "ckpt", dict(arch.preset), {name: state[name] for name in state}, dtype)
    shards = weights.load_checkpoint(tmp_path / "ckpt", model.weight_specs(), tp_rank, 2)
    monkeypatch.setattr(weights, "CHUNK_BYTES", 4096)  # a few rows a piece
    pieces = list(shards.chunks("model.embed_tokens.weight"))
    assert len(pieces) > 2 and [start for start, _ in pieces] == sorted(start for start, _ in pieces)
    model.release_weights()
    model.load_weights(shards)
    checked_columns = False
    for name, param in model.named_parameters():
        if hasattr(param, "fd_spec") and len(param.shape) > 1:
            want = shards[name]
            np.testing.assert_array_equal(param.numpy(), want.numpy() if isinstance(want, paddle.Tensor) else want,
                                          err_msg=name)
        elif hasattr(param, "fd_columns"):  # [out, in] shards transposed side by side (the fused feed-forward)
            prefix = name.rsplit(".", 1)[0] + "."
            parts = [shards[prefix + part] for part, _ in param.fd_columns]
            want = np.concatenate([(p.numpy() if isinstance(p, paddle.Tensor) else p).T for p in parts], axis=1)
            np.testing.assert_array_equal(param.numpy(), want, err_msg=name)
            checked_columns = True
    assert arch.name not in ("ernie4_5", "qwen3_vl") or checked_columns, "no fused parameter was checked"


def test_a_cache_that_fails_to_grow_says_so_and_keeps_no_half_cache(kit, monkeypatch) -> None:
    """Growing frees the old cache a tensor at a time; a failed allocation midway is one MemoryError, and the model
    holds no cache after it (a decode step asks for allocate_cache again instead of reading freed rows)."""
    from fd_models.layers import decoder

    arch = kit.architectures()[0]
    model = kit.build_loaded(arch)
    ids, _ = kit.prompt(arch)
    model.allocate_cache(ids.shape[0], 16)
    model.prefill(ids)
    zeros, made = decoder.paddle.zeros, []

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if len(made) == 3:
            raise MemoryError("(test) out of memory")
        made.append(args)
        return zeros(*args, **kwargs)

    monkeypatch.setattr(decoder.paddle, "zeros", failing)
    with pytest.raises(MemoryError, match=r"^allocating the KV cache .* failed after 3 tensors: \(test\) out of memory; the sequences in its rows are lost"):
        model.allocate_cache(ids.shape[0], 64, keep=True)
    monkeypatch.setattr(decoder.paddle, "zeros", zeros)
    with pytest.raises(RuntimeError, match="allocate_cache"):
        model.decode_step(np.zeros((ids.shape[0], 1), dtype=np.int64), ids.shape[1])
