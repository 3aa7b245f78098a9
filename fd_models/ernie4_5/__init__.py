"""ERNIE-4.5 dense decoder (as ERNIE-4.5-0.3B); registered through `fd_models.ernie4_5.plugin`."""
