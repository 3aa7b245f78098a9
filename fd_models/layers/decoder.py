"""The one decoder every architecture reuses, and the causal LM around it (paged KV cache, graphs, weights).

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
from fd_core.kvcache import KVBatch
from fd_core.models import GraphBackend, host_tensor
from fd_models.layers import params
from fd_models.layers.attention import Attention, KVStep
from fd_models.layers.mlp import SwiGLUMLP
from fd_models.layers.norm import RMSNorm
from fd_models.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from fd_models.layers.products import prepare_after_load
from fd_models.layers.rotary import rope_tables


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


def as_int64(value: Any) -> paddle.Tensor:
    """A numpy array, list or tensor of token ids as an int64 tensor."""
    if isinstance(value, paddle.Tensor):
        return value.astype("int64")
    return host_tensor(np.asarray(value, dtype=np.int64))


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
        self, x: paddle.Tensor, rope: tuple[paddle.Tensor, paddle.Tensor], step: KVStep, cache_k: paddle.Tensor,
        cache_v: paddle.Tensor, vision_mask: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """x [B, S, H] through attention (see Attention.forward) and the feed-forward -> [B, S, H]."""
        attended = self.self_attn(self.input_layernorm(x), rope, step, cache_k, cache_v)
        # x + attended and its post-attention norm, in one op (add_rms_norm).
        h, x = self.post_attention_layernorm.add_and_norm(attended, x)
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
        self, embeds: paddle.Tensor, rope_positions: paddle.Tensor, step: KVStep, caches: Sequence[paddle.Tensor],
        deepstack: Sequence[paddle.Tensor] = (), vision_mask: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """embeds [B, S, H] at rotary positions `rope_positions` ([B, S]; [3, B, S]: M-RoPE's temporal, height and
        width positions), their keys and values written into `caches` [k0, v0, k1, v1, ...] where `step` says ->
        hidden [B, S, H].

        `deepstack[i]` [B, S, H] is added to the hidden states after layer i (Qwen3-VL's DeepStack visual features,
        zero outside image tokens); `vision_mask` [B, S] marks image tokens for mixture-of-experts layers that route
        by modality.
        """
        section = self.mrope_section if len(rope_positions.shape) == 3 else None
        # Rotary tables [B, 1, S, d/2] (broadcast over heads): each row at its own positions.
        cos, sin = rope_tables(rope_positions, self.config.resolved_head_dim, self.config.rope_theta, section,
                               self.mrope_style)
        rope = (cos.unsqueeze(1), sin.unsqueeze(1))
        x = embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, step, caches[2 * i], caches[2 * i + 1], vision_mask)
            if i < len(deepstack):
                x = x + deepstack[i]
        return self.norm(x)


class CausalLM(nn.Layer):
    """A decoder-only language model over the paged KV cache, with an optional captured decode graph.

    The model keeps only its caches and its graph backend; the caller says where every token goes (a KVBatch:
    block tables, positions, slots). A decode step writes the caches in place and attends through each row's
    block table; captured, it is replayed for the batch size and block-table width it was captured for.
    """

    def __init__(self, config: ModelConfig, ctx: Any, options: DecoderOptions = DecoderOptions()) -> None:
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.model = TextModel(config, ctx, options)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, ctx, tied, config.dtype,
                                      quantizable=not config.float_embeddings)
        self._caches: list[paddle.Tensor] | None = None
        self._graphs: GraphBackend | None = None
        self.block_size = 0
        cache_names = [f"cache_{i}_{kv}" for i in range(config.num_hidden_layers) for kv in "kv"]
        # The step handed to graph backends: (token_ids, rope_position, slot_mapping, block_tables, context_lens,
        # cache_0_k, cache_0_v, ...) -> logits; it writes the caches in place, so a backend must pass them through
        # by reference.
        self.decode_fn = _with_positional_signature(
            self._decode, ["token_ids", "rope_position", "slot_mapping", "block_tables", "context_lens", *cache_names]
        )

    # -- weights -------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, WeightSpec]:
        """Every checkpoint tensor with its full shape and tp split axis."""
        return params.weight_specs(self)

    def ignored_tensors(self) -> set[str]:
        """Checkpoint tensors that may be present and are not loaded: a tied head's copy of the embedding."""
        return {"lm_head.weight"} if self.config.tie_word_embeddings else set()

    def load_weights(self, shards: Mapping[str, np.ndarray]) -> None:
        """Assign this rank's shards to the parameters (restoring released storage), each linear weight prepared for
        its kernel (and quantized, under config.quantization) as it loads."""
        after = prepare_after_load(self.config.quantization, self.config.quantization_group)
        params.load_weights(self, shards, after=after)

    def release_weights(self) -> None:
        """Free parameter storage; load_weights restores it."""
        params.release_weights(self)

    # -- cache and steps -----------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """This rank's kv heads."""
        return self.config.num_key_value_heads // self.ctx.parallel.tp_size

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """The paged KV cache: `num_blocks` blocks of `block_size` positions for every layer's keys and values, in
        the platform's layout (its allocate_kv_cache op); the old cache, if any, is dropped first."""
        self._caches = None
        allocate = self.ctx.ops.allocate_kv_cache
        caches: list[paddle.Tensor] = []
        try:
            for _ in range(self.config.num_hidden_layers):
                caches += list(allocate(num_blocks, block_size, self.kv_heads, self.config.resolved_head_dim,
                                        self.config.dtype))
        except (MemoryError, RuntimeError) as exc:
            raise MemoryError(
                f"allocating the KV cache ({num_blocks} blocks of {block_size} positions x "
                f"{2 * self.config.num_hidden_layers} tensors, {self.config.dtype}) failed after {len(caches)} "
                f"tensors: "
                f"{exc}; ask for fewer blocks (--kv-cache-blocks) or a lower --memory-fraction"
            ) from exc
        self._caches, self.block_size = caches, block_size

    def cache_bytes(self) -> int:
        """Bytes the KV cache holds (0 before allocate_kv_cache)."""
        return sum(int(c.numel()) * c.element_size() for c in self._caches or [])

    def read_kv(self, slots: paddle.Tensor) -> list[paddle.Tensor]:
        """Every layer's keys and values at `slots` [T] (its read_kv_cache op): [T, kv_h, d] each, layer by layer,
        the key before the value."""
        caches = self._require_cache()
        out: list[paddle.Tensor] = []
        for k_cache, v_cache in zip(caches[0::2], caches[1::2], strict=True):
            out += list(self.ctx.ops.read_kv_cache(k_cache, v_cache, slots))
        return out

    def write_kv(self, slots: paddle.Tensor, parts: list[paddle.Tensor]) -> None:
        """`parts` as read_kv gives them written at `slots` [T] of every layer (its write_kv_cache op)."""
        caches = self._require_cache()
        for layer, (k_cache, v_cache) in enumerate(zip(caches[0::2], caches[1::2], strict=True)):
            self.ctx.ops.write_kv_cache(parts[2 * layer], parts[2 * layer + 1], k_cache, v_cache, slots)

    def _require_cache(self) -> list[paddle.Tensor]:
        if self._caches is None:
            raise RuntimeError("allocate_kv_cache(num_blocks, block_size) must be called before prefill or decode")
        return self._caches

    def _decode(
        self, token_ids: paddle.Tensor, rope_position: paddle.Tensor, slot_mapping: paddle.Tensor,
        block_tables: paddle.Tensor, context_lens: paddle.Tensor, *caches: paddle.Tensor,
    ) -> paddle.Tensor:
        """Decode step: (token_ids [B, 1], rotary positions [B, 1], slots [B], block tables [B, W], context lengths [B],
        *caches) -> logits [B, vocab]."""
        step = KVStep(slot_mapping, block_tables, context_lens=context_lens)
        hidden = self.model(self.model.embed_tokens(token_ids), rope_position, step, caches)
        return self.lm_head(hidden[:, -1])

    def prefill_embeds(
        self, embeds: paddle.Tensor, batch: KVBatch, rope_positions: Any = None,
        deepstack: Sequence[paddle.Tensor] = (), vision_mask: Any = None, every: bool = False,
    ) -> paddle.Tensor:
        """Run embeds [B, S, H] (row b's first batch.lengths[b] real, the rest padding) into the cache at the positions
        and slots `batch` gives; return the logits of each row's last new token [B, vocab] (`every`: of every new
        position, [B, S, vocab], padding positions included). Text rows (more than one, no pictures) run packed: only
        their real tokens, the padding positions' logits then zero.

        `rope_positions` [3, S] or [3, B, S] (M-RoPE over pictures), `deepstack` and `vision_mask` come with pictures
        (see
        TextModel.forward); otherwise row b's rotary positions are batch.starts[b] + i + batch.rope_deltas[b].
        """
        caches = self._require_cache()
        rows, length = embeds.shape[0], embeds.shape[1]
        starts = np.asarray(batch.starts, dtype=np.int64)
        # A subclass with layers of its own that cannot take a packed step sets packs_rows = False.
        if self.packs_rows and rope_positions is None and not deepstack and vision_mask is None and rows > 1:
            return self._packed(embeds, batch, every)
        if rope_positions is None:
            at = starts[:, None] + np.arange(length)[None, :] + np.asarray(batch.rope_deltas, dtype=np.int64)[:, None]
            rope = as_int64(at)
        else:
            rope = as_int64(rope_positions)
            if len(rope.shape) == 2:  # [3, S]: every row's pictures at the same places
                rope = rope.unsqueeze(1).expand([3, rows, length])
        step = KVStep(as_int64(np.asarray(batch.slot_mapping).reshape(-1)), as_int64(batch.block_tables),
                      prefix_lens=as_int64(starts))
        mask = None if vision_mask is None else host_tensor(np.asarray(vision_mask, dtype=bool))
        hidden = self.model(embeds, rope, step, caches, deepstack, mask)
        if every:
            return self.lm_head(hidden.reshape([rows * length, -1])).reshape([rows, length, -1])
        last = as_int64(np.asarray(batch.lengths, dtype=np.int64) - 1 + np.arange(rows) * length)
        return self.lm_head(paddle.gather(hidden.reshape([rows * length, -1]), last))

    # The engine may put decode rows (one new token) beside prefill chunks in one prefill call: text rows are packed
    # end to end, so a row costs its own tokens, not the widest row's (CausalModel.packs_rows).
    packs_rows = True

    def _packed(self, embeds: paddle.Tensor, batch: KVBatch, every: bool) -> paddle.Tensor:
        """prefill_embeds for text rows: only the real tokens [1, T, H] run (rows end to end, attention through
        paged_packed_attention); the logits of each row's last token [B, vocab], or (`every`) of every position
        [B, S, vocab] with zeros at the padding."""
        caches = self._require_cache()
        rows, length = embeds.shape[0], embeds.shape[1]
        starts = np.asarray(batch.starts, dtype=np.int64)
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        real = np.flatnonzero((np.arange(length)[None, :] < lengths[:, None]).reshape(-1))
        at = (starts[:, None] + np.arange(length)[None, :]
              + np.asarray(batch.rope_deltas, dtype=np.int64)[:, None]).reshape(-1)[real]
        bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        step = KVStep(as_int64(np.asarray(batch.slot_mapping).reshape(-1)[real]), as_int64(batch.block_tables),
                      context_lens=as_int64(starts + lengths), query_starts=as_int64(bounds))
        packed = paddle.gather(embeds.reshape([rows * length, -1]), as_int64(real)).unsqueeze(0)
        hidden = self.model(packed, as_int64(at.reshape(1, -1)), step, caches)[0]  # [T, H]
        if not every:
            return self.lm_head(paddle.gather(hidden, as_int64(bounds[1:] - 1)))
        logits = self.lm_head(hidden)
        spread = paddle.zeros([rows * length, logits.shape[-1]], dtype=logits.dtype)
        return paddle.scatter(spread, as_int64(real), logits).reshape([rows, length, -1])

    def prefill(self, input_ids: Any, image: Any = None, batch: KVBatch | None = None) -> paddle.Tensor:
        """Run the new tokens [B, S] (text only: `image` must be None) into the cache where `batch` says; the logits of
        each row's last new token [B, vocab]."""
        if image is not None:
            raise ValueError(f"{self.config.architecture} is a text-only model; it takes no image")
        if batch is None:
            raise ValueError(
                "prefill needs a KVBatch saying where the tokens go (fd_models.layers.rows.Rows makes one)"
            )
        return self.prefill_embeds(self.model.embed_tokens(as_int64(input_ids)), batch)

    def prefill_every(self, input_ids: Any, batch: KVBatch) -> paddle.Tensor:
        """As prefill (text only), returning the logits of every new position [B, S, vocab]: a prompt scored in one
        prefill (CausalModel.prefill_every)."""
        return self.prefill_embeds(self.model.embed_tokens(as_int64(input_ids)), batch, every=True)

    def decode_step(self, token_ids: Any, batch: KVBatch) -> paddle.Tensor:
        """One token per row [B, 1] at position batch.starts[b] of its sequence; replays the graph captured for this
        batch size and block-table width if there is one."""
        ids = as_int64(token_ids).reshape([-1, 1])
        rows = ids.shape[0]
        starts = np.asarray(batch.starts, dtype=np.int64)
        if len(starts) != rows:
            raise ValueError(f"decode_step got {len(starts)} rows of cache positions for {rows} tokens")
        caches = self._require_cache()
        tables = np.asarray(batch.block_tables, dtype=np.int64)
        inputs = [ids, as_int64((starts + np.asarray(batch.rope_deltas, dtype=np.int64)).reshape(-1, 1)),
                  as_int64(np.asarray(batch.slot_mapping).reshape(-1)), as_int64(tables), as_int64(starts + 1), *caches]
        key = (rows, int(tables.shape[1]))
        if self._graphs is not None and self._graphs.has(key):
            return self._graphs.replay(key, inputs)
        return self.decode_fn(*inputs)

    # -- graphs --------------------------------------------------------------------------
    def capture(self, graph_backend: GraphBackend, batch_size: int, table_width: int) -> None:
        """Capture decode_fn for `batch_size` rows and block tables `table_width` blocks wide through `graph_backend`
        (key (batch_size, table_width)); later decode steps of that shape replay it."""
        caches = self._require_cache()
        # Every example row points at the null block (block 0): the trace's writes land where nothing is read.
        zeros = paddle.zeros([batch_size, 1], dtype="int64")
        example = [zeros, zeros, paddle.zeros([batch_size], dtype="int64"),
                   paddle.zeros([batch_size, table_width], dtype="int64"), paddle.ones([batch_size], dtype="int64"),
                   *caches]
        graph_backend.capture((batch_size, table_width), self.decode_fn, example)
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
