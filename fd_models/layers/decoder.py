"""The one decoder every architecture reuses, and the causal LM around it (KV cache, graphs, weights).

Options select per-architecture differences (per-head q/k RMSNorm for Qwen3); names of sublayers
follow Hugging Face checkpoints (`model.layers.0.self_attn`, `model.norm.weight`, ...); a fused parameter
(`self_attn.qkv`, `mlp.gate_up`) maps to the checkpoint tensors it holds (`self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import paddle
from paddle import nn

from fd_core import WeightSpec
from fd_core.config import ModelConfig
from fd_core.models import GraphBackend
from fd_models.layers import params
from fd_models.layers.attention import Attention, CacheIndex, cache_index, write_cache
from fd_models.layers.mlp import SwiGLUMLP
from fd_models.layers.norm import RMSNorm
from fd_models.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from fd_models.layers.rotary import rope_tables

_MASKED = -1e9  # additive mask for keys after the query's position (float32 softmax gives them 0)
# The shortest cache length a decode graph is captured for; each longer bucket doubles it (one trace each).
BUCKET_MIN = 64


@dataclass(frozen=True)
class DecoderOptions:
    """What differs between the decoders of the supported architectures (the rest comes from the config)."""

    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    rope_layout: str = "half"  # "interleaved" for ERNIE-4.5 (pairs 2i, 2i+1); see fd_models.layers.rotary
    mrope_style: str = "qwen3"  # how M-RoPE sections map to frequencies ("ernie" for ERNIE-4.5-VL)
    # The feed-forward of layer i, when not the dense SwiGLU (a mixture of experts, say). A layer whose
    # `takes_vision_mask` is true also receives which tokens are image tokens.
    mlp: Callable[[ModelConfig, Any, int], nn.Layer] | None = None


def _with_positional_signature(fn: Any, names: Sequence[str]) -> Any:
    """`fn(*args)` presented with named positional parameters: paddle.jit.to_static rejects *args."""

    def decode_fn(*args: paddle.Tensor) -> tuple[paddle.Tensor, ...]:
        return fn(*args)

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    # inspect.signature honours __signature__, which typeshed does not declare on functions.
    decode_fn.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in names])  # type: ignore[attr-defined]
    decode_fn.__doc__ = fn.__doc__
    return decode_fn


def cache_buckets(max_len: int) -> list[int]:
    """The cache lengths a decode graph is captured for: powers of two from BUCKET_MIN below max_len, then max_len."""
    sizes, size = [], BUCKET_MIN
    while size < max_len:
        sizes.append(size)
        size *= 2
    return [*sizes, max_len]


def as_int64(value: Any) -> paddle.Tensor:
    """A numpy array, list or tensor of token ids as an int64 tensor."""
    if isinstance(value, paddle.Tensor):
        return value.astype("int64")
    return paddle.to_tensor(np.asarray(value, dtype=np.int64))


class DecoderLayer(nn.Layer):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, ctx: Any, options: DecoderOptions, index: int = 0) -> None:
        super().__init__()
        eps, dtype = config.rms_norm_eps, config.dtype
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ctx, dtype)
        self.self_attn = Attention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.resolved_head_dim, ctx, eps if options.qk_norm else None,
            bias=config.attention_bias, rope_layout=options.rope_layout, dtype=dtype,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ctx, dtype)
        if options.mlp is not None:
            self.mlp = options.mlp(config, ctx, index)
        else:
            self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, ctx, config.mlp_bias, dtype)
        self.mlp_takes_vision_mask = getattr(self.mlp, "takes_vision_mask", False)

    def forward(
        self, x: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor], index: CacheIndex, mask: paddle.Tensor,
        cache_k: paddle.Tensor, cache_v: paddle.Tensor, vision_mask: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """x [B, S, H] through attention (see Attention.forward) and the feed-forward -> [B, S, H]."""
        x = x + self.self_attn(self.input_layernorm(x), rope, index, mask, cache_k, cache_v)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, vision_mask) if self.mlp_takes_vision_mask else self.mlp(h))


class TextModel(nn.Layer):
    """Embedding, decoder layers and final norm (checkpoint prefix `model.`)."""

    def __init__(self, config: ModelConfig, ctx: Any, options: DecoderOptions) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx, config.dtype)
        self.layers = nn.LayerList([DecoderLayer(config, ctx, options, i) for i in range(config.num_hidden_layers)])
        self.mrope_style = options.mrope_style
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx, config.dtype)
        rope = config.extra.get("rope_parameters") or config.extra.get("rope_scaling") or {}
        # M-RoPE sections (Qwen-VL): how many rope frequencies the t, h and w positions drive.
        self.mrope_section: list[int] | None = rope.get("mrope_section")

    def forward(
        self, embeds: paddle.Tensor, positions: paddle.Tensor, caches: Sequence[paddle.Tensor],
        rope_positions: paddle.Tensor | None = None, deepstack: Sequence[paddle.Tensor] = (),
        vision_mask: paddle.Tensor | None = None, slots: paddle.Tensor | None = None,
        start: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """embeds [B, S, H] into cache slots `positions` [S] (or [B, S]: row b at its own) of
        `caches` [k0, v0, k1, v1, ...] (written in place) -> hidden [B, S, H].

        Queries attend over the cache slots `slots` = arange(L) (default: up to the last position),
        masked after each query's own position.

        `rope_positions` are the rotary positions when they differ from the slots: [S] or [B, S] (text
        after an image) or [3, S] (M-RoPE over an image). `deepstack[i]` [B, S, H] is added to the hidden
        states after layer i (Qwen3-VL's DeepStack visual features, zero outside image tokens);
        `vision_mask` [B, S] marks image tokens for mixture-of-experts layers that route by modality.
        `start` [B] is each sequence's first cache slot (its left padding; None: 0): earlier slots are
        masked and its rotary positions count from there, so a padded prompt computes what it would alone.
        """
        if slots is None:
            slots = paddle.arange(positions.shape[0], dtype="int64")  # prefill: slots [0, S)
        if start is None:
            start = paddle.zeros([embeds.shape[0]], dtype="int64")
        # positions [S] (a prefill: every row at the same slots) or [B, S] (a decode step: each row at its own slot).
        per_row = len(positions.shape) == 2
        where = positions.unsqueeze(-1)
        rope_at = positions if rope_positions is None else rope_positions
        section = self.mrope_section if len(rope_at.shape) == 2 and not per_row else None
        # Per sequence: mask [B, 1, 1, S, L] (broadcast over kv heads and their query groups) and
        # rotary tables [B, 1, S, d/2] (broadcast over heads).
        valid = paddle.logical_and(slots.unsqueeze(0) <= where, slots.reshape([1, 1, -1]) >= start.reshape([-1, 1, 1]))
        mask = ((valid.astype("float32") - 1.0) * -_MASKED).unsqueeze(1).unsqueeze(1)
        # [B, S] per row; [S] -> [B, S]; [3, S] -> [3, B, S]
        rows = rope_at - start.reshape([-1, 1]) if per_row else rope_at.unsqueeze(-2) - start.reshape([-1, 1])
        cos, sin = rope_tables(rows, self.config.resolved_head_dim, self.config.rope_theta, section, self.mrope_style)
        rope = (cos.unsqueeze(1), sin.unsqueeze(1))
        # Where every layer writes its keys and values: computed once for the step (caches [B, kv_h, T, d]).
        index = cache_index(positions, embeds.shape[0], caches[0].shape[1])
        x = embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, index, mask, caches[2 * i], caches[2 * i + 1], vision_mask)
            if i < len(deepstack):
                x = x + deepstack[i]
        return self.norm(x)


class CausalLM(nn.Layer):
    """A decoder-only language model with a static-shape KV cache and an optional captured decode graph.

    The model keeps only its caches and its graph backend; the caller passes every position. A
    decode step writes the caches in place and attends over the positions in use: eagerly exactly
    those, in a captured graph the smallest captured bucket of cache length that holds them.
    """

    def __init__(self, config: ModelConfig, ctx: Any, options: DecoderOptions = DecoderOptions()) -> None:
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.model = TextModel(config, ctx, options)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, ctx, tied, config.dtype)
        self._caches: list[paddle.Tensor] | None = None
        self._graphs: GraphBackend | None = None
        # Per cache row, set at its prefill: its first cache slot (its left padding in a batch of unequal
        # prompts) and its rotary delta (rotary position minus cache slot during decode: nonzero after an
        # M-RoPE image, whose tokens take fewer rotary positions than cache slots).
        self._row_start: list[int] = []
        self._row_delta: list[int] = []
        cache_names = [f"cache_{i}_{kv}" for i in range(config.num_hidden_layers) for kv in "kv"]
        # The step handed to graph backends: (token_ids, position, rope_position, slots, start, cache_0_k, cache_0_v,
        # ...) -> logits; it writes the caches in place, so a backend must pass them through by reference.
        self.decode_fn = _with_positional_signature(
            self._decode, ["token_ids", "position", "rope_position", "slots", "start", *cache_names]
        )
        self._slots: dict[int, paddle.Tensor] = {}  # arange(L) per captured bucket length L

    # -- weights -------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, WeightSpec]:
        """Every checkpoint tensor with its full shape and tp split axis."""
        return params.weight_specs(self)

    def ignored_tensors(self) -> set[str]:
        """Checkpoint tensors that may be present and are not loaded: a tied head's copy of the embedding."""
        return {"lm_head.weight"} if self.config.tie_word_embeddings else set()

    def load_weights(self, shards: Mapping[str, np.ndarray]) -> None:
        """Assign this rank's shards to the parameters (restoring released storage)."""
        params.load_weights(self, shards)

    def release_weights(self) -> None:
        """Free parameter storage; load_weights restores it."""
        params.release_weights(self)

    # -- cache and steps -----------------------------------------------------------------
    def cache_shape(self, batch_size: int, max_len: int) -> list[int]:
        """[B, local kv heads, max_len, head_dim]: the shape of every per-layer k and v cache
        (head-major: see attention)."""
        kv_heads = self.config.num_key_value_heads // self.ctx.parallel.tp_size
        return [batch_size, kv_heads, max_len, self.config.resolved_head_dim]

    def allocate_cache(self, batch_size: int, max_len: int, keep: bool = False) -> None:
        """Preallocate k/v caches of `batch_size` rows (slots) for every layer with fixed shapes.

        Zeroed (the same tensors again when the shape is unchanged); with `keep`, holding the current
        cache's rows and positions that fit (a batch that grows while its sequences decode).
        """
        shape = self.cache_shape(batch_size, max_len)
        old = self._caches
        if old is not None and list(old[0].shape) == shape:
            if not keep:
                # A captured graph may hold these very tensors (see capture): keep them, zeroed.
                for cache in old:
                    cache.zero_()
                self._row_start, self._row_delta = [0] * batch_size, [0] * batch_size
            return
        # The old cache goes a tensor at a time as the new one is made (its rows copied in first with `keep`),
        # so the two are never held whole at once: growing 4x2048 to 8x4096 at 0.3B peaked 1160 MiB above
        # the old cache for a 1152 MiB new one, 880 MiB this way.
        previous: list[paddle.Tensor | None] = list(old) if keep and old is not None else []
        self._caches = old = None
        length, rows = ((min(max_len, previous[0].shape[2]), min(batch_size, previous[0].shape[0]))  # type: ignore[union-attr]
                        if previous else (0, 0))
        caches = []
        try:
            for i in range(2 * self.config.num_hidden_layers):
                # paddle's stubs take a dtype name only as a Literal; ModelConfig.dtype is a str, which
                # ModelConfig.check keeps to COMPUTE_DTYPES.
                cache = paddle.zeros(shape, dtype=self.config.dtype)  # type: ignore[arg-type]
                if previous:
                    cache[:rows, :, :length] = previous[i][:rows, :, :length]  # type: ignore[index]
                    previous[i] = None
                caches.append(cache)
        except (MemoryError, RuntimeError) as exc:
            # Part of the old cache is gone: no row can go on, and none may pretend to.
            self._row_start, self._row_delta = [], []
            raise MemoryError(
                f"allocating the KV cache {shape} x {2 * self.config.num_hidden_layers} ({self.config.dtype}) "
                f"failed after {len(caches)} tensors: {exc}; the sequences in its rows are lost; "
                "lower --memory-fraction or the batch"
            ) from exc
        self._caches = caches
        if previous:
            fill = [0] * max(0, batch_size - len(self._row_start))
            self._row_start, self._row_delta = ((self._row_start + fill)[:batch_size],
                                                (self._row_delta + fill)[:batch_size])
        else:
            self._row_start, self._row_delta = [0] * batch_size, [0] * batch_size

    def cache_bytes(self) -> int:
        """Bytes the KV cache holds (0 before allocate_cache)."""
        return sum(int(c.numel()) * c.element_size() for c in self._caches or [])

    def _require_cache(
        self, batch_size: int, length: int = 1, rows: Sequence[int] | None = None,
    ) -> list[paddle.Tensor]:
        if self._caches is None:
            raise RuntimeError("allocate_cache(batch_size, max_len) must be called before prefill/decode")
        cached_batch, _, max_len, _ = self._caches[0].shape
        fits = (all(0 <= r < cached_batch for r in rows) and len(set(rows)) == len(rows) == batch_size
                if rows is not None else cached_batch == batch_size)
        if not fits or length > max_len:
            where = f" into rows {list(rows)}" if rows is not None else ""
            raise ValueError(f"input batch {batch_size} x {length} tokens{where} does not fit the cache "
                             f"[{cached_batch}, max_len={max_len}]")
        return self._caches

    def _decode(
        self, token_ids: paddle.Tensor, position: paddle.Tensor, rope_position: paddle.Tensor, slots: paddle.Tensor,
        start: paddle.Tensor, *caches: paddle.Tensor,
    ) -> paddle.Tensor:
        """Decode step: (token_ids [B, 1], each row's cache slot [B, 1], its rotary position [B, 1], slots attended
        arange(L), first slots [B], *caches) -> logits [B, vocab]."""
        hidden = self.model(self.model.embed_tokens(token_ids), position, caches, rope_position, slots=slots,
                            start=start)
        return self.lm_head(hidden[:, -1])

    def prefill_embeds(
        self, embeds: paddle.Tensor, rope_positions: Any = None, deepstack: Sequence[paddle.Tensor] = (),
        rope_delta: int = 0,
        vision_mask: Any = None, pad: Sequence[int] | None = None, cache_rows: Sequence[int] | None = None,
    ) -> paddle.Tensor:
        """Run embeds [B, S, H] causally into cache slots [0, S) of cache rows `cache_rows` (default 0..B-1); return
        last-position logits [B, vocab]. The other rows of the cache are untouched.

        `rope_positions` [3, S], `deepstack` and `vision_mask` come with an image (see TextModel.forward);
        `rope_delta` is what decode adds to each slot to get its rotary position. `pad[b]` leading
        positions of sequence b are padding (prompts of unequal lengths, left-padded): masked, and its
        rotary positions start after them, so each sequence computes what it would alone.
        """
        batch, length = embeds.shape[0], embeds.shape[1]
        rows = list(range(batch)) if cache_rows is None else [int(r) for r in cache_rows]
        caches = self._require_cache(batch, length, rows)
        pads = [0] * batch if pad is None else [int(p) for p in pad]
        # The prompt runs against a cache of its own rows, then lands in theirs: rows decoding
        # meanwhile keep their cache.
        scratch = [paddle.zeros(self.cache_shape(batch, length), dtype=self.config.dtype) for _ in caches]  # type: ignore[arg-type]  # as in allocate_cache
        positions = paddle.arange(length, dtype="int64")
        rope = None if rope_positions is None else as_int64(rope_positions)
        mask = None if vision_mask is None else paddle.to_tensor(np.asarray(vision_mask, dtype=bool))
        hidden = self.model(embeds, positions, scratch, rope, deepstack, mask, start=as_int64(pads))
        # The scratch's rows 0..B-1 land in the cache's `rows`: the decoder's own write index, its rows renamed.
        scratch_rows, heads, slots = cache_index(positions, batch, scratch[0].shape[1])
        at = (paddle.gather(as_int64(rows), scratch_rows), heads, slots)
        for cache, written in zip(caches, scratch, strict=True):
            write_cache(cache, written, at)
        for row, p in zip(rows, pads, strict=True):
            self._row_start[row], self._row_delta[row] = p, int(rope_delta)
        return self.lm_head(hidden[:, -1])

    def prefill_length(self, input_ids: Any, image: Any = None) -> int:
        """Cache positions `prefill` fills (the prompt length): the first decode position."""
        return int(as_int64(input_ids).shape[1])

    def prefill(
        self, input_ids: Any, image: Any = None, pad: Sequence[int] | None = None,
        cache_rows: Sequence[int] | None = None,
    ) -> paddle.Tensor:
        """Run the prompt [B, S] (text only: `image` must be None) into cache rows `cache_rows`, `pad[b]` of
        row b's leading ids padding; last-position logits [B, vocab]."""
        if image is not None:
            raise ValueError(f"{self.config.architecture} is a text-only model; it takes no image")
        return self.prefill_embeds(self.model.embed_tokens(as_int64(input_ids)), pad=pad, cache_rows=cache_rows)

    def decode_step(self, token_ids: Any, position: int | Sequence[int]) -> paddle.Tensor:
        """One token per cache row [B, 1], row b at cache slot `position[b]` (an int: every row at it); replays the
        captured graph for this batch size if any."""
        ids = as_int64(token_ids).reshape([-1, 1])
        batch = ids.shape[0]
        where = [int(position)] * batch if isinstance(position, (int, np.integer)) else [int(p) for p in position]
        if len(where) != batch:
            raise ValueError(f"decode_step got {len(where)} positions for {batch} rows")
        caches = self._require_cache(batch, max(where) + 1)
        slot = as_int64(np.asarray(where).reshape(-1, 1))
        rope = as_int64((np.asarray(where) + np.asarray(self._row_delta)).reshape(-1, 1))
        start = as_int64(self._row_start)
        bucket = self._bucket(batch, max(where) + 1)
        if bucket is not None:
            inputs = [ids, slot, rope, self._slots[bucket], start, *caches]
            return self._graphs.replay((batch, bucket), inputs)  # type: ignore[union-attr]
        return self.decode_fn(ids, slot, rope, paddle.arange(max(where) + 1, dtype="int64"), start, *caches)

    def _bucket(self, batch_size: int, length: int) -> int | None:
        """The smallest captured cache length holding `length` positions for this batch size, None if none is."""
        if self._graphs is None:
            return None
        return next((b for b in sorted(self._slots) if b >= length and self._graphs.has((batch_size, b))), None)

    # -- graphs --------------------------------------------------------------------------
    def capture(self, graph_backend: GraphBackend, batch_size: int) -> None:
        """Capture decode_fn for `batch_size` through `graph_backend`, once per bucket of cache length
        (keys (batch, L))."""
        if self._caches is None:
            raise RuntimeError("allocate_cache(batch_size, max_len) must be called before capture")
        cached_batch, max_len = self._caches[0].shape[0], self._caches[0].shape[2]
        # The live caches when the batch size is theirs: a backend may keep the tensors it captured
        # with (a device graph's fixed addresses), and the step writes them in place. The trace
        # writes slot 0 of every row, which is put back after (rows may hold sequences mid-decode).
        live = cached_batch == batch_size
        caches = self._caches if live else [
            paddle.zeros(self.cache_shape(batch_size, max_len), dtype=self.config.dtype) for _ in self._caches  # type: ignore[arg-type]  # as in allocate_cache
        ]
        kept = [cache[:, :, :1].clone() for cache in caches] if live else []
        position = paddle.zeros([batch_size, 1], dtype="int64")
        start = paddle.zeros([batch_size], dtype="int64")
        for length in cache_buckets(max_len):
            slots = self._slots.setdefault(length, paddle.arange(length, dtype="int64"))
            example = [paddle.zeros([batch_size, 1], dtype="int64"), position, position, slots, start, *caches]
            graph_backend.capture((batch_size, length), self.decode_fn, example)
        for cache, first in zip(caches, kept, strict=False):
            cache[:, :, :1] = first
        self._graphs = graph_backend

    @property
    def graphs(self) -> GraphBackend | None:
        """The graph backend decode steps replay from (set by `capture`); None while decode runs eagerly."""
        return self._graphs

    def use_graphs(self, graphs: GraphBackend | None) -> None:
        """Replay decode steps from `graphs` (what `graphs` returned after an earlier `capture` of this
        model), or run eagerly with None."""
        self._graphs = graphs

    def clear_graph_opt_backend(self) -> None:
        """Drop every captured graph; decode runs eagerly until `capture` is called again."""
        if self._graphs is not None:
            self._graphs.clear()
        self._graphs = None
