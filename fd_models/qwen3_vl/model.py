"""Qwen3-VL as published: the vision tower, DeepStack, interleaved M-RoPE and the Qwen3 decoder with q/k norm.

A prompt without an image is the text alone (1-D rope, which M-RoPE reduces to). With an image, its
placeholder tokens (`image_token_id`, one per merged 2x2 patch block) take the tower's embeddings,
the DeepStack features are added after the first decoder layers at those tokens, and the rotary
positions follow the reference's `get_rope_index`; decode then continues at slot + rope delta.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import paddle
from paddle import nn

from fd_core.config import ModelConfig
from fd_core.models import GraphBackend
from fd_core.weights import WeightSpec
from fd_models.layers import params
from fd_models.layers.decoder import CausalLM, DecoderOptions, as_int64
from fd_models.layers.images import preprocess
from fd_models.layers.multimodal import (
    batch_pictures,
    batch_positions,
    encode_batch,
    scatter_rows,
)
from fd_models.qwen3_vl.config import VisionConfig, image_settings
from fd_models.qwen3_vl.vision import Qwen3VLVisionModel, patchify


class Qwen3VLForConditionalGeneration(nn.Layer):
    """Qwen3-VL; `image=None` means a text-only prompt."""

    # (internal prefix, checkpoint prefix): the published names.
    renames = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("visual.", "model.visual."),
    )

    def __init__(self, config: ModelConfig, ctx: Any) -> None:
        super().__init__()
        self.config = config
        self.vision_config = VisionConfig.from_dict(config.extra["vision_config"])
        self.image_token_id: int = config.extra["image_token_id"]
        self.image_settings = image_settings(config, self.vision_config)
        self.visual = Qwen3VLVisionModel(self.vision_config, ctx, config.dtype)
        self.language_model = CausalLM(config, ctx, DecoderOptions(qk_norm=True, rope_layout="half"))

    # -- weights -------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, WeightSpec]:
        """Every checkpoint tensor (vision ones replicated) with its full shape and tp split axis."""
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

    def prefill(self, input_ids: Any, image: Any = None, pad: Sequence[int] | None = None) -> paddle.Tensor:
        """Run the prompt [B, S] with its image(s) at their placeholders (see `batch_pictures`); last-position logits [B, vocab].

        `pad[b]` leading ids of row b are padding (text-only batches of unequal prompts).

        Pictures are float [C, H, W] in [0, 1]; they are resized and normalised as the checkpoint's processor says.
        """
        ids = as_int64(input_ids)
        embeds = self.language_model.model.embed_tokens(ids)
        if image is None:
            return self.language_model.prefill_embeds(embeds, pad=pad)
        if pad is not None and any(pad):
            raise ValueError("prompts with pictures are not padded: give a batch of them equal lengths, or run them one by one")
        host_ids = ids.numpy()
        grids, rows = encode_batch(batch_pictures(image, host_ids.shape[0]), self._encode)
        positions, delta = batch_positions(host_ids, self.image_token_id, grids, self.vision_config.spatial_merge_size)
        slots = np.flatnonzero(host_ids[0] == self.image_token_id)
        embeds = scatter_rows(embeds, paddle.stack([row[0] for row in rows]), slots)
        zeros = paddle.zeros_like(embeds)
        deepstack = [scatter_rows(zeros, paddle.stack([row[i] for row in rows]), slots) for i in range(1, len(rows[0]))]
        return self.language_model.prefill_embeds(embeds, positions, deepstack, delta)

    def _encode(self, picture: np.ndarray) -> tuple[tuple[int, int, int], list[paddle.Tensor]]:
        """One picture -> (its grid, [merged embeddings, DeepStack features...])."""
        patches, grid = patchify(preprocess(picture, self.image_settings), self.vision_config)
        merged, deepstack = self.visual(paddle.to_tensor(patches), grid)
        return grid, [merged, *deepstack]

    def allocate_cache(self, batch_size: int, max_len: int) -> None:
        self.language_model.allocate_cache(batch_size, max_len)

    def cache_bytes(self) -> int:
        """Bytes the language model's KV cache holds."""
        return self.language_model.cache_bytes()

    def decode_step(self, token_ids: Any, position: int) -> paddle.Tensor:
        """One text token per sequence at cache slot `position` (its rotary position is offset by the image's delta)."""
        return self.language_model.decode_step(token_ids, position)

    def capture(self, graph_backend: GraphBackend, batch_size: int) -> None:
        """Capture the language model's decode step (graphs live on `self.language_model`)."""
        self.language_model.capture(graph_backend, batch_size)


def build(config: ModelConfig, ctx: Any) -> Qwen3VLForConditionalGeneration:
    """Construct the model for this rank (weights are zero until load_weights)."""
    return Qwen3VLForConditionalGeneration(config, ctx)
