"""What fits in memory, worked out once in the plan: one rank's share of the weights, whether it fits the device
the platform reports, and how many tokens of KV cache (batch x context) the rest holds at --memory-fraction."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from fd_core.config import DEFAULT_MEMORY_FRACTION
from fd_core.detection import DeviceMemory
from fd_core.errors import ConfigError, setting

if TYPE_CHECKING:
    from fd_core.config import ModelConfig
    from fd_core.detection import Detection

# Cache lengths are rounded up to this, so that requests of similar lengths reuse one captured graph.
CACHE_STEP = 32
__all__ = [
    "CACHE_STEP", "DEFAULT_MEMORY_FRACTION", "MemoryPlan", "cache_length", "check_fraction", "local_ranks",
    "plan_memory",
]


def cache_length(needed: int, limit: int) -> int:
    """The cache length the engine allocates for `needed` positions: rounded up to CACHE_STEP, within the context
    `limit`."""
    return max(needed, min(-(-needed // CACHE_STEP) * CACHE_STEP, limit))


def check_fraction(fraction: float) -> float:
    """`fraction` if it is a share of memory in (0, 1], else a one-line error."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ConfigError(
            f"{setting('memory_fraction')} must be a number in (0, 1] (the share of free device memory fd may use), "
            f"got {fraction!r}"
        )
    return float(fraction)


def local_ranks(tp: int, env: Mapping[str, str] | None = None) -> int:
    """How many of the `tp` ranks run on this host: all of them, unless paddle.distributed.launch says fewer."""
    env = os.environ if env is None else env
    if env.get("PADDLE_TRAINERS_NUM") is not None:
        try:
            return max(1, min(tp, int(env.get("PADDLE_LOCAL_SIZE", tp))))
        except ValueError:
            return tp
    return tp


def gib(count: int) -> str:
    """Bytes in a short human unit (GiB, or MiB below one GiB)."""
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.2f} MiB"


