"""Every built-in architecture: prefill + greedy decode, tp=2 == tp=1, captured == eager, weight reload, graph clear."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.kvcache import KVBatch
from fd_models.layers.rows import Rows

TOL = 1e-4


def _captured(arch, kit, batch_size: int | None = None, ctx=None):
    """A loaded model with a cache and a to_static capture for `batch_size` (default: the prompt's) rows of the
    kit's width."""
    model = kit.build_loaded(arch, ctx)
    ids, image = kit.prompt(arch)
    graphs = kit.ToStaticGraphs()
    rows = Rows(model, ids.shape[0], kit.max_len)
    model.capture(graphs, batch_size or ids.shape[0], rows.width)
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

    model.capture(graphs, ids.shape[0], Rows(model, ids.shape[0], kit.max_len).width)
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
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        model.prefill(ids, image, KVBatch.contiguous(ids.shape[0], 0, ids.shape[1], 16, 3))


def test_a_capture_per_table_width_matches_eager(kit) -> None:
    """Block tables of two widths are two captures; decode crosses from the narrower bucket to the wider one (a row
    table padded with the null block) and gives the eager logits."""
    arch = kit.architectures()[0]
    ids = np.arange(1, 30, dtype=np.int64).reshape(1, -1)  # two blocks of 16, then a third as it decodes

    def decode(model, graphs=None) -> list[np.ndarray]:
        model.allocate_kv_cache(8, 16)
        logits = model.prefill(ids, None, KVBatch.contiguous(1, 0, ids.shape[1], 16, 2))
        out = []
        for step in range(6):
            position = ids.shape[1] + step
            width = 2 if position < 32 else 4  # the narrow bucket, then the wide one
            token = logits.argmax(-1, keepdim=True)
            batch = KVBatch.contiguous(1, position, 1, 16, 3)
            if width == 4:
                batch.block_tables = np.concatenate([batch.block_tables, np.zeros((1, 1), dtype=np.int64)], axis=1)
            else:
                batch.block_tables = batch.block_tables[:, :2]
            if graphs is not None and len(graphs.graphs) < 2:
                model.capture(graphs, 1, width)
            logits = model.decode_step(token, batch)
            out.append(logits.numpy())
        return out

    eager = decode(kit.build_loaded(arch))
    graphs = kit.ToStaticGraphs()
    captured = decode(kit.build_loaded(arch), graphs)
    assert sorted(graphs.graphs) == [(1, 2), (1, 4)]
    assert graphs.replays == 6
    for got, want in zip(captured, eager, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_decode_writes_the_cache_in_place_at_its_slot_only(kit) -> None:
    """The step writes its keys and values into the same cache tensors, at each row's slot only (native layout
    [kv_heads, blocks, block_size, d])."""
    arch = kit.architectures()[0]
    model = kit.build_loaded(arch)
    ids, _ = kit.prompt(arch)
    rows = Rows(model, ids.shape[0], kit.max_len)
    rows.prefill(ids)
    caches = list(model._caches)
    before = caches[0].numpy().copy()
    rows.decode(np.zeros((ids.shape[0], 1), dtype=np.int64))
    assert all(a is b for a, b in zip(model._caches, caches, strict=True))
    after = caches[0].numpy()
    changed = sorted(map(tuple, np.argwhere(np.any(after != before, axis=(0, 3)))))  # (block, offset)
    position = ids.shape[1]
    want = [(1 + r * rows.width + position // 16, position % 16) for r in range(ids.shape[0])]
    assert changed == want


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


def test_a_cache_that_fails_to_allocate_says_so_and_keeps_no_half_cache(kit, monkeypatch) -> None:
    """A failed allocation midway is one MemoryError naming the fix, and the model holds no cache after it (a step
    asks for allocate_kv_cache instead of reading a half cache)."""
    arch = kit.architectures()[0]
    model = kit.build_loaded(arch)
    ids, _ = kit.prompt(arch)
    allocate, made = model.ctx.ops.allocate_kv_cache, []

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if len(made) == 1:
            raise MemoryError("(test) out of memory")
        made.append(args)
        return allocate(*args, **kwargs)

    monkeypatch.setattr(model.ctx.ops, "allocate_kv_cache", failing)
    with pytest.raises(MemoryError, match=r"^allocating the KV cache \(64 blocks of 16 positions x \d+ tensors, float32\) failed after 2 tensors: \(test\) out of memory; ask for fewer blocks"):
        model.allocate_kv_cache(64, 16)
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        model.decode_step(np.zeros((ids.shape[0], 1), dtype=np.int64), KVBatch.contiguous(ids.shape[0], 6, 1, 16, 3))
