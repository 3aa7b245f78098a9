"""The cuda platform: NCCL all-reduce, caching-allocator cleanup, CUDA graph capture."""
