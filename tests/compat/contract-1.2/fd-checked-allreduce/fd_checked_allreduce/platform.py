"""Hook implementations of the `cpu_checked` platform: a debugging platform for tensor-parallel code.

Before each all-reduce, the ranks compare what they are about to sum: the call number, the shape
and the dtype. Ranks that disagree (one took another code path, reshaped a tensor differently, or
skipped a call) would otherwise sum garbage or wait in a collective until its timeout; here every
rank raises at once, naming the ranks and what each passed. The sum itself is the cpu platform's.

Importing this module imports neither paddle nor numpy: fd_core imports every platform module to
ask whether its hardware is here, and that must stay cheap.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

from fd_core import Capabilities, Detection, GraphVote, ModelConfig, ParallelConfig, RankContext, hookimpl
from fd_plugins.cpu import platform as _cpu

# The version of fd's plugin contract this plugin was written for (fd_core.contract): 1.2 for the rank lifecycle
# hooks, capture sizes and platform defaults.
FD_CONTRACT = "1.2"

# The decode batch sizes its static graphs are captured at (a batch of 3 is padded to 4, one above 8 runs eagerly):
# fewer captures to trace while debugging, and fd's capture-size check runs against a platform that declares them.
CAPTURE_SIZES = (1, 2, 4, 8)

# What the conformance suite (`fd check cpu_checked`) checks: the cpu platform's dtypes. Graphs:
# the cpu static-graph backend, vetoed at tp > 1 (see fd_graph_eligibility).
FD_CAPABILITIES = Capabilities(world_sizes=(1, 2), dtypes=_cpu.FD_CAPABILITIES.dtypes, graphs=True, in_place=True)

# A fingerprint is [call number, dtype code, rank count of the shape, dims...], padded to this length.
MAX_DIMS = 8
_SLOTS = 3 + MAX_DIMS

# Call numbers by process group (None is the default group): ranks that skip a call fall out of step.
_CALLS: dict[Any, int] = {}


@hookimpl
def fd_platform_detect() -> Detection:
    """Always available but opt-in: priority -1 keeps the built-in cpu platform the default."""
    cores = os.cpu_count() or 1
    return Detection(
        detected=True,
        priority=-1,
        reason="opt-in: set FD_PLATFORM=cpu_checked to check every all-reduce's shape and dtype across ranks "
        f"({cores} cores)",
        device="cpu",
        dist_backend="gloo",
        max_ranks=cores,
        capture_sizes=CAPTURE_SIZES,
        # One prompt prefilled a step (fd's default: as many as the token budget allows): a mismatch report then
        # names the call of one prompt's prefill, not of a batch of them. `--max-prefill-prompts` overrides it.
        max_prefill_prompts=1,
    )


@hookimpl
def fd_rank_start(rank: RankContext) -> None:
    """A rank's call numbers start at 1 (a new rank in this process, after another ended); then the cpu platform's
    thread pools."""
    _CALLS.clear()
    _cpu.fd_rank_start(rank)


@hookimpl
def fd_before_step(rank: RankContext, rows: int | None) -> None:
    """The cpu platform's per-phase thread policy."""
    _cpu.fd_before_step(rank, rows)


@hookimpl
def fd_rank_end(rank: RankContext, reason: str) -> None:
    """Forget the rank's call numbers."""
    _CALLS.clear()


@hookimpl
def fd_all_reduce(tensor: Any, group: Any) -> Any:
    """Check that every rank passes the same call number, shape and dtype; then sum as the cpu platform does."""
    check_in_step(tensor, group)
    return _cpu.fd_all_reduce(tensor, group)


def fingerprint(call: int, shape: list[int], dtype: str) -> list[int]:
    """The integers the ranks compare for one call (a shape of more than MAX_DIMS dims keeps its first ones)."""
    code = zlib.crc32(dtype.encode())
    dims = list(shape[:MAX_DIMS]) + [-1] * (MAX_DIMS - min(len(shape), MAX_DIMS))
    return [call, code, len(shape), *dims]


def describe(values: list[int], dtype_of: dict[int, str]) -> str:
    """A fingerprint as a person reads it: call 12: float32[1, 4, 1024]."""
    call, code, ndim, *dims = values
    return f"call {call}: {dtype_of.get(code, f'dtype#{code}')}{dims[:min(ndim, MAX_DIMS)]}"


def check_in_step(tensor: Any, group: Any) -> None:
    """Gather every rank's fingerprint of this call (one small gloo all-gather); raise on every rank if they differ."""
    import paddle
    import paddle.distributed as dist

    call = _CALLS[group] = _CALLS.get(group, 0) + 1
    dtype = str(tensor.dtype).replace("paddle.", "")
    mine = fingerprint(call, list(tensor.shape), dtype)
    gathered: list[Any] = []
    dist.all_gather(gathered, paddle.to_tensor(mine, dtype="int64"), group=group)
    seen = [t.numpy().tolist() for t in gathered]
    if all(s == seen[0] for s in seen):
        return
    names = {fingerprint(0, [], d)[1]: d for d in {dtype, *_cpu.FD_CAPABILITIES.dtypes}}
    ranks = "; ".join(f"rank {r} {describe(s, names)}" for r, s in enumerate(seen))
    raise RuntimeError(f"cpu_checked: the ranks' all-reduce calls differ ({ranks}); they took different code paths")


@hookimpl
def fd_clean_memory_fragments(state_dict: dict[str, Any] | None) -> None:
    """The cpu platform's cleanup: collect reference cycles."""
    _cpu.fd_clean_memory_fragments(state_dict)


@hookimpl
def fd_graph_eligibility(
    model_config: ModelConfig, parallel_config: ParallelConfig, graph_mode: str,
) -> GraphVote | None:
    """Veto static graphs at tp > 1: a captured all-reduce would run unchecked."""
    if parallel_config.tp_size > 1:
        return GraphVote.veto("the cross-rank check runs in Python before each all-reduce; "
                              "a static graph would skip it")
    return GraphVote.ok("one rank: no all-reduce to check")


@hookimpl
def fd_graph_backend(parallel_config: ParallelConfig) -> Any:
    """The cpu platform's static-graph backend (used at tp 1, where no all-reduce runs)."""
    return _cpu.fd_graph_backend(parallel_config)
