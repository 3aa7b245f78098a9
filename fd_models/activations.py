"""The activation names the published vision configs use, and that `fd_models.layers.vision.activate`
implements (no paddle here)."""

# Each name with the form of fd's `gelu` op it is (its `approximate` argument).
GELU_FORMS = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh",
              "quick_gelu": "sigmoid"}
VISION_ACTIVATIONS = tuple(GELU_FORMS)
