"""Hook implementations of the cpu platform, the embedded default."""

from __future__ import annotations

import gc
import os
from typing import Any

from fd_core import Capabilities, Detection, GraphVote, ModelConfig, ParallelConfig, RankContext, hookimpl
from fd_plugins.cpu.memory import host_memory
from fd_plugins.cpu.threads import apply_threads, limit_numpy_blas, phase_threads, users_threads_env

# The version of fd's plugin contract this plugin was written for (fd_core.contract).
FD_CONTRACT = "1.9"

# What the conformance suite checks; float16 is summed in float32 (see fd_all_reduce).
FD_CAPABILITIES = Capabilities(
    world_sizes=(1, 2),
    dtypes=("float32", "float64", "float16", "bfloat16", "int32", "int64"),
    graphs=True,
    in_place=True,
)
# One reducer per process group (None is the default group), made by the group's first eager all-reduce.
_REDUCERS: dict[Any, Any] = {}


# The KV-cache bytes a rank allocates by default on a host (2 GiB: ERNIE-4.5-0.3B's cache of about 58k tokens a rank
# in float32).
KV_CACHE_BYTES = 2 << 30
# Prompt tokens a step prefills beside the running decodes (Detection.max_prefill_tokens), chosen by measurement
# (docs/benchmarks.md): at ERNIE-4.5-0.3B's size with 8 clients streaming, 64 took the inter-token latency's p99 from
# 1.4 to 1.8 s (fd's default of 512) to 0.63 s, with the same time to first token (p50) and throughput; a lone
# 1,000-token prompt prefills no slower in chunks of 64 (the products' rows are bound by arithmetic either way).
PREFILL_TOKENS = 64


@hookimpl
def fd_platform_detect() -> Detection:
    """Always available: every build of paddle has CPU kernels."""
    from fd_core.detection import affinity_cores
    from fd_plugins.cpu.cores import cgroup_cpu_limit, describe, usable_cores

    cores = os.cpu_count() or 1
    affinity, quota = affinity_cores(), cgroup_cpu_limit()
    return Detection(
        detected=True,
        priority=0,
        reason=f"always available ({cores} cores, {describe(affinity, quota)})",
        device="cpu",
        dist_backend="gloo",
        max_ranks=cores,
        # Paddle's CPU kernels have no bfloat16 or float16 matmul.
        dtypes=("float32",),
        # The host is one device, which every rank on it shares: its memory within this process's cgroup limit.
        device_memory=tuple(m for m in (host_memory(),) if m is not None),
        # What compute threads may use; the plan divides it among the host's ranks.
        host_cores=usable_cores(affinity, quota),
        # The KV cache is allocated whole when a run starts, and a host shares its memory with everything else on it:
        # a rank takes at most this much unless --kv-cache-blocks asks for more (vLLM's CPU backend does the same).
        kv_cache_bytes=KV_CACHE_BYTES,
        max_prefill_tokens=PREFILL_TOKENS,
        # The user's OMP_NUM_THREADS, when set, is their count of compute threads per rank.
        threads_env=users_threads_env(),
    )



@hookimpl
def fd_rank_start(rank: RankContext) -> None:
    """Size Paddle's thread pools, and the pool MLAS's products will share, for the rank's compute threads before it
    loads a weight."""
    from fd_plugins.cpu.mlas import set_threads

    apply_threads(rank.threads)
    set_threads(rank.threads)
    limit_numpy_blas(1)


@hookimpl
def fd_before_step(rank: RankContext, rows: int | None) -> None:
    """A one-row decode step's library products on one thread, other phases on the rank's (fd_plugins.cpu.threads);
    every phase, not only on a change: MKL's count is the process's, which another engine may have set."""
    apply_threads(phase_threads(rank, rows))


@hookimpl
def fd_all_reduce(tensor: Any, group: Any) -> Any:
    """Sum through shared memory when the group's ranks share this host and the tensor fits a slot, else over gloo."""
    reducer = _REDUCERS.get(group)
    if reducer is None:
        # The group's set-up is collective and eager: it waits for an eager call, which every rank
        # makes together (a static-graph trace or a zero-size tensor is not one: gloo serves those).
        if 0 in tensor.shape or not _is_eager(tensor):
            return gloo_all_reduce(tensor, group)
        from fd_plugins.cpu.shm import setup_group

        state = setup_group(group, gloo_all_reduce)
        reducer = _REDUCERS[group] = state.reducer()
    return reducer(tensor)


def gloo_all_reduce(tensor: Any, group: Any) -> Any:
    """Sum over gloo (what a static graph traces, and the path across hosts and above the slot size)."""
    import paddle
    import paddle.distributed as dist

    if 0 in tensor.shape:
        return tensor
    if isinstance(tensor, paddle.Tensor) and not tensor.is_contiguous():
        # gloo takes only dense memory ("The tensor must be contiguous"): sum a dense copy, write it
        # back through the view.
        dense = gloo_all_reduce(tensor.contiguous(), group)
        paddle.assign(dense, output=tensor)
        return tensor
    if tensor.dtype == paddle.float16:
        # gloo's float16 sum overflows to inf (seen with paddle 3.3.1): sum in float32.
        wide = tensor.astype("float32")
        dist.all_reduce(wide, group=group)
        paddle.assign(wide.astype(tensor.dtype), output=tensor)
        return tensor
    dist.all_reduce(tensor, group=group)
    return tensor


