"""Compute threads per rank: how many, decided once in the plan (--threads, else the platform's threads variable,
else the host's usable cores shared among its ranks). How they are applied to a library's thread pools in each phase
is the platform's (its fd_rank_start and fd_before_step hooks); the kernels read the count (compute_threads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fd_core.errors import ConfigError, setting


@dataclass(frozen=True)
class Threads:
    """How many compute threads each rank runs, and why (plain data: it travels in the Plan)."""

    per_rank: int
    reason: str
    # Whether the user chose the count (--threads, the platform's threads variable): a platform keeps it in every
    # phase.
    chosen: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"per_rank": self.per_rank, "reason": self.reason, "chosen": self.chosen}


def decide_threads(
    requested: int | None, ranks_on_host: int, cores: int, env: Mapping[str, str], threads_env: str | None = None,
    cores_from: str = "",
) -> Threads:
    """Compute threads per rank: --threads, else the variable the platform names (Detection.threads_env) when the
    user set it, else the usable cores shared among the host's ranks.

    `cores` is what the platform reports this process may use (Detection.host_cores: the affinity
    mask capped by the cgroup quota), else the affinity mask; `cores_from` says which.
    """
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"{setting('threads')} must be >= 1, got {requested}")
        return Threads(requested, "--threads", chosen=True)
    raw = env.get(threads_env, "").strip() if threads_env else ""
    if threads_env and raw:
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(
                f"{threads_env}={raw!r} is not a number of threads; set it to a positive integer or unset it"
            ) from None
        if value < 1:
            raise ConfigError(f"{threads_env}={raw!r} must be >= 1; set it to a positive integer or unset it")
        return Threads(value, threads_env, chosen=True)
    ranks = max(1, ranks_on_host)
    per_rank = max(1, max(1, cores) // ranks)
    return Threads(
        per_rank,
        f"{cores} usable core(s){f' ({cores_from})' if cores_from else ''}, shared by {ranks} rank(s) on this host",
    )
