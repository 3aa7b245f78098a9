"""The one decoder every architecture reuses, and the causal LM around it (KV cache, graphs, weights).

Options select per-architecture differences (per-head q/k RMSNorm for Qwen3); names of sublayers
follow Hugging Face checkpoints (`model.layers.0.self_attn.q_proj.weight`, `model.norm.weight`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import inspect

import numpy as np
import paddle
from paddle import nn

from fd_core.config import ModelConfig
from fd_core.models import GraphBackend
from fd_core.weights import WeightSpec
from fd_models.layers import params
from fd_models.layers.attention import Attention
from fd_models.layers.mlp import SwiGLUMLP
from fd_models.layers.norm import RMSNorm
from fd_models.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from fd_models.layers.rotary import rope_tables

_MASKED = -1e9  # additive mask for keys after the query's position (float32 softmax gives them 0)


@dataclass(frozen=True)
class DecoderOptions:
    """What differs between the decoders of the supported architectures."""

    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope


def _with_positional_signature(fn: Any, names: Sequence[str]) -> Any:
    """`fn(*args)` presented with named positional parameters: paddle.jit.to_static rejects *args."""

    def decode_fn(*args: paddle.Tensor) -> tuple[paddle.Tensor, ...]:
        return fn(*args)

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    decode_fn.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in names])
    decode_fn.__doc__ = fn.__doc__
    return decode_fn


def as_int64(value: Any) -> paddle.Tensor:
    """A numpy array, list or tensor of token ids as an int64 tensor."""
    if isinstance(value, paddle.Tensor):
        return value.astype("int64")
    return paddle.to_tensor(np.asarray(value, dtype=np.int64))


class DecoderLayer(nn.Layer):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, ctx: Any, options: DecoderOptions) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.resolved_head_dim, ctx, eps if options.qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, ctx)

    def forward(self, x, rope, place, mask, cache_k, cache_v):  # noqa: ANN001, ANN201 - see Attention.forward
        attn, cache_k, cache_v = self.self_attn(self.input_layernorm(x), rope, place, mask, cache_k, cache_v)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache_k, cache_v


class TextModel(nn.Layer):
    """Embedding, decoder layers and final norm (checkpoint prefix `model.`)."""

    def __init__(self, config: ModelConfig, ctx: Any, options: DecoderOptions) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
        self.layers = nn.LayerList([DecoderLayer(config, ctx, options) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, embeds: paddle.Tensor, positions: paddle.Tensor, caches: Sequence[paddle.Tensor]
    ) -> tuple[paddle.Tensor, list[paddle.Tensor]]:
        """embeds [B, S, H] at int64 positions [S], caches [k0, v0, k1, v1, ...] -> (hidden [B, S, H], new caches)."""
        slots = paddle.arange(caches[0].shape[2], dtype="int64").unsqueeze(0)
        where = positions.unsqueeze(-1)
        place = (slots == where).astype(embeds.dtype)
        mask = ((slots <= where).astype("float32") - 1.0) * -_MASKED
        rope = rope_tables(positions, self.config.resolved_head_dim, self.config.rope_theta)
        x, new_caches = embeds, []
        for i, layer in enumerate(self.layers):
            x, cache_k, cache_v = layer(x, rope, place, mask, caches[2 * i], caches[2 * i + 1])
            new_caches += [cache_k, cache_v]
        return self.norm(x), new_caches


class CausalLM(nn.Layer):
    """A decoder-only language model with a static-shape KV cache and an optional captured decode graph.

    The model keeps only its caches and its graph backend; the caller passes every position.
    """

    def __init__(self, config: ModelConfig, ctx: Any, options: DecoderOptions = DecoderOptions()) -> None:
        super().__init__()
        self.config = config
        self.ctx = ctx
        self.model = TextModel(config, ctx, options)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, ctx, tied)
        self._caches: list[paddle.Tensor] | None = None
        self._graphs: GraphBackend | None = None
        cache_names = [f"cache_{i}_{kv}" for i in range(config.num_hidden_layers) for kv in "kv"]
        # The pure step handed to graph backends: (token_ids, position, cache_0_k, cache_0_v, ...).
        self.decode_fn = _with_positional_signature(self._decode, ["token_ids", "position", *cache_names])

    # -- weights -------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, WeightSpec]:
        """Every checkpoint tensor with its full shape and tp split axis."""
        return params.weight_specs(self)

    def load_weights(self, shards: Mapping[str, np.ndarray]) -> None:
        """Assign this rank's shards to the parameters (restoring released storage)."""
        params.load_weights(self, shards)

    def release_weights(self) -> None:
        """Free parameter storage; load_weights restores it."""
        params.release_weights(self)

    # -- cache and steps -----------------------------------------------------------------
    def cache_shape(self, batch_size: int, max_len: int) -> list[int]:
        """[B, local kv heads, max_len, head_dim]: the shape of every per-layer k and v cache."""
        kv_heads = self.config.num_key_value_heads // self.ctx.parallel.tp_size
        return [batch_size, kv_heads, max_len, self.config.resolved_head_dim]

    def allocate_cache(self, batch_size: int, max_len: int) -> None:
        """Preallocate zeroed k/v caches for every layer with fixed shapes."""
        shape = self.cache_shape(batch_size, max_len)
        self._caches = [paddle.zeros(shape, dtype="float32") for _ in range(2 * self.config.num_hidden_layers)]

    def _require_cache(self, batch_size: int, length: int = 1) -> list[paddle.Tensor]:
        if self._caches is None:
            raise RuntimeError("allocate_cache(batch_size, max_len) must be called before prefill/decode")
        cached_batch, _, max_len, _ = self._caches[0].shape
        if cached_batch != batch_size or length > max_len:
            raise ValueError(f"input batch {batch_size} x {length} tokens does not fit the cache [{cached_batch}, max_len={max_len}]")
        return self._caches

    def _decode(self, token_ids: paddle.Tensor, position: paddle.Tensor, *caches: paddle.Tensor) -> tuple[paddle.Tensor, ...]:
        """Pure decode step: (token_ids [B, 1] int64, position [1] int64, *caches) -> (logits [B, vocab], *new caches)."""
        hidden, new_caches = self.model(self.model.embed_tokens(token_ids), position, caches)
        return (self.lm_head(hidden[:, -1]), *new_caches)

    def prefill_embeds(self, embeds: paddle.Tensor) -> paddle.Tensor:
        """Run embeds [B, S, H] causally, filling cache positions [0, S); return last-position logits [B, vocab]."""
        caches = self._require_cache(embeds.shape[0], embeds.shape[1])
        positions = paddle.arange(embeds.shape[1], dtype="int64")
        hidden, self._caches = self.model(embeds, positions, caches)
        return self.lm_head(hidden[:, -1])

    def prefill_length(self, input_ids: Any, image: Any = None) -> int:
        """Cache positions `prefill` fills (the prompt length): the first decode position."""
        return int(as_int64(input_ids).shape[1])

    def prefill(self, input_ids: Any, image: Any = None) -> paddle.Tensor:
        """Run the prompt [B, S] (text only: `image` must be None); return last-position logits [B, vocab]."""
        if image is not None:
            raise ValueError(f"{self.config.architecture} is a text-only model; it takes no image")
        return self.prefill_embeds(self.model.embed_tokens(as_int64(input_ids)))

    def decode_step(self, token_ids: Any, position: int) -> paddle.Tensor:
        """One token per sequence [B, 1] at `position`; replays the captured graph for this batch size if any."""
        ids = as_int64(token_ids).reshape([-1, 1])
        inputs = [ids, paddle.to_tensor([position], dtype="int64"), *self._require_cache(ids.shape[0], position + 1)]
        if self._graphs is not None and self._graphs.has(ids.shape[0]):
            outputs = self._graphs.replay(ids.shape[0], inputs)
        else:
            outputs = self.decode_fn(*inputs)
        self._caches = list(outputs[1:])
        return outputs[0]

    # -- graphs --------------------------------------------------------------------------
    def capture(self, graph_backend: GraphBackend, batch_size: int) -> None:
        """Capture decode_fn for `batch_size` through `graph_backend` (kept as this model's graph state)."""
        if self._caches is None:
            raise RuntimeError("allocate_cache(batch_size, max_len) must be called before capture")
        max_len = self._caches[0].shape[2]
        # Fresh zero caches: capturing must not disturb the live cache (or need its batch size).
        caches = [paddle.zeros(self.cache_shape(batch_size, max_len), dtype="float32") for _ in self._caches]
        example = [paddle.zeros([batch_size, 1], dtype="int64"), paddle.zeros([1], dtype="int64"), *caches]
        graph_backend.capture(batch_size, self.decode_fn, example)
        self._graphs = graph_backend

    def clear_graph_opt_backend(self) -> None:
        """Drop every captured graph; decode runs eagerly until `capture` is called again."""
        if self._graphs is not None:
            self._graphs.clear()
        self._graphs = None
