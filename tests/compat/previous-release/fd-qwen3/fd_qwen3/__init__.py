"""qwen3: a model package written from docs/writing-a-model.md as that page read in the previous release."""
