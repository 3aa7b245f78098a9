"""Tensor-parallel layers shared by every architecture; each module imports paddle.

Every cross-rank reduction goes through `ctx.all_reduce`, the Backend's bound hook, so the
layers never name a communication library.
"""
