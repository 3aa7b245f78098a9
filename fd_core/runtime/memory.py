"""What fits in memory, worked out once in the plan: one rank's share of the weights, whether it fits the device
the platform reports, and how many blocks of paged KV cache the rest holds at --memory-fraction (less a step's
scratch), capped by --kv-cache-blocks, the platform's KV budget and what the batch could ever use."""

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

# Prompt tokens one step prefills at most (--max-prefill-tokens): a long prompt arriving is prefilled in chunks of
# this many beside the running decodes instead of stalling them.
DEFAULT_MAX_PREFILL_TOKENS = 512
__all__ = [
    "DEFAULT_MAX_PREFILL_TOKENS", "DEFAULT_MEMORY_FRACTION", "MemoryPlan", "check_fraction", "local_ranks",
    "plan_memory", "scratch_bytes",
]


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


def local_rank(rank: int, tp: int, env: Mapping[str, str] | None = None) -> int:
    """Rank `rank`'s index among the ranks on its host: paddle.distributed.launch's PADDLE_LOCAL_RANK under it, else
    `rank` (fd spawns every rank on this host)."""
    env = os.environ if env is None else env
    try:
        return int(env.get("PADDLE_LOCAL_RANK", rank)) % max(1, local_ranks(tp, env))
    except ValueError:
        return rank


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
    # Tokens of KV cache the room left after weights and scratch holds; None: the platform reports no memory.
    capacity_tokens: int | None = None
    # The paged cache: positions a block holds, the blocks a rank allocates (the null block not counted), and why
    # that many (the memory plan's room, --kv-cache-blocks, the platform's budget, or what the batch can use).
    block_size: int = 16
    blocks: int | None = None
    blocks_from: str = ""
    # What bounds the blocks: "memory" (the room left), "kv_cache_blocks" (the user's), "platform" (its KV budget),
    # "batch" (what max_batch sequences of the whole context could use) or "job" (what fd run's prompts use).
    blocks_bound: str = ""
    # One step's activations a rank may need (an estimate: see scratch_bytes), kept out of the cache's room.
    scratch_bytes: int = 0
    # A second model on the same ranks whose weights and cache the figures include (speculative decoding's draft).
    beside: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def cache_bytes(self) -> int:
        """Bytes the cache's blocks take on a rank."""
        return (self.blocks or 0) * self.block_size * self.cache_bytes_per_token

    def kv_cache(self) -> dict[str, Any]:
        """The cache as blocks, for fd explain --json: block size, blocks, bytes and tokens per rank."""
        blocks = self.blocks or 0
        return {"block_size": self.block_size, "blocks": blocks, "bytes": self.cache_bytes,
                "tokens": blocks * self.block_size, "from": self.blocks_from}

    def summary(self) -> str:
        """One line for fd explain and fd run."""
        both = f"; the {self.beside}'s included" if self.beside else ""
        weights = f"weights {gib(self.weights_per_rank)} per rank (tp={self.tp}, {self.dtype}{both})"
        cache = (f"KV cache {self.blocks} blocks of {self.block_size} ({(self.blocks or 0) * self.block_size} tokens, "
                 f"{gib(self.cache_bytes)}{both}) per rank: {self.blocks_from}")
        if self.device_free is None:
            return f"{weights}; {cache}; the platform reports no device memory"
        shared = f", shared by {self.ranks_per_device} ranks" if self.ranks_per_device > 1 else ""
        return (f"{weights}; {cache}; {setting('memory_fraction', self.fraction)} of {gib(self.device_free)} free on "
                f"device {self.device}{shared}")

    def for_job(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> "MemoryPlan":
        """The plan with no more blocks than these prompts and tokens can hold at once (every sequence to its last
        token), when that is fewer; a cache the user sized (--kv-cache-blocks) is kept. A run that knows its whole
        job (fd run) allocates only that: where the cache lives in host memory, every block allocated is resident."""
        if self.blocks is None or self.blocks_bound == "kv_cache_blocks" or not prompts:
            return self
        needed = sum(-(-(len(p) + max_new_tokens) // self.block_size) for p in prompts)
        if needed >= self.blocks:
            return self
        why = f"what its {len(prompts)} prompt(s) and {max_new_tokens} new tokens each use"
        return MemoryPlan(**{**self.to_dict(), "blocks": needed, "blocks_from": why, "blocks_bound": "job"})

    def check_request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, context: int, arch: str) -> None:
        """Refuse, in one line naming the numbers, a request whose longest sequence alone needs more blocks than the
        cache has (it could never run; a request that fits only later waits, or preempts)."""
        if self.blocks is None or not prompts:
            return
        longest = max(len(p) for p in prompts)
        needed = -(-(longest + max_new_tokens) // self.block_size)
        if needed <= self.blocks:
            return
        raise ConfigError(
            f"this request needs {needed} KV-cache blocks of {self.block_size} positions (its longest prompt, "
            f"{longest} "
            f"tokens, and {max_new_tokens} new), and {arch} at tp={self.tp} has {self.blocks} ({self.blocks_from}; "
            f"{self.block_size * self.cache_bytes_per_token} bytes a block per rank); ask for fewer tokens, or "
            f"{self._more_blocks()}"
        )

    def _more_blocks(self) -> str:
        """How to get more blocks, by what bounds them now."""
        if self.blocks_bound == "memory":
            return f"raise {setting('memory_fraction')}" + ("" if self.ranks_per_device > 1 else f" or {setting('tp')}")
        if self.blocks_bound == "batch":
            return f"raise {setting('max_batch')}"
        return f"raise {setting('kv_cache_blocks')} (up to what {setting('memory_fraction')} leaves)"


def scratch_bytes(config: "ModelConfig", tp: int, max_prefill_tokens: int, max_batch: int, positions: int = 1) -> int:
    """An estimate of one step's activations on a rank: a prefill chunk's residual stream, q/k/v, the MLP's
    intermediate and attention scores (a few copies of each), and a batch's logits in float32; `positions` a sequence
    in a decode step (1 + the proposals of speculative decoding's verify step, which returns each one's logits)."""
    width = config.dtype_width
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.resolved_head_dim
    per_token = (4 * config.hidden_size + 3 * config.intermediate_size // tp + 2 * (heads + 2 * kv) * dim // tp) * width
    rows = max(max_batch, 1) * max(positions, 1)
    logits = rows * (config.vocab_size // tp) * 4
    return max(max_prefill_tokens, rows) * per_token + logits


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
    ranks_here: int | None = None, *, block_size: int | None = None, kv_cache_blocks: int | None = None,
    max_batch: int = 8, max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, positions: int = 1,
    beside: "ModelConfig | None" = None,
) -> MemoryPlan:
    """Weights per rank checked against the device, and the blocks of KV cache the rest holds; a ConfigError if the
    weights do not fit, or if `kv_cache_blocks` asks for more than fits.

    Rank r of this host uses device r % len(devices); ranks on one device share it. The plan is bound by the used
    device with the least free memory: its budget is `fraction` of its free bytes, less the weights and a step's
    scratch of the ranks on it; what is left, divided by what a block costs those ranks, is the most blocks. The
    pool is that, capped by `kv_cache_blocks` (the user's), the platform's `kv_cache_bytes` and what `max_batch`
    sequences of the model's whole context could use. The block size is `block_size`, else the platform's, else
    fd's default; `positions`: what a sequence computes in a decode step (scratch_bytes). `beside` is a second model
    on the same ranks (speculative decoding's draft): its weights count with the model's, and its cache holds as many
    blocks (the plan's weights and bytes a token are the two models' together).
    """
    from fd_core.detection import DEFAULT_KV_BLOCK_SIZE

    fraction = check_fraction(fraction)
    size = _positive(block_size, "kv_block_size") or detection.kv_block_size or DEFAULT_KV_BLOCK_SIZE
    wanted = _positive(kv_cache_blocks, "kv_cache_blocks")
    max_prefill_tokens = _positive(max_prefill_tokens, "max_prefill_tokens") or DEFAULT_MAX_PREFILL_TOKENS
    weights = config.weight_bytes_per_rank(tp)
    per_token = config.cache_bytes_per_token(tp)
    if beside is not None:
        weights += beside.weight_bytes_per_rank(tp)
        per_token += beside.cache_bytes_per_token(tp)
    scratch = scratch_bytes(config, tp, max_prefill_tokens, max_batch, positions)
    per_block = per_token * size
    caps = [(max_batch * -(-config.max_position_embeddings // size), "batch",
             f"{max_batch} sequences of the model's whole context ({config.max_position_embeddings} tokens)")]
    if detection.kv_cache_bytes is not None:
        caps.append((max(1, detection.kv_cache_bytes // per_block), "platform",
                     f"the platform's KV budget of {gib(detection.kv_cache_bytes)} a rank"))
    devices = reported_devices(detection)
    beside_name = f"draft model {beside.architecture}" if beside is not None else ""
    plan = MemoryPlan(fraction, config.dtype, tp, weights, per_token, block_size=size, scratch_bytes=scratch,
                      beside=beside_name)
    if devices:
        here = ranks_here if ranks_here is not None else local_ranks(tp)
        used = sorted({r % len(devices) for r in range(here)})
        sharing = {d: sum(1 for r in range(here) if r % len(devices) == d) for d in used}
        # The binding device: the least budget per rank on it.
        index = min(used, key=lambda d: (devices[d].free * fraction / sharing[d], d))
        device, ranks = devices[index], sharing[index]
        budget = int(device.free * fraction)
        room = budget - ranks * (weights + scratch)
        what = f"{ranks} ranks of tp={tp} share it" if ranks > 1 else f"tp={tp}"
        # Ranks that share one device hold more weights together at a larger tp, not less: no --tp advice then.
        fraction_, tp_ = setting("memory_fraction"), setting("tp")
        # Nor at the platform's most ranks (Detection.max_ranks).
        at_limit = detection.max_ranks is not None and tp >= detection.max_ranks
        advice = (f"a higher {fraction_} or a smaller model (its ranks share the device, so a larger {tp_} does not "
                  f"help)" if ranks > 1 else
                  f"a higher {fraction_} or a smaller model ({setting('tp', tp)} is the most ranks platform "
                  f"{platform!r} serves)" if at_limit else f"a larger {tp_}, a higher {fraction_} or a smaller model")
        cache_advice = f"a higher {fraction_}" if ranks > 1 or at_limit else f"a larger {tp_} or a higher {fraction_}"
        if budget - ranks * weights <= 0:
            raise ConfigError(
                f"{arch} needs about {gib(weights)} of weights per rank ({config.dtype}, {what}), and device {index} "
                f"of platform {platform!r} has {gib(device.free)} free of {gib(device.total)}, of which "
                f"{setting('memory_fraction', fraction)} allows {gib(budget)}; use {advice}"
            )
        capacity = max(0, room) // (ranks * per_token)
        if capacity < size:
            raise ConfigError(
                f"{arch}'s weights ({gib(weights)} per rank, {what}) and a step's scratch ({gib(scratch)}) leave no "
                f"room for a KV cache in {setting('memory_fraction', fraction)} of {gib(device.free)} free on device "
                f"{index} of platform {platform!r}; use {cache_advice}"
            )
        by_memory = capacity // size
        if wanted is not None and wanted > by_memory:
            raise ConfigError(
                f"{setting('kv_cache_blocks', wanted)} needs {gib(wanted * per_block * ranks)} on device {index}, and "
                f"{setting('memory_fraction', fraction)} of its {gib(device.free)} free leaves room for {by_memory} "
                f"blocks of {size} after the weights; ask for fewer"
            )
        caps.append((by_memory, "memory", f"what {setting('memory_fraction', fraction)} leaves after the weights"))
        plan = MemoryPlan(fraction, config.dtype, tp, weights, per_token, index, device.total, device.free, ranks,
                          int(capacity), block_size=size, scratch_bytes=scratch, beside=beside_name)
    chosen = (wanted, "kv_cache_blocks", setting("kv_cache_blocks", wanted)) if wanted is not None else min(caps)
    blocks, bound, why = chosen
    return MemoryPlan(**{**plan.to_dict(), "blocks": int(blocks), "blocks_from": why, "blocks_bound": bound})


def _positive(value: Any, name: str) -> int | None:
    """`value` if None or a positive integer, else a one-line error naming the setting."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{setting(name)} must be a positive integer, got {value!r}")
    return int(value)
