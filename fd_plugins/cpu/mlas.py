"""The cpu platform's float32 products through ONNX Runtime's MLAS kernels, a weight's layout prepared once at load.

Paddle's CPU build multiplies through its bundled MKL (2019.0.5), which on AMD CPUs runs an unvectorised sgemm as
soon as a product has two rows: a decode step's products grew almost linearly with the batch. MLAS, ONNX Runtime's
own CPU kernels, picks its vectorised kernel by the CPU it runs on (AVX2, AVX-512, on Intel and AMD alike) and packs
a constant weight into its kernel's panel layout once, so that each product reads the weight once for every row of
the step (docs/benchmarks.md has the figures). A product is one ONNX Runtime session of one node (MatMul, or Gemm
with the weight transposed) whose weight is handed over as an external initializer: ONNX Runtime packs it and no
longer reads the loaded tensor, which the runtime then releases (one copy of each weight is held, not two).

A product over a large vocabulary (the LM head) is packed too: read in place, unpacked, its products of two rows or
more repacked the whole weight at every call (measured on ERNIE-4.5-0.3B's head, 404 MiB: 9.8 ms for one row, 40 ms
for two to eight; packed, 11.2 to 15.1 ms), so a batched step or a speculative verify paid four times one row's head.
A tied head's table is then held twice, once packed here and once as the embedding's (docs/benchmarks.md).

Sessions share one pool of compute threads per process (ONNX Runtime's global pool), sized at the first product
to the rank's threads (`set_threads`, from fd_rank_start). A product runs eagerly only: a static program cannot hold
it, so the cpu platform votes against capturing a model whose products MLAS serves (`serves_model`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

# Below this many bytes a weight stays Paddle's: one session call (about 5 us, plus handing x and the result across)
# gains nothing over Paddle's product on a weight this small, and the tiny models of the tests keep their static
# graphs.
MLAS_MIN_BYTES = 1 << 20

_threads: dict[str, int] = {}


def set_threads(count: int) -> None:
    """The compute threads of this process's rank: the size of the pool the first product creates."""
    _threads["rank"] = max(1, int(count))


@functools.cache
def _runtime() -> Any:
    """onnxruntime, imported on first use (never by `fd plugins`), or None when it is not installed."""
    try:
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime


def available() -> bool:
    """Whether ONNX Runtime is installed (the cpu extra installs it); without it every product is Paddle's."""
    return _runtime() is not None and _onnx() is not None


@functools.cache
def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        return None
    return onnx


@functools.cache
def _pool() -> int:
    """Create ONNX Runtime's global thread pool once per process; its size."""
    ort = _runtime()
    threads = _threads.get("rank") or _usable_cores()
    # Each call spins none: a rank's other work (Paddle's ops, the all-reduce) runs between products.
    ort.set_global_thread_pool_sizes(threads, 1)
    return threads


def _usable_cores() -> int:
    from fd_core.detection import affinity_cores
    from fd_plugins.cpu.cores import cgroup_cpu_limit, usable_cores

    return usable_cores(affinity_cores(), cgroup_cpu_limit())


def serves(weight: Any) -> bool:
    """Whether MLAS multiplies by this weight: a float32 weight of MLAS_MIN_BYTES or more, with ONNX Runtime
    installed."""
    import paddle

    # The size first: ONNX Runtime is imported only for a weight it would serve (a tiny model never imports it).
    if weight.dtype != paddle.float32 or len(weight.shape) != 2 or math.prod(weight.shape) * 4 < MLAS_MIN_BYTES:
        return False
    return available()


# The block sizes MLAS's quantized product takes (MatMulNBits' block_size): a group of one of these is its block; a
# weight quantized per output channel is cut into blocks of PER_CHANNEL_BLOCK, each given its row's scale.
QUANT_BLOCKS = (16, 32, 64, 128, 256)
PER_CHANNEL_BLOCK = 32


def quant_block(rows: int, columns: int, groups: int) -> int | None:
    """The MLAS block of a quantized weight [rows, columns] in `groups` groups a row (1: per output channel), or None
    where MLAS does not serve it (a group size it has no kernel for, or a weight below MLAS_MIN_BYTES as float32)."""
    if rows * columns * 4 < MLAS_MIN_BYTES or not available():
        return None
    if groups == 1:
        return PER_CHANNEL_BLOCK
    size = columns // groups
    return size if size * groups == columns and size in QUANT_BLOCKS else None


