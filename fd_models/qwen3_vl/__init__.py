"""Qwen3-VL: vision tower + merger + Qwen3 decoder (q/k norm); registered through `fd_models.qwen3_vl.plugin`."""
