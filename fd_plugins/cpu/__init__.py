"""The cpu platform: gloo all-reduce, garbage-collector cleanup, Paddle static-graph capture."""
