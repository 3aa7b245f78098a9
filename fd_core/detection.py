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
    # The paddle device type ops run on ("cpu", or the type a device platform names); "" when not detected.
    device: str = ""
    # The paddle.distributed backend its ranks rendezvous with.
    dist_backend: str = ""
    # How many tensor-parallel ranks this host can serve; None means no stated limit.
    max_ranks: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
