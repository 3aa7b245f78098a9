"""Qwen3's decoder from fd's reusable layers: per-head q/k RMSNorm, "half" rotary layout; its prompts scored in their
prefill (contract 1.5's optional prefill_every)."""

from fd_core.models import host_tensor
from fd_models.layers.decoder import CausalLM, DecoderOptions


class Qwen3ForCausalLM(CausalLM):
    """RMSNorm, rotary attention with GQA and q/k norm, SwiGLU."""

    def __init__(self, config, ctx):
        super().__init__(config, ctx, DecoderOptions(qk_norm=True, rope_layout="half"))

    def prefill_every(self, input_ids, batch):
        """As prefill, the logits of every new position [B, S, vocab] (docs/writing-a-model.md, contract 1.5)."""
        import numpy as np

        ids = host_tensor(np.asarray(input_ids, dtype=np.int64))
        return self.prefill_embeds(self.model.embed_tokens(ids), batch, every=True)


def build(config, ctx):
    """Construct the model for this rank; weights are zero until load_weights."""
    return Qwen3ForCausalLM(config, ctx)
