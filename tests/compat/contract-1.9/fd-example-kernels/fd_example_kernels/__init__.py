"""An fd-backends extension that provides its own kernels for two of fd's named ops."""
