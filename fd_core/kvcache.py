"""The paged KV cache as a model sees it: which blocks hold each sequence, and where one step's new tokens go."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class KVBatch:
    """One step's rows in the paged KV cache (what the runtime passes to a model's prefill and decode step).

    Row b's new tokens are at positions starts[b] .. starts[b] + lengths[b] - 1 of its sequence; position p lives
    in block block_tables[b, p // block_size] at offset p % block_size, and slot_mapping[b, i] is the slot
    (block * block_size + offset) of its i-th new token, padding pointed at the runtime's null block. Arrays are
    int64 numpy arrays: block_tables [B, W] (padded with the null block), starts and lengths [B], slot_mapping
    [B, S] (S = max(lengths); a decode step: S = 1).

    `rope_deltas` [B] is what a row's text positions add to give their rotary position (nonzero after pictures
    whose tokens take fewer rotary positions than cache positions): a VL model's prefill sets it for each row it
    fills, and a decode step reads it.
    """

    block_tables: Any
    starts: Any
    lengths: Any
    slot_mapping: Any
    rope_deltas: Any

    @property
    def rows(self) -> int:
        return int(len(self.starts))

    @property
    def context_lens(self) -> Any:
        """Each row's positions once this step's are written (starts + lengths)."""
        return self.starts + self.lengths

    @classmethod
    def contiguous(cls, rows: int, starts: Any, lengths: Any, block_size: int, width: int) -> "KVBatch":
        """Rows that each own a run of `width` blocks (row b: blocks 1 + b * width onward; block 0 is the null block),
        with new tokens at positions starts[b] .. starts[b] + lengths[b] - 1: the layout of code that runs a model
        outside the runtime's engine (a test, a benchmark, a check)."""
        import numpy as np

        starts = np.broadcast_to(np.asarray(starts, dtype=np.int64), (rows,)).copy()
        lengths = np.broadcast_to(np.asarray(lengths, dtype=np.int64), (rows,)).copy()
        tables = 1 + np.arange(rows * width, dtype=np.int64).reshape(rows, width)
        span = int(lengths.max()) if rows else 0
        at = starts[:, None] + np.arange(span)[None, :]
        inside = np.arange(span)[None, :] < lengths[:, None]
        block = np.take_along_axis(tables, np.minimum(at // block_size, width - 1), axis=1)
        slots = np.where(inside, block * block_size + at % block_size, 0)
        return cls(tables, starts, lengths, slots, np.zeros(rows, dtype=np.int64))
