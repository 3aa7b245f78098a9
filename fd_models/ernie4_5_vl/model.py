"""ERNIE-4.5-VL as published: vision tower, resampler, and the ERNIE-4.5 decoder whose sparse layers are
modality-isolated mixtures of experts, with 3-D rotary positions.

A prompt without an image is the text alone (1-D interleaved rope, which the 3-D rope reduces to,
and every token through the text experts). With an image, its placeholder tokens take the
resampler's embeddings, those tokens and the image start/end tokens go to the vision experts, and
the rotary positions follow the reference's `get_rope_index`; decode then continues at slot + delta.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import paddle
from paddle import nn

from fd_core.config import ModelConfig
from fd_core.models import GraphBackend
from fd_core.weights import WeightSpec
from fd_models.ernie4_5_vl.config import MoEConfig, VisionConfig, image_settings
from fd_models.ernie4_5_vl.vision import Resampler, VisionTransformer, patchify
from fd_models.layers import params
from fd_models.layers.decoder import CausalLM, DecoderOptions, as_int64
from fd_models.layers.images import preprocess
from fd_models.layers.mlp import SwiGLUMLP
from fd_models.layers.moe import MoEBlock
from fd_models.layers.multimodal import (
    batch_pictures,
    batch_positions,
    encode_batch,
    scatter_rows,
)


def _mlp(moe: MoEConfig) -> Any:
    """The feed-forward of decoder layer i: dense SwiGLU or the mixture of experts, as `mlp_layer_types` says."""

    def make(config: ModelConfig, ctx: Any, index: int) -> nn.Layer:
        if moe.layer_types[index] == "dense":
            return SwiGLUMLP(config.hidden_size, config.intermediate_size, ctx, config.mlp_bias, config.dtype)
        return MoEBlock(
            config.hidden_size, moe.intermediate, moe.experts, moe.top_k, moe.shared, moe.norm_min, ctx, config.dtype, config.mlp_bias
        )

    return make


class Ernie4_5_VLMoeForConditionalGeneration(nn.Layer):  # noqa: N801 - the Hugging Face class name
    """ERNIE-4.5-VL (mixture of experts); `image=None` means a text-only prompt."""

    # (internal prefix, checkpoint prefix): the published names.
    renames = (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_model.", "model.vision_model."),
        ("resampler_model.", "model.resampler_model."),
    )

    def __init__(self, config: ModelConfig, ctx: Any) -> None:
        super().__init__()
        self.config = config
        self.vision_config = VisionConfig.from_dict(config.extra["vision_config"])
        self.image_token_id: int = config.extra["image_token_id"]
        self.image_settings = image_settings(config, self.vision_config)
        # Tokens the reference routes to the vision experts: the placeholders and the image's start and end.
        self.vision_tokens = [config.extra[k] for k in ("image_token_id", "image_start_token_id", "image_end_token_id")]
        self.vision_model = VisionTransformer(self.vision_config, ctx, config.dtype)
        self.resampler_model = Resampler(self.vision_config, config.hidden_size, config.rms_norm_eps, ctx, config.dtype)
        options = DecoderOptions(qk_norm=False, rope_layout="interleaved", mrope_style="ernie", mlp=_mlp(MoEConfig.from_config(config)))
        self.language_model = CausalLM(config, ctx, options)

    # -- weights -------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, WeightSpec]:
        """Every checkpoint tensor (vision and routers replicated, experts split by their intermediate size)."""
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
        vision_mask = np.isin(host_ids, self.vision_tokens)
        return self.language_model.prefill_embeds(embeds, positions, (), delta, vision_mask)

    def _encode(self, picture: np.ndarray) -> tuple[tuple[int, int, int], list[paddle.Tensor]]:
        """One picture -> (its grid, [resampled embeddings])."""
        patches, grid = patchify(preprocess(picture, self.image_settings), self.vision_config)
        return grid, [self.resampler_model(self.vision_model(paddle.to_tensor(patches), grid))]

    def allocate_cache(self, batch_size: int, max_len: int) -> None:
        self.language_model.allocate_cache(batch_size, max_len)

    def cache_bytes(self) -> int:
        """Bytes the language model's KV cache holds."""
        return self.language_model.cache_bytes()

    def decode_step(self, token_ids: Any, position: int) -> paddle.Tensor:
        """One text token per sequence at cache slot `position` (text experts; rotary position offset by the image's delta)."""
        return self.language_model.decode_step(token_ids, position)

    def capture(self, graph_backend: GraphBackend, batch_size: int) -> None:
        """Capture the language model's decode step (graphs live on `self.language_model`)."""
        self.language_model.capture(graph_backend, batch_size)


def build(config: ModelConfig, ctx: Any) -> Ernie4_5_VLMoeForConditionalGeneration:
    """Construct the model for this rank (weights are zero until load_weights)."""
    return Ernie4_5_VLMoeForConditionalGeneration(config, ctx)
