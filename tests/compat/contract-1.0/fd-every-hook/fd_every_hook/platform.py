"""A host platform that implements every hook of fd's contract 1.0 and registers a kernel for every named op.

It runs where fd's cpu platform runs (it is selected only when forced: FD_PLATFORM=every_hook, or `fd check
every_hook`), sums through paddle.distributed, and captures graphs with paddle.jit.to_static.
Each kernel calls fd's native op (fd_core.native_ops, the documented reference) through a function of its own, so
that the suite compares a registered kernel with the native op for every op.
"""

import gc

from fd_core import Capabilities, Detection, DeviceMemory, GraphVote, hookimpl, native_ops

FD_CONTRACT = "1.0"
FD_CAPABILITIES = Capabilities(world_sizes=(1, 2), dtypes=("float32",), graphs=True, graph_world_sizes=(1, 2))

OPS = {
    "rms_norm": ("x", "weight", "eps"),
    "silu_and_mul": ("gate", "up"),
    "rotary_embedding": ("x", "cos", "sin", "layout"),
    "attention": ("q", "k", "v", "mask"),
    "sample": ("logits", "temperature", "top_k", "top_p", "uniform"),
    "allocate_kv_cache": ("num_blocks", "block_size", "kv_heads", "head_dim", "dtype"),
    "write_kv_cache": ("key", "value", "k_cache", "v_cache", "slot_mapping"),
    "paged_attention": ("q", "k_cache", "v_cache", "block_tables", "context_lens"),
    "paged_prefill_attention": ("q", "k_cache", "v_cache", "block_tables", "prefix_lens"),
    "matmul": ("x", "weight", "transpose_weight"),
}


def _kernel(op):
    """A kernel of this package's for `op`, taking the op's arguments by their names, computing the native op."""
    names = OPS[op]
    namespace = {"native": getattr(native_ops, op)}
    exec(f"def {op}({', '.join(names)}):\n    return native({', '.join(names)})\n", namespace)  # noqa: S102
    return namespace[op]


class ToStatic:
    """A graph backend of this package's own: one paddle.jit.to_static program per key, traced at capture."""

    mode = "to_static"

    def __init__(self):
        self.programs = {}

    def capture(self, key, fn, inputs):
        import paddle
        from paddle.static import InputSpec

        specs = [InputSpec(shape=list(t.shape), dtype=t.dtype) for t in inputs]
        program = paddle.jit.to_static(fn, input_spec=specs, full_graph=True)
        program(*inputs)
        self.programs[key] = program

    def replay(self, key, inputs):
        return self.programs[key](*inputs)

    def has(self, key):
        return key in self.programs

    def clear(self):
        self.programs.clear()


@hookimpl
def fd_platform_detect():
    import os

    return Detection(
        detected=True, priority=-5, reason="the host's CPU (a fixture: selected only when forced)", device="cpu",
        dist_backend="gloo", max_ranks=2, dtypes=("float32",),
        device_memory=(DeviceMemory(total=8 << 30, free=4 << 30),),
        host_cores=max(1, len(os.sched_getaffinity(0))), kv_block_size=32, kv_cache_bytes=64 << 20,
    )


@hookimpl
def fd_all_reduce(tensor, group):
    import paddle
    import paddle.distributed as dist

    if 0 in tensor.shape:
        return tensor  # nothing to sum (gloo refuses an empty buffer)
    if isinstance(tensor, paddle.Tensor):
        # eager: a view (a slice, a transpose) is summed as a dense copy; the returned tensor is what counts
        tensor = tensor.contiguous()
    dist.all_reduce(tensor, group=group)
    return tensor


@hookimpl
def fd_clean_memory_fragments(state_dict):
    gc.collect()


@hookimpl
def fd_graph_eligibility(model_config, parallel_config, graph_mode):
    return GraphVote.ok("every_hook traces static programs")


@hookimpl
def fd_graph_backend(parallel_config):
    return ToStatic()


@hookimpl
def fd_clear_graphs(model):
    return None  # no model of this package's


@hookimpl
def fd_register_models(register):
    return None  # a platform registers no architecture


@hookimpl
def fd_register_commands(register):
    register("every-hook", "say that the every_hook fixture is installed", lambda args: print("every_hook") or 0)


@hookimpl
def fd_check_request(request, model_config, parallel_config, stream):
    return None


@hookimpl
def fd_register_kernels(register):
    for op in OPS:
        register(op, _kernel(op))
