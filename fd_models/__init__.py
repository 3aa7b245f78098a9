"""Built-in model packages: ERNIE-4.5, ERNIE-4.5-VL and Qwen3-VL, over shared tensor-parallel layers.

Importing this package (or any `fd_models.<pkg>.plugin`) does not import paddle; the model
modules (`fd_models.<pkg>.model`, `fd_models.layers.*`) do.
"""
