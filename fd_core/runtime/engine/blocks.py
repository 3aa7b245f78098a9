"""The KV cache's blocks: a fixed pool the runtime owns, reference-counted, with full blocks found again by a
hash of their tokens (prefix caching) and free cached blocks evicted least recently used first.

Block 0 is the null block: never given to a sequence. Padding writes its keys and values there and block
tables are padded with it, so every block an attention kernel reads holds finite numbers.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

NULL_BLOCK = 0


def block_hash(previous: bytes | None, tokens: Sequence[int]) -> bytes:
    """The identity of a full block: its token ids chained with the hash of the block before it, so equal
    blocks after different prefixes differ."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(previous or b"\0" * 16)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()


@dataclass
class PoolStats:
    """What the pool has done since it was made (reported as metrics)."""

    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0


@dataclass
class BlockPool:
    """`num_blocks` blocks of `block_size` positions (block 0, the null block, excluded from use).

    A block is free (no holder), held (ref count > 0), or cached: free but still holding a full block's
    keys and values under its hash, found by `lookup` until it is evicted to make room.
    """

    num_blocks: int
    block_size: int
    caching: bool = True
    stats: PoolStats = field(default_factory=PoolStats)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"a KV-cache pool needs at least 2 blocks (one is the null block), got {self.num_blocks}")
        self._refs = [0] * self.num_blocks
        # First in, first out: a block freed is the last to be handed out again, so a bug that reads a block after
        # giving it up meets another sequence's values at once rather than its own, still there.
        self._free: deque[int] = deque(range(1, self.num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free blocks with a hash, least recently used first
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    # -- what it holds -----------------------------------------------------------------------
    @property
    def usable(self) -> int:
        """Blocks a sequence may hold (all but the null block)."""
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones (which it evicts)."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.usable - self.available

    def refs(self, block: int) -> int:
        return self._refs[block]

    # -- taking and giving back -----------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """`count` blocks for one holder; free ones first, then the least recently used cached ones (forgotten).
        Raises MemoryError, taking none, when fewer are available."""
        if count > self.available:
            raise MemoryError(f"{count} KV-cache blocks asked for, {self.available} available")
        out = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
                self.stats.evictions += 1
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Give back one hold of each block; a block nobody holds is cached (if it has a hash) or free.

        The last blocks of a sequence are given back first, so that its prefix stays cached longest."""
        for block in reversed(blocks):
            if block == NULL_BLOCK:
                continue
            if self._refs[block] <= 0:
                raise RuntimeError(f"KV-cache block {block} freed more often than held")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    # -- prefix caching -------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `hashes` from the first, each now held once more by the caller."""
        found = []
        if self.caching:
            for digest in hashes:
                block = self._by_hash.get(digest)
                if block is None:
                    break
                found.append(block)
        for block in found:
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
        return found

    def publish(self, block: int, digest: bytes) -> None:
        """Make a held, full block findable by its hash (a block with the same hash already cached stays the one
        found)."""
        if not self.caching or digest in self._by_hash or block in self._hash_of:
            return
        self._by_hash[digest] = block
        self._hash_of[block] = digest

    def forget_all(self) -> None:
        """Drop every hash (the weights changed: cached keys and values no longer match them)."""
        for block in list(self._cached):
            self._free.append(block)
        self._cached.clear()
        self._by_hash.clear()
        self._hash_of.clear()
