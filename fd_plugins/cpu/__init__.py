"""The cpu platform: shared-memory all-reduce on one host (gloo across hosts), gc cleanup,
Paddle static-graph capture."""
