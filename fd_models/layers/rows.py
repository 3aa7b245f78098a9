"""A fixed cache layout for code that runs a model outside the runtime's engine (tests, benchmarks, a script):
`batch` rows, each a sequence owning its own run of blocks for up to `max_len` positions.

The engine manages blocks itself (fd_core.runtime.engine); this helper only makes the KVBatch a model's prefill and
decode step take for the simple case of rows that start together and advance one token a step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fd_core.kvcache import KVBatch

DEFAULT_BLOCK_SIZE = 16


class Rows:
    """`batch` sequences in their own blocks of `model`'s paged cache (allocated here; block 0 is left as the null
    block); `prefill` then `decode` advance every row together."""

    def __init__(self, model: Any, batch: int, max_len: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.model, self.batch, self.block_size = model, batch, block_size
        self.width = -(-max_len // block_size)  # blocks a row holds
        model.allocate_kv_cache(1 + batch * self.width, block_size)
        self.positions = np.zeros(batch, dtype=np.int64)  # each row's next position
        self.deltas = np.zeros(batch, dtype=np.int64)

    def prefill(self, input_ids: Any, image: Any = None) -> Any:
        """Every row's whole prompt [B, S] from position 0; the logits of each row's last token."""
        ids = np.asarray(input_ids, dtype=np.int64)
        batch = KVBatch.contiguous(self.batch, 0, ids.shape[1], self.block_size, self.width)
        batch.rope_deltas = self.deltas
        logits = self.model.prefill(ids, image, batch)
        self.positions[:] = ids.shape[1]
        return logits

    def decode(self, token_ids: Any) -> Any:
        """One token a row [B, 1] at each row's next position."""
        batch = KVBatch.contiguous(self.batch, self.positions, 1, self.block_size, self.width)
        batch.rope_deltas = self.deltas
        logits = self.model.decode_step(token_ids, batch)
        self.positions += 1
        return logits

    def capture(self, graph_backend: Any) -> None:
        """Capture the model's decode step for these rows' shape (batch, table width)."""
        self.model.capture(graph_backend, self.batch, self.width)
