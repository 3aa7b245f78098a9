"""Qwen3's decoder from fd's reusable layers: per-head q/k RMSNorm, "half" rotary layout."""

from fd_models.layers.decoder import CausalLM, DecoderOptions


class Qwen3ForCausalLM(CausalLM):
    """RMSNorm, rotary attention with GQA and q/k norm, SwiGLU."""

    def __init__(self, config, ctx):
        super().__init__(config, ctx, DecoderOptions(qk_norm=True, rope_layout="half"))


def build(config, ctx):
    """Construct the model for this rank; weights are zero until load_weights."""
    return Qwen3ForCausalLM(config, ctx)
