"""What both VL models do around their own parts: weights by published name, the prompt with its
pictures spliced in, and a language model that owns the cache, decode and capture."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import paddle
from paddle import nn

from fd_core import WeightSpec
from fd_core.kvcache import KVBatch
from fd_core.models import GraphBackend
from fd_models.layers import params
from fd_models.layers.decoder import CausalLM, as_int64
from fd_models.layers.multimodal import (
    batch_pictures,
    batch_positions,
    encode_batch,
    scatter_rows,
)
from fd_models.layers.products import prepare_after_load


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
        """As the text model's: each linear weight prepared (and quantized, under config.quantization) as it loads."""
        params.load_weights(self, shards, self.renames,
                            after=prepare_after_load(self.language_model.config.quantization,
                                                     self.language_model.config.quantization_group))

    def release_weights(self) -> None:
        params.release_weights(self)

    # -- prefill and decode --------------------------------------------------------------
    # Text rows are packed end to end as the text model packs them (CausalModel.packs_rows); a prompt with pictures
    # is prefilled alone.
    packs_rows = True

    def prefill_every(self, input_ids: Any, batch: KVBatch) -> paddle.Tensor:
        """As prefill for a prompt without pictures, returning the logits of every new position [B, S, vocab]
        (CausalModel.prefill_every: a prompt scored in one prefill)."""
        ids = as_int64(input_ids)
        return self.language_model.prefill_embeds(self.language_model.model.embed_tokens(ids), batch, every=True)

    def prefill(self, input_ids: Any, image: Any = None, batch: KVBatch | None = None) -> paddle.Tensor:
        """Run the new tokens [B, S] (with the picture(s) at their placeholders: see `batch_pictures`) into the cache
        where `batch` says; the logits of each row's last new token [B, vocab].

        A prompt with pictures is run whole (batch.starts all 0), every row's placeholders at the same places; its
        row's rotary delta (what decode positions add) goes into batch.rope_deltas. Pictures are float [C, H, W] in
        [0, 1]; they are resized and normalised as the checkpoint's processor says.
        """
        if batch is None:
            raise ValueError(
                "prefill needs a KVBatch saying where the tokens go (fd_models.layers.rows.Rows makes one)"
            )
        ids = as_int64(input_ids)
        embeds = self.language_model.model.embed_tokens(ids)
        if image is None:
            return self.language_model.prefill_embeds(embeds, batch)
        if np.any(np.asarray(batch.starts)) or np.any(np.asarray(batch.lengths) != ids.shape[1]):
            raise ValueError(
                "a prompt with pictures is prefilled whole and unpadded: give a batch of them equal lengths from "
                "position 0"
            )
        host_ids = ids.numpy()
        grids, rows = encode_batch(batch_pictures(image, host_ids.shape[0]), self._encode)
        positions, delta = batch_positions(host_ids, self.image_token_id, grids, self.vision_config.spatial_merge_size)
        slots = np.flatnonzero(host_ids[0] == self.image_token_id)
        embeds = scatter_rows(embeds, paddle.stack([row[0] for row in rows]), slots)
        batch.rope_deltas[:] = int(delta)
        return self._prefill_pictures(host_ids, embeds, rows, slots, positions, batch)

    def _encode(self, picture: np.ndarray) -> tuple[tuple[int, int, int], list[paddle.Tensor]]:
        """One picture -> (its grid, [its embeddings at the placeholders, any further features])."""
        raise NotImplementedError

    def _prefill_pictures(
        self, host_ids: np.ndarray, embeds: paddle.Tensor, rows: list[list[paddle.Tensor]], slots: np.ndarray,
        positions: Any, batch: KVBatch,
    ) -> paddle.Tensor:
        """The decoder's run over `embeds` (pictures spliced in at `slots`, rotary `positions` [3, S]) into the cache
        where `batch` says; the logits of each row's last token [B, vocab]."""
        raise NotImplementedError

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """The language model's paged KV cache (see CausalLM.allocate_kv_cache)."""
        self.language_model.allocate_kv_cache(num_blocks, block_size)

    @property
    def block_size(self) -> int:
        return self.language_model.block_size

    def read_kv(self, slots: paddle.Tensor) -> list[paddle.Tensor]:
        """The language model's keys and values at `slots` (see CausalLM.read_kv)."""
        return self.language_model.read_kv(slots)

    def write_kv(self, slots: paddle.Tensor, parts: list[paddle.Tensor]) -> None:
        """Into the language model's cache (see CausalLM.write_kv)."""
        self.language_model.write_kv(slots, parts)

    def cache_bytes(self) -> int:
        """Bytes the language model's KV cache holds."""
        return self.language_model.cache_bytes()

    def decode_step(self, token_ids: Any, batch: KVBatch) -> paddle.Tensor:
        """One text token per row (its rotary position offset by its pictures' delta, batch.rope_deltas)."""
        return self.language_model.decode_step(token_ids, batch)

    def capture(self, graph_backend: GraphBackend, batch_size: int, table_width: int) -> None:
        """Capture the language model's decode step (graphs live on `self.language_model`)."""
        self.language_model.capture(graph_backend, batch_size, table_width)
