"""qwen3: a model package written from docs/writing-a-model.md at fd's contract 1.0."""