@dataclass(frozen=True)
class MemoryPlan:
    """Weights per rank and the KV-cache capacity the free device memory leaves; plain data (it pickles)."""

    fraction: float
    dtype: str
    tp: int
    # One rank's share of the weights (an estimate from the model's sizes: see ModelConfig.weight_bytes_per_rank).
    weights_per_rank: int
    # KV-cache bytes one rank holds per token of one sequence.
    cache_bytes_per_token: int
    # The device the plan is bound by (the one with the least free memory of those this host's ranks use), as reported.
    device: int | None = None
    device_total: int | None = None
    device_free: int | None = None
    ranks_per_device: int = 1
    # Tokens of KV cache (batch x context, summed over the sequences decoded together) the rest holds; None:
    # the platform reports no memory, and nothing is sized or refused.
    capacity_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def fits(self, tokens: int) -> bool:
        """Whether `tokens` of cache (batch x cache length) fit the capacity."""
        return self.capacity_tokens is None or tokens <= self.capacity_tokens

    def batch_size(self, max_batch: int, length: int) -> int:
        """The most sequences of cache length `length` that decode together: up to `max_batch`, as many as fit (at
        least one)."""
        if self.capacity_tokens is None:
            return max_batch
        return max(1, min(max_batch, self.capacity_tokens // max(1, length)))

    def summary(self) -> str:
        """One line for fd explain and fd run."""
        weights = f"weights {gib(self.weights_per_rank)} per rank (tp={self.tp}, {self.dtype})"
        if self.capacity_tokens is None:
            return f"{weights}; KV cache not sized: the platform reports no device memory"
        shared = f", shared by {self.ranks_per_device} ranks" if self.ranks_per_device > 1 else ""
        assert self.device_free is not None
        return (
            f"{weights}; KV cache for {self.capacity_tokens} tokens (batch x context); "
            f"{setting('memory_fraction', self.fraction)} of {gib(self.device_free)} free on device "
            f"{self.device}{shared}"
        )

    def check_request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, context: int, arch: str) -> None:
        """Refuse, in one line naming the numbers, a request whose longest sequence alone needs more cache than the
        capacity."""
        if self.capacity_tokens is None or not prompts:
            return
        longest = max(len(p) for p in prompts)
        needed = cache_length(longest + max_new_tokens, context)
        if needed <= self.capacity_tokens:
            return
        assert self.device_free is not None
        ranks = f" for each of its {self.ranks_per_device} ranks" if self.ranks_per_device > 1 else ""
        raise ConfigError(
            f"this request needs a KV cache of {needed} tokens (its longest prompt, {longest} tokens, and "
            f"{max_new_tokens} new, rounded up to a multiple of {CACHE_STEP}), and {arch} at tp={self.tp} has room for "
            f"{self.capacity_tokens} ({setting('memory_fraction', self.fraction)} of {gib(self.device_free)} free on "
            f"device {self.device}, less {gib(self.weights_per_rank)} of weights{ranks}; {self.cache_bytes_per_token} "
            f"bytes a token per rank); ask for fewer tokens, or raise "
            f"{setting('memory_fraction')}{'' if self.ranks_per_device > 1 else ' or ' + setting('tp')}"
        )


def reported_devices(detection: "Detection") -> tuple[DeviceMemory, ...]:
    """The platform's per-device report; the older host-wide `memory_bytes` as one device all ranks share; or
    nothing."""
    if detection.device_memory:
        return tuple(detection.device_memory)
    if detection.memory_bytes is not None:
        return (DeviceMemory(total=detection.memory_bytes, free=detection.memory_bytes),)
    return ()


def plan_memory(
    config: "ModelConfig", tp: int, detection: "Detection", fraction: float, platform: str, arch: str,
    ranks_here: int | None = None,
) -> MemoryPlan:
    """Weights per rank checked against the device, and the KV-cache capacity left; a ConfigError if the weights do not
    fit.

    Rank r of this host uses device r % len(devices); ranks on one device share it. The plan is bound by
    the used device with the least free memory: its budget is `fraction` of its free bytes, less the
    weights of the ranks on it; what is left, divided by what a token costs those ranks, is the capacity.
    """
    fraction = check_fraction(fraction)
    weights = config.weight_bytes_per_rank(tp)
    per_token = config.cache_bytes_per_token(tp)
    plan = MemoryPlan(fraction, config.dtype, tp, weights, per_token)
    devices = reported_devices(detection)
    if not devices:
        return plan
    here = ranks_here if ranks_here is not None else local_ranks(tp)
    used = sorted({r % len(devices) for r in range(here)})
    sharing = {d: sum(1 for r in range(here) if r % len(devices) == d) for d in used}
    # The binding device: the least budget per rank on it.
    index = min(used, key=lambda d: (devices[d].free * fraction / sharing[d], d))
    device, ranks = devices[index], sharing[index]
    budget = int(device.free * fraction)
    room = budget - ranks * weights
    what = f"{ranks} ranks of tp={tp} share it" if ranks > 1 else f"tp={tp}"
    # Ranks that share one device hold more weights together at a larger tp, not less: no --tp advice then.
    fraction_, tp_ = setting("memory_fraction"), setting("tp")
    advice = (f"a higher {fraction_} or a smaller model (its ranks share the device, so a larger {tp_} does not help)"
              if ranks > 1 else f"a larger {tp_}, a higher {fraction_} or a smaller model")
    cache_advice = f"a higher {fraction_}" if ranks > 1 else f"a larger {tp_} or a higher {fraction_}"
    if room <= 0:
        raise ConfigError(
            f"{arch} needs about {gib(weights)} of weights per rank ({config.dtype}, {what}), and device {index} of "
            f"platform {platform!r} has {gib(device.free)} free of {gib(device.total)}, of which "
            f"{setting('memory_fraction', fraction)} allows {gib(budget)}; use {advice}"
        )
    capacity = room // (ranks * per_token)
    if capacity < 1:
        raise ConfigError(
            f"{arch}'s weights ({gib(weights)} per rank, {what}) leave no room for a KV cache in "
            f"{setting('memory_fraction', fraction)} of {gib(device.free)} free on device {index} of platform "
            f"{platform!r}; use {cache_advice}"
        )
    return MemoryPlan(
        fraction, config.dtype, tp, weights, per_token, index, device.total, device.free, ranks, int(capacity)
    )