def _is_eager(tensor: Any) -> bool:
    import paddle

    return isinstance(tensor, paddle.Tensor)


@hookimpl
def fd_clean_memory_fragments(state_dict: dict[str, Any] | None) -> None:
    """Collect cycles (freeing what they hold), then return the C heap's free pages to the system."""
    from fd_plugins.cpu.memory import return_freed_memory

    gc.collect()
    return_freed_memory()


# Above this much dense weight per rank (what a decode step reads), a static program gains nothing
# over eager ops (see fd_graph_eligibility).
STATIC_GAIN_WEIGHT_BYTES = 64 << 20


@hookimpl
def fd_graph_eligibility(model_config: ModelConfig, parallel_config: ParallelConfig, graph_mode: str) -> GraphVote:
    """Vetoed for a model whose products MLAS runs; else static graphs pay only for small models at tp=1, so auto
    skips the rest (--graph on captures)."""
    from fd_plugins.cpu.mlas import MLAS_MIN_BYTES, serves_model

    products = decoder_weights(model_config, parallel_config.tp_size)
    if serves_model(products, model_config.dtype, model_config.quantization_group or 0):
        # Its products of weights this large run on ONNX Runtime's MLAS kernels (fd_plugins.cpu.mlas), outside Paddle:
        # a static program cannot call them.
        return GraphVote.veto(
            f"its products of weights of {MLAS_MIN_BYTES >> 20} MiB or more run on ONNX Runtime's MLAS kernels, "
            "which a Paddle static program cannot hold"
        )
    weights = model_config.weight_bytes_per_rank(parallel_config.tp_size)
    if weights > STATIC_GAIN_WEIGHT_BYTES:
        # A step that reads this much weight is bound by memory, not op dispatch: at ERNIE-4.5-0.3B
        # (1.4 GB) a static program's step measured no faster than eager ops, and tracing it delayed
        # the first token by seconds (docs/benchmarks.md has the figures).
        return GraphVote.no_gain(
            f"the model holds {weights / 2**20:.0f} MiB of dense weights per rank, "
            f"more than {STATIC_GAIN_WEIGHT_BYTES >> 20} MiB: memory-bound, "
            "where a static program runs no faster than eager ops and its capture delays the first token"
        )
    if parallel_config.tp_size > 1:
        # A traced program can only hold the gloo all-reduce (the shared-memory one runs in numpy),
        # which is far slower a call than the shared-memory one eagerly; docs/benchmarks.md measures both.
        return GraphVote.no_gain(
            "a static program would trace the gloo all-reduce; "
            "eager decode uses the shared-memory one, far faster on one host"
        )
    return GraphVote.ok("paddle static graph traces the model")


def decoder_weights(model_config: ModelConfig, tp: int) -> list[tuple[int, int, bool]]:
    """(outputs, inputs, quantized) of each weight a rank's decoder step multiplies by, as the shared layers hold them:
    the fused q/k/v and gate/up weights, o, down and the LM head, split as tensor parallelism splits them."""
    hidden, head_dim = model_config.hidden_size, model_config.resolved_head_dim
    quantized = model_config.quantization is not None
    qkv = (model_config.num_attention_heads + 2 * model_config.num_key_value_heads) * head_dim
    return [(-(-qkv // tp), hidden, quantized),
            (hidden, -(-model_config.num_attention_heads * head_dim // tp), quantized),
            (-(-2 * model_config.intermediate_size // tp), hidden, quantized),
            (hidden, -(-model_config.intermediate_size // tp), quantized),
            (-(-model_config.vocab_size // tp), hidden, quantized and not model_config.float_embeddings)]


@hookimpl
def fd_graph_backend(parallel_config: ParallelConfig) -> Any:
    """A static-graph backend."""
    from fd_plugins.cpu.static_graph import StaticGraphBackend

    return StaticGraphBackend()


@hookimpl
def fd_register_kernels(register: Any) -> None:
    from fd_plugins.cpu.attention import (
        paged_attention,
        paged_packed_attention,
        paged_prefill_attention,
        write_kv_cache,
    )
    from fd_plugins.cpu.kernels import add_rms_norm, rms_norm, rotary_embedding
    from fd_plugins.cpu.products import matmul, prepare_matmul, prepare_quant, quant_matmul

    register("rms_norm", rms_norm)
    register("add_rms_norm", add_rms_norm)
    register("rotary_embedding", rotary_embedding)
    register("write_kv_cache", write_kv_cache)
    register("paged_attention", paged_attention)
    register("paged_prefill_attention", paged_prefill_attention)
    register("paged_packed_attention", paged_packed_attention)
    register("matmul", matmul, prepare=prepare_matmul)
    register("quant_matmul", quant_matmul, prepare=prepare_quant)
