"""What a platform says about itself when asked whether its hardware is here."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Detection:
    """A platform's answer to `fd_platform_detect`; the highest `priority` among detected platforms wins."""

    detected: bool
    priority: int = 0
    reason: str = ""
    # The paddle device type ops run on (what paddle.set_device takes); "" when not detected.
    device: str = ""
    # The paddle.distributed backend its ranks rendezvous with.
    dist_backend: str = ""
    # How many tensor-parallel ranks this host can serve; None means no stated limit.
    max_ranks: int | None = None
    # The dtypes its kernels run models in, preferred first (the default of `fd run --dtype`).
    dtypes: tuple[str, ...] = ("float32",)
    # Bytes the ranks it serves on this host may use together for weights and caches; None: unknown.
    memory_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def problem(self) -> str | None:
        """What is wrong with this answer's fields (a third party filled them in), or None."""
        from fd_core.config import COMPUTE_DTYPES

        if not isinstance(self.detected, bool):
            return f"detected={self.detected!r}, expected True or False"
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            return f"priority={self.priority!r}, expected an integer"
        if self.max_ranks is not None and (isinstance(self.max_ranks, bool) or not isinstance(self.max_ranks, int) or self.max_ranks < 1):
            return f"max_ranks={self.max_ranks!r}, expected None or a positive integer"
        if self.memory_bytes is not None and (isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes < 0):
            return f"memory_bytes={self.memory_bytes!r}, expected None or a non-negative integer"
        if not isinstance(self.dtypes, (tuple, list)) or not self.dtypes or any(d not in COMPUTE_DTYPES for d in self.dtypes):
            return f"dtypes={self.dtypes!r}, expected a non-empty tuple of {', '.join(COMPUTE_DTYPES)}"
        return None
