"""The activation names the published vision configs use, and that `fd_models.layers.vision.activate`
implements (no paddle here)."""

VISION_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "quick_gelu")
