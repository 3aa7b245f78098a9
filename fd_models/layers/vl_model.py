"""What both VL models do around their own parts: weights by published name, the prompt with its
pictures spliced in, and a language model that owns the cache, decode and capture."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import paddle
from paddle import nn

from fd_core import WeightSpec
from fd_core.models import GraphBackend
from fd_models.layers import params
from fd_models.layers.decoder import CausalLM, as_int64
from fd_models.layers.multimodal import (
    batch_pictures,
    batch_positions,
    encode_batch,
    scatter_rows,
)


class PictureTextModel(nn.Layer):
    """A vision tower feeding a `CausalLM`; `image=None` means a text-only prompt.

    A subclass sets `renames`, `language_model`, `vision_config` (its `spatial_merge_size`) and
    `image_token_id`, and implements `_encode` (one picture) and `_prefill_pictures` (the decoder run).
    """

    renames: tuple[tuple[str, str], ...] = ()  # (internal prefix, checkpoint prefix): the published names
    language_model: CausalLM
    vision_config: Any
    image_token_id: int

    # -- weights -------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, WeightSpec]:
        """Every checkpoint tensor with its full shape and tp split axis (the vision tower's replicated)."""
        return params.weight_specs(self, self.renames)

    def ignored_tensors(self) -> set[str]:
        """A tied head's copy of the embedding may be present and is not loaded."""
        return self.language_model.ignored_tensors()

    def load_weights(self, shards: Mapping[str, Any]) -> None:
        params.load_weights(self, shards, self.renames)

    def release_weights(self) -> None:
        params.release_weights(self)

    # -- prefill and decode --------------------------------------------------------------
    def prefill_length(self, input_ids: Any, image: Any = None) -> int:
        """The prompt length: image tokens are placeholders in the prompt, nothing is prepended."""
        return int(np.asarray(input_ids).shape[1])

    def prefill(
        self, input_ids: Any, image: Any = None, pad: Sequence[int] | None = None,
        cache_rows: Sequence[int] | None = None,
    ) -> paddle.Tensor:
        """Run the prompt [B, S] with its image(s) at their placeholders (see `batch_pictures`) into cache rows
        `cache_rows` (default 0..B-1); last-position logits [B, vocab].

        `pad[b]` leading ids of row b are padding (text-only batches of unequal prompts).

        Pictures are float [C, H, W] in [0, 1]; they are resized and normalised as the checkpoint's processor says.
        """
        ids = as_int64(input_ids)
        embeds = self.language_model.model.embed_tokens(ids)
        if image is None:
            return self.language_model.prefill_embeds(embeds, pad=pad, cache_rows=cache_rows)
        if pad is not None and any(pad):
            raise ValueError(
                "prompts with pictures are not padded: give a batch of them equal lengths, or run them one by one"
            )
        host_ids = ids.numpy()
        grids, rows = encode_batch(batch_pictures(image, host_ids.shape[0]), self._encode)
        positions, delta = batch_positions(host_ids, self.image_token_id, grids, self.vision_config.spatial_merge_size)
        slots = np.flatnonzero(host_ids[0] == self.image_token_id)
        embeds = scatter_rows(embeds, paddle.stack([row[0] for row in rows]), slots)
        return self._prefill_pictures(host_ids, embeds, rows, slots, positions, delta, cache_rows)

    def _encode(self, picture: np.ndarray) -> tuple[tuple[int, int, int], list[paddle.Tensor]]:
        """One picture -> (its grid, [its embeddings at the placeholders, any further features])."""
        raise NotImplementedError

    def _prefill_pictures(
        self, host_ids: np.ndarray, embeds: paddle.Tensor, rows: list[list[paddle.Tensor]], slots: np.ndarray,
        positions: Any, delta: Any,
        cache_rows: Sequence[int] | None = None,
    ) -> paddle.Tensor:
        """The decoder's run over `embeds` (pictures spliced in at `slots`) into cache rows `cache_rows`;
        last-position logits [B, vocab]."""
        raise NotImplementedError

    def allocate_cache(self, batch_size: int, max_len: int, keep: bool = False) -> None:
        self.language_model.allocate_cache(batch_size, max_len, keep)

    def cache_bytes(self) -> int:
        """Bytes the language model's KV cache holds."""
        return self.language_model.cache_bytes()

    def decode_step(self, token_ids: Any, position: int | Sequence[int]) -> paddle.Tensor:
        """One text token per cache row at cache slot `position[b]` (its rotary position
        offset by its pictures' delta)."""
        return self.language_model.decode_step(token_ids, position)

    def capture(self, graph_backend: GraphBackend, batch_size: int) -> None:
        """Capture the language model's decode step (graphs live on `self.language_model`)."""
        self.language_model.capture(graph_backend, batch_size)
