"""ERNIE-4.5-VL: vision tower + projector + ERNIE-4.5 decoder; registered through `fd_models.ernie4_5_vl.plugin`."""