def serves_model(weights: Sequence[tuple[int, int, bool]], dtype: str, group: int) -> bool:
    """Whether MLAS serves some product of a model whose weights are these (outputs, inputs, quantized), in `dtype`,
    quantized ones in groups of `group` inputs (0: per output channel)."""
    from fd_core.quantization import group_for

    if dtype != "float32":
        return False
    return any(quant_block(rows, columns, columns // group_for(columns, group)) is not None if quantized
               else rows * columns * 4 >= MLAS_MIN_BYTES and available() for rows, columns, quantized in weights)


class MlasProduct:
    """x [..., K] times one prepared weight: [K, N] as is, or [N, K] transposed."""

    def __init__(self, weight: Any, transpose_weight: bool) -> None:
        import numpy as np

        ort, onnx = _runtime(), _onnx()
        rows, columns = (int(d) for d in weight.shape)
        self.k, self.n = (columns, rows) if transpose_weight else (rows, columns)
        self.transpose_weight = transpose_weight
        view = np.from_dlpack(weight.contiguous() if not weight.is_contiguous() else weight)
        options = ort.SessionOptions()
        _pool()
        options.use_per_session_threads = False
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # The session's working buffers are small; an arena would hold the largest one for good.
        options.enable_cpu_mem_arena = False
        # An initializer whose data is handed over: ONNX Runtime packs it and reads the loaded tensor no more.
        options.add_external_initializers(["W"], [ort.OrtValue.ortvalue_from_numpy(view)])
        self.session = ort.InferenceSession(
            _model(onnx, rows, columns, self.k, self.n, transpose_weight), options, providers=["CPUExecutionProvider"],
        )

    def __call__(self, x: Any) -> Any:
        return _bound_run(self.session, x, self.k, self.n, "matmul")

    def __repr__(self) -> str:
        shape = (self.n, self.k) if self.transpose_weight else (self.k, self.n)
        return f"MlasProduct({list(shape)}, transpose_weight={self.transpose_weight})"


def _bound_run(session: Any, x: Any, k: int, n: int, op: str, odd_k: bool = False) -> Any:
    """One product of x [..., k] into a new float32 tensor [..., n]: ONNX Runtime reads x and writes the result in
    Paddle's own memory (I/O binding by address, x's leading dimensions taken as rows: no reshape either way). Handing
    arrays across instead cost a copy each way, and paddle.to_tensor's result leaks about 100 bytes a call in Paddle
    3.3.1 (fd_core.models.host_tensor), at every product of every step. A decode step makes one such call a weight,
    so what surrounds the run is kept small (about 10 us a call less than with reshapes, measured). With `odd_k`, x
    may have k - 1 columns (a 4-bit weight of odd K: x gets a zero column)."""
    paddle, capturing, float32 = _eager_parts()
    if capturing() or not paddle.in_dynamic_mode():
        raise RuntimeError(
            f"plugin 'cpu': {op}: a product ONNX Runtime's MLAS serves cannot be captured in a static program; run "
            "with --graph off"
        )
    a = x if x.dtype == paddle.float32 else x.astype("float32")
    a = a if a.is_contiguous() else a.contiguous()
    lead = a.shape[:-1]
    rows = math.prod(lead)
    columns = a.shape[-1]
    if columns != k and not (odd_k and columns == k - 1):
        # Bound by address, a wrong width would read other elements and return garbage, not fail.
        raise ValueError(f"plugin 'cpu': {op}: x has {columns} columns, the weight takes {k}")
    if columns < k:  # an odd K of a 4-bit weight (MlasQuantProduct): x gets a zero column
        a = paddle.concat([a.reshape([rows, -1]), paddle.zeros([rows, k - columns], dtype=a.dtype)], 1)
    out = paddle.empty([*lead, n], dtype="float32")
    binding = session.io_binding()
    binding.bind_input("A", "cpu", 0, float32, [rows, k], a.data_ptr())
    binding.bind_output("Y", "cpu", 0, float32, [rows, n], out.data_ptr())
    session.run_with_iobinding(binding)
    return out


@functools.cache
def _eager_parts() -> tuple[Any, Any, Any]:
    """paddle, fd's capture check and numpy's float32, looked up once: every product call needs them."""
    import numpy as np
    import paddle

    from fd_core.graphs import capturing

    return paddle, capturing, np.float32


def _model(onnx: Any, rows: int, columns: int, k: int, n: int, transpose_weight: bool) -> bytes:
    """One product as an ONNX model: A [M, K] float32 times W, an initializer whose data is handed over (external)."""
    helper, proto = onnx.helper, onnx.TensorProto
    node = (helper.make_node("Gemm", ["A", "W"], ["Y"], transB=1) if transpose_weight
            else helper.make_node("MatMul", ["A", "W"], ["Y"]))
    graph = helper.make_graph(
        [node], "fd_product", [helper.make_tensor_value_info("A", proto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", proto.FLOAT, ["M", n])],
        [_external(proto, "W", proto.FLOAT, [rows, columns])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


class MlasQuantProduct:
    """x [..., K] times the transpose of a weight in fd's quantized form (fd_core.quantization), through MLAS's
    weight-only product (ONNX Runtime's MatMulNBits): its int8 or 4-bit codes in blocks along K with a scale a block,
    multiplied by x rounded to int8 per block (accuracy level 4: integer dot products, as llama.cpp's q8_0 and q4_0
    products are; the quant_matmul op allows it within a stated bound)."""

    def __init__(self, values: Any, scales: Any, bits: int, block: int) -> None:
        import numpy as np

        ort, onnx = _runtime(), _onnx()
        rows = int(values.shape[0])
        # A 4-bit row holds ceil(K / 2) bytes: K is taken as even, and an odd K's x gets a zero column (its padded
        # value is 0).
        self.k = int(values.shape[1]) * (2 if bits == 4 else 1)
        self.n, self.bits, self.block = rows, bits, block
        blocks = -(-self.k // block)
        codes = np.ascontiguousarray(values.numpy()).view(np.uint8)
        # fd's values are two's complement; MLAS's codes are offset by the zero point (128, or 8 a nibble): the same
        # bytes with each value's top bit flipped.
        codes = codes ^ np.uint8(0x80 if bits == 8 else 0x88)
        width = block * bits // 8
        if codes.shape[1] < blocks * width:  # K not a multiple of the block: pad with the zero point's code
            pad = np.full((rows, blocks * width - codes.shape[1]), 0x80 if bits == 8 else 0x88, dtype=np.uint8)
            codes = np.concatenate([codes, pad], axis=1)
        factors = scales.astype("float32").numpy()
        factors = np.repeat(factors.reshape(rows, 1), blocks, axis=1) if factors.ndim == 1 else factors
        options = ort.SessionOptions()
        _pool()
        options.use_per_session_threads = False
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_cpu_mem_arena = False
        self._held: Any = (codes.reshape(rows, blocks, width), np.ascontiguousarray(factors, dtype=np.float32))
        options.add_external_initializers(
            ["B", "S"], [ort.OrtValue.ortvalue_from_numpy(a) for a in self._held]
        )
        self.session = ort.InferenceSession(
            _quant_model(onnx, rows, blocks, width, self.k, self.n, bits, block), options,
            providers=["CPUExecutionProvider"],
        )
        # Packed by ONNX Runtime when the session was made: the codes and scales handed over are read no more.
        self._held = None

    def __call__(self, x: Any) -> Any:
        out = _bound_run(self.session, x, self.k, self.n, "quant_matmul", odd_k=self.bits == 4)
        return out if out.dtype == x.dtype else out.astype(x.dtype)

    def __repr__(self) -> str:
        return f"MlasQuantProduct([{self.n}, {self.k}], bits={self.bits}, block={self.block})"


def _quant_model(onnx: Any, rows: int, blocks: int, width: int, k: int, n: int, bits: int, block: int) -> bytes:
    """MatMulNBits as an ONNX model: A [M, K] float32 times codes B [N, blocks, width] scaled by S [N, blocks]."""
    helper, proto = onnx.helper, onnx.TensorProto
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=4)
    inits = [_external(proto, "B", proto.UINT8, [rows, blocks, width]),
             _external(proto, "S", proto.FLOAT, [rows, blocks])]
    graph = helper.make_graph([node], "fd_quant_product", [helper.make_tensor_value_info("A", proto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", proto.FLOAT, ["M", n])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _external(proto: Any, name: str, kind: int, dims: list[int]) -> Any:
    """An initializer whose data add_external_initializers supplies (its location is never opened)."""
    tensor = proto(name=name, data_type=kind, dims=dims, data_location=proto.EXTERNAL)
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "fd-prepared-weight"
    return tensor
