"""The vision-language model shared by the VL architectures: vision tower + projector + causal LM.

The language model (`self.language_model`) owns the KV cache and the captured decode graphs;
this class only turns an image into embeddings spliced into the prompt at prefill.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import paddle
from paddle import nn

from fd_core.config import ModelConfig
from fd_core.models import GraphBackend
from fd_core.weights import WeightSpec
from fd_models.layers import params
from fd_models.layers.decoder import CausalLM, DecoderOptions, as_int64
from fd_models.layers.vision import Projector, VisionEncoder, VisionOptions, splice_image


class VisionLanguageModel(nn.Layer):
    """Image features projected to the text width and spliced into the decoder's prompt.

    `image` is float32 [B, C, H, W] (numpy or tensor; B may be 1 for the whole batch) or None,
    which means a text-only prompt. Placeholder tokens (`image_token_id`) mark where the image's
    P patch embeddings go; a prompt without them gets the image prepended (P extra positions;
    see `prefill_length`).
    """

    # (internal prefix, checkpoint prefix) pairs, giving Hugging-Face-style weight names.
    renames: params.Renames = ()

    def __init__(self, config: ModelConfig, ctx: Any, vision: VisionOptions, decoder: DecoderOptions) -> None:
        super().__init__()
        self.config = config
        vision_config = config.extra["vision_config"]
        self.image_token_id: int | None = config.extra.get("image_token_id")
        self.vision = VisionEncoder(vision_config, vision, ctx, config.dtype)
        self.projector = Projector(vision_config["hidden_size"], config.hidden_size, vision.act, ctx, config.dtype)
        self.language_model = CausalLM(config, ctx, decoder)

    def weight_specs(self) -> dict[str, WeightSpec]:
        """Every checkpoint tensor (vision ones replicated) with its full shape and tp split axis."""
        return params.weight_specs(self, self.renames)

    def ignored_tensors(self) -> set[str]:
        """A tied head's copy of the embedding may be present and is not loaded."""
        return self.language_model.ignored_tensors()

    def load_weights(self, shards: Mapping[str, np.ndarray]) -> None:
        """Assign this rank's shards to the parameters (restoring released storage)."""
        params.load_weights(self, shards, self.renames)

    def release_weights(self) -> None:
        """Free parameter storage; load_weights restores it."""
        params.release_weights(self)

    def image_embeds(self, image: Any, batch_size: int) -> paddle.Tensor:
        """image [B or 1, C, H, W] -> projected patch embeddings [B, P, hidden]."""
        pixels = image if isinstance(image, paddle.Tensor) else paddle.to_tensor(np.asarray(image, dtype=np.float32))
        if pixels.shape[0] not in (1, batch_size):
            raise ValueError(f"image batch {pixels.shape[0]} does not match the prompt batch {batch_size}")
        embeds = self.projector(self.vision(pixels.astype("float32")))
        return embeds.expand([batch_size, *embeds.shape[1:]])

    def prefill_length(self, input_ids: Any, image: Any = None) -> int:
        """Cache positions the prefill fills: S, plus P when the image is prepended (no placeholders)."""
        ids = np.asarray(input_ids.numpy() if isinstance(input_ids, paddle.Tensor) else input_ids)
        if image is None or (self.image_token_id is not None and (ids == self.image_token_id).any()):
            return ids.shape[1]
        height, width = image.shape[-2:]
        patch = self.vision.patch_embed.patch_size
        return ids.shape[1] + (height // patch) * (width // patch)

    def prefill(self, input_ids: Any, image: Any = None) -> paddle.Tensor:
        """Run the prompt [B, S] with the image spliced in; return last-position logits [B, vocab]."""
        ids = as_int64(input_ids)
        embeds = self.language_model.model.embed_tokens(ids)
        if image is not None:
            embeds = splice_image(ids.numpy(), embeds, self.image_embeds(image, ids.shape[0]), self.image_token_id)
        return self.language_model.prefill_embeds(embeds)

    def allocate_cache(self, batch_size: int, max_len: int) -> None:
        """Preallocate the language model's KV cache."""
        self.language_model.allocate_cache(batch_size, max_len)

    def decode_step(self, token_ids: Any, position: int) -> paddle.Tensor:
        """One text token per sequence at `position` (decode never sees the image again)."""
        return self.language_model.decode_step(token_ids, position)

    def capture(self, graph_backend: GraphBackend, batch_size: int) -> None:
        """Capture the language model's decode step (graphs live on `self.language_model`)."""
        self.language_model.capture(graph_backend, batch_size)
