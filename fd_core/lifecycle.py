"""What a platform is told about the rank it runs in, at the rank's start, before each step and at its end
(fd_rank_start, fd_before_step, fd_rank_end: contract 1.2)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

# Why a rank ends: its work is done ("normal"), it failed ("error"), or a stop signal reached it ("signal").
EndReason = Literal["normal", "error", "signal"]
END_REASONS: tuple[str, ...] = ("normal", "error", "signal")
# How long fd waits for fd_rank_end before it goes on ending the rank without it.
RANK_END_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RankContext:
    """One rank of a run as the plan made it: plain data, the same object at its start, its steps and its end."""

    # This rank's index in the tensor-parallel group, and the group's size.
    rank: int = 0
    world_size: int = 1
    # Its index among the group's ranks on this host, and how many of them this host runs: rank r of a host binds
    # device r (`local_rank`) where the launcher has not already bound one for it.
    local_rank: int = 0
    local_world_size: int = 1
    # The platform selected and the paddle device type it named (Detection.device).
    platform: str = ""
    device: str = ""
    # The architecture and the compute dtype of the run ("" when the rank runs no model: a conformance check).
    model: str = ""
    dtype: str = "float32"
    # Compute threads the plan gives this rank (--threads, the platform's threads variable, else the host's usable
    # cores shared among its ranks), and whether the user chose the count (then keep it in every phase).
    threads: int = 1
    threads_chosen: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
