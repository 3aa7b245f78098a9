"""The cuda platform on a machine without CUDA: checked against the installed Paddle's real API, and with
its device calls substituted and recorded. None of these tests runs on a GPU."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import paddle
import paddle.distributed as dist
import pytest

from fd_core import DeviceMemory, ParallelConfig
from fd_core.testing import Capabilities, PlatformSuite
from fd_plugins.cuda import graphs as cuda_graphs
from fd_plugins.cuda import platform as cuda
from recording import FakeCUDAGraph, substitute


class TestCudaPlatform(PlatformSuite):
    """The conformance suite: contract checks run here; device checks skip (no CUDA device). Not on hardware."""

    @pytest.fixture
    def platform_name(self) -> str:
        return "cuda"

    @pytest.fixture
    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32", "float16", "bfloat16"))


def test_paddle_api_the_plugin_calls_exists_with_these_signatures() -> None:
    """The installed Paddle's real signatures; does not run on a GPU."""
    params = inspect.signature(dist.all_reduce).parameters
    assert {"tensor", "op", "group", "sync_op"} <= set(params)
    assert hasattr(dist.ReduceOp, "SUM")
    from paddle.device.cuda.graphs import CUDAGraph

    for method in ("capture_begin", "capture_end", "replay", "reset"):
        assert callable(getattr(CUDAGraph, method))
    assert callable(paddle.device.cuda.empty_cache) and callable(paddle.device.synchronize)
    assert callable(paddle.device.cuda.device_count) and callable(paddle.device.cuda.get_device_name)
    # The memory report: each device's properties (total_memory) and what paddle's allocator reserves of it.
    assert list(inspect.signature(paddle.device.cuda.get_device_properties).parameters) == ["device"]
    assert list(inspect.signature(paddle.device.cuda.memory_reserved).parameters) == ["device"]


def test_all_reduce_calls_paddle_all_reduce_with_sum_and_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Substituted paddle.distributed.all_reduce, recorded; does not run on a GPU."""
    log: list = []
    substitute(monkeypatch, dist, "all_reduce", log)
    tensor, group = paddle.ones([4]), object()
    assert cuda.fd_all_reduce(tensor, group) is tensor
    assert log == [("all_reduce", (tensor,), {"op": dist.ReduceOp.SUM, "group": group, "sync_op": True})]


def test_cleanup_frees_the_state_dict_then_empties_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real tensors are cleared; empty_cache and synchronize are substituted and recorded. Not on a GPU."""
    log: list = []
    substitute(monkeypatch, paddle.device.cuda, "empty_cache", log, None)
    substitute(monkeypatch, paddle.device, "synchronize", log, None)
    weight = paddle.ones([16, 16])
    state = {"w": weight}
    cuda.fd_clean_memory_fragments(state)
    assert state == {} and not weight._is_initialized()
    staged = {"w": np.ones((4, 4), dtype=np.float32)}  # what the runner passes after seeded weights
    cuda.fd_clean_memory_fragments(staged)
    assert staged == {}
    del log[2:]
    assert [name for name, _, _ in log] == ["empty_cache", "synchronize"]
    cuda.fd_clean_memory_fragments(None)  # safe without a state dict
    assert [name for name, _, _ in log] == ["empty_cache", "synchronize"] * 2


def test_graph_backend_captures_replays_and_resets_through_cudagraph(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDAGraph substituted by a recorder; the eager function runs on the CPU. Not on a GPU."""
    import paddle.device.cuda.graphs as paddle_graphs

    monkeypatch.setattr(paddle_graphs, "CUDAGraph", FakeCUDAGraph)
    FakeCUDAGraph.log = []
    calls: list = []

    def fn(x):
        calls.append(x)
        FakeCUDAGraph.log.append("fn")
        return x * 2

    backend = cuda.fd_graph_backend(ParallelConfig())
    assert isinstance(backend, cuda_graphs.CudaGraphBackend) and backend.mode == "cuda_graph"
    backend.capture(1, fn, [paddle.ones([2])])
    # One eager warm-up, then the captured run between begin and end.
    assert FakeCUDAGraph.log == ["fn", "init", "capture_begin", "fn", "capture_end"]
    static_input = calls[-1]
    backend.replay(1, [paddle.to_tensor([3.0, 4.0])])
    assert FakeCUDAGraph.log[-1] == "replay"
    np.testing.assert_array_equal(static_input.numpy(), [3.0, 4.0])  # new input copied into the captured buffer
    assert backend.has(1)
    backend.clear()
    assert FakeCUDAGraph.log[-1] == "reset" and not backend.has(1)


def test_detection_on_this_cpu_build_says_which_build_and_what_to_install() -> None:
    """This machine's real CPU build; whether detection imports paddle: tests/docs/test_install.py."""
    answer = cuda.fd_platform_detect()
    assert not answer.detected and not paddle.is_compiled_with_cuda()  # the reason's claim, checked
    assert answer.reason == (
        f"paddle is the CPU build (paddlepaddle {paddle.__version__}): "
        "install paddlepaddle-gpu for your CUDA version, see docs/install.md"
    )


def _installed(**versions: str):
    """A stand-in for the plugin's metadata lookup: these distributions at these versions, nothing else."""
    return lambda name: versions.get(name)


def test_detection_names_the_wrong_or_doubled_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Metadata and is_compiled_with_cuda substituted; does not run on a GPU."""
    monkeypatch.setattr(cuda, "installed", _installed(**{"paddlepaddle-gpu": "3.2.1", "paddlepaddle": "3.3.1"}))
    assert cuda.fd_platform_detect().reason == (
        "paddlepaddle and paddlepaddle-gpu are both installed and overwrite each other's paddle: "
        "pip uninstall -y paddlepaddle paddlepaddle-gpu, then install paddlepaddle-gpu for your CUDA version, see docs/install.md"
    )
    monkeypatch.setattr(cuda, "installed", _installed(**{"paddlepaddle-gpu": "3.2.1"}))
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: False)
    assert cuda.fd_platform_detect().reason == (
        "paddle is not a CUDA build (paddlepaddle-gpu 3.2.1, is_compiled_with_cuda() is False): "
        "install paddlepaddle-gpu for your CUDA version, see docs/install.md"
    )


def test_detection_with_a_cuda_build_and_two_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU build and its device queries are substituted; does not run on a GPU."""
    monkeypatch.setattr(cuda, "installed", _installed(**{"paddlepaddle-gpu": "3.3.1"}))
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(paddle.device.cuda, "get_device_name", lambda index=0: "Fake H100")
    log: list = []
    substitute(monkeypatch, paddle.device.cuda, "get_device_properties", log, SimpleNamespace(total_memory=80 * 2**30))
    substitute(monkeypatch, paddle.device.cuda, "memory_reserved", log, 2**30)
    answer = cuda.fd_platform_detect()
    assert answer.detected and answer.priority == 10 and answer.max_ranks == 2
    assert answer.device == "gpu" and answer.dist_backend == "nccl"
    assert answer.reason == "2 CUDA device(s): Fake H100"
    # Per device, not per host: each device's total, less what paddle's allocator holds of it.
    assert answer.device_memory == (DeviceMemory(total=80 * 2**30, free=79 * 2**30),) * 2
    assert [(name, args) for name, args, _ in log] == [
        ("get_device_properties", (0,)), ("memory_reserved", (0,)),
        ("get_device_properties", (1,)), ("memory_reserved", (1,)),
    ]
    assert answer.problem() is None
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 0)
    assert cuda.fd_platform_detect().reason == "paddle is a CUDA build but sees no CUDA device"


def test_a_failed_memory_query_leaves_the_device_detected_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device queries substituted; the installed CPU build's real get_device_properties raises. Not on a GPU."""
    monkeypatch.setattr(cuda, "installed", lambda name: {"paddlepaddle-gpu": "3.3.1"}.get(name))
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(paddle.device.cuda, "get_device_name", lambda index=0: "Fake H100")
    answer = cuda.fd_platform_detect()
    assert answer.detected and answer.device_memory == ()
    assert answer.reason.startswith("1 CUDA device(s): Fake H100 (memory not reported: ValueError: ")


def test_cleanup_leaves_a_lazy_mapping_of_seeded_weights_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the runner passes after seeded weights: a read-only Mapping whose tensors are drawn when read. The
    cleanup must neither draw them again nor call .clear() on it. Device calls substituted; not on a GPU."""
    from fd_core import WeightSpec
    from fd_core.runtime.weights import RandomShards

    log: list = []
    substitute(monkeypatch, paddle.device.cuda, "empty_cache", log, None)
    substitute(monkeypatch, paddle.device, "synchronize", log, None)
    drawn: list = []

    class Watched(RandomShards):
        def __getitem__(self, name):
            drawn.append(name)
            return super().__getitem__(name)

    shards = Watched({"w": WeightSpec((4, 4))}, seed=0)
    cuda.fd_clean_memory_fragments(shards)
    assert drawn == [] and len(shards) == 1
    assert [name for name, _, _ in log] == ["empty_cache", "synchronize"]


def test_all_reduce_runs_for_real_over_gloo() -> None:
    """cuda's fd_all_reduce on two real CPU ranks (gloo): the same paddle call NCCL gets,
    summed for real. Not on a GPU."""
    from device_workers import all_reduce_on_rank
    from fd_core.runtime.ranks.spawn import spawn_ranks

    results = spawn_ranks(all_reduce_on_rank, ("fd_plugins.cuda.platform",), 2, "gloo")
    assert [r["sum"] for r in results] == [[3.0, 6.0, 9.0]] * 2 and all(r["same_object"] for r in results)


def test_a_wrong_keyword_to_paddle_fails_the_recorded_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation the recorders exist to catch: `use_calc_stream` is not a parameter of dist.all_reduce."""
    log: list = []
    substitute(monkeypatch, dist, "all_reduce", log)

    def mutated(tensor, group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, sync_op=True, use_calc_stream=True)
        return tensor

    with pytest.raises(TypeError, match="use_calc_stream"):
        mutated(paddle.ones([2]), None)


def _quantized(rows: int, columns: int, bits: int) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    from fd_core.quantization import quantize

    weight = paddle.to_tensor(np.random.default_rng(3).standard_normal((rows, columns)).astype("float32"))
    values, scales = quantize(weight, bits)
    return weight, values, scales


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_weights_are_repacked_by_paddles_weight_quantize_then_served_by_weight_only_linear(
    monkeypatch: pytest.MonkeyPatch, bits: int
) -> None:
    """The device's compute capability and weight_only_linear are substituted (recorded, checked against the
    installed Paddle's signatures); weight_quantize runs for real (Paddle's CPU build has it). Not on a GPU."""
    from fd_core.quantization import dequantize
    from fd_plugins.cuda import quantized

    quantized.device_arch.cache_clear()
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda device=None: (8, 0))
    _, values, scales = _quantized(32, 128, bits)
    packed, packed_scales = quantized.prepare(values, scales, bits)
    # Paddle's own layout for arch 80: int8, [N, K] at 8 bits and [N / 2, K] at 4; one float16 scale per output.
    assert packed.dtype == paddle.int8 and packed_scales.dtype == paddle.float16
    assert list(packed.shape) == ([32, 128] if bits == 8 else [16, 128]) and list(packed_scales.shape) == [32]
    # Requantizing fd's dequantized weight keeps fd's scales (the same largest value per output channel).
    np.testing.assert_allclose(packed_scales.astype("float32").numpy(), scales.numpy(), rtol=1e-3)
    log: list = []
    out = paddle.zeros([2, 32], dtype="float16")
    substitute(monkeypatch, paddle.nn.quant, "weight_only_linear", log, result=out)
    x = paddle.ones([2, 128], dtype="float32")
    got = quantized.quant_matmul(x, packed, packed_scales, bits)
    assert got.dtype == paddle.float32 and list(got.shape) == [2, 32]  # a float32 run's dtype, back from float16
    [(name, args, kwargs)] = log
    assert name == "weight_only_linear" and args[1] is packed and args[0].dtype == paddle.float16
    assert kwargs["weight_dtype"] == ("int8" if bits == 8 else "int4") and kwargs["arch"] == 80
    assert kwargs["weight_scale"].dtype == paddle.float16
    # A shape the weight-only kernels do not tile stays in fd's form and is served by the native product.
    _, odd, odd_scales = _quantized(24, 100, bits)
    kept = quantized.prepare(odd, odd_scales, bits)
    assert kept[0] is odd and kept[1] is odd_scales
    x = paddle.ones([1, 100])
    want = paddle.matmul(x, dequantize(odd, odd_scales, bits, 100), transpose_y=True)
    np.testing.assert_allclose(quantized.quant_matmul(x, odd, odd_scales, bits).numpy(), want.numpy(), rtol=1e-5)
    assert len(log) == 1  # weight_only_linear was not called for it
    quantized.device_arch.cache_clear()


@pytest.mark.parametrize("bits", [8, 4])
def test_weights_in_groups_keep_their_groups_through_weight_quantize_and_weight_only_linear(
    monkeypatch: pytest.MonkeyPatch, bits: int
) -> None:
    """Contract 1.6's groups: 64 and 128 are repacked in the same groups (weight_quantize runs for real; its scales are
    fd's) and weight_only_linear is told the group size; groups of 32 stay in fd's form. The capability and
    weight_only_linear are substituted (recorded, checked against the installed Paddle's signatures). Not on a GPU."""
    from fd_core.quantization import quantize
    from fd_plugins.cuda import quantized

    quantized.device_arch.cache_clear()
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda device=None: (8, 0))
    weight = paddle.to_tensor(np.random.default_rng(3).standard_normal((32, 256)).astype("float32"))
    for group in (64, 128):
        values, scales = quantize(weight, bits, group=group)
        packed, packed_scales = quantized.prepare(values, scales, bits)
        assert list(packed_scales.shape) == [256 // group, 32]
        np.testing.assert_allclose(packed_scales.astype("float32").numpy(), scales.numpy().T, rtol=1e-3)
        log: list = []
        substitute(monkeypatch, paddle.nn.quant, "weight_only_linear", log, result=paddle.zeros([2, 32], "float16"))
        quantized.quant_matmul(paddle.ones([2, 256]), packed, packed_scales, bits)
        [(_, _, kwargs)] = log
        assert kwargs["group_size"] == group
    values, scales = quantize(weight, bits, group=32)
    kept = quantized.prepare(values, scales, bits)
    assert kept[0] is values and kept[1] is scales
    quantized.device_arch.cache_clear()


def test_an_odd_k_at_four_bits_is_repacked_with_its_padding_and_the_activations_padded_to_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """K = 127: fd's 4-bit form pads it to 128, which weight_quantize tiles. The capability and weight_only_linear
    are substituted and recorded; does not run on a GPU."""
    from fd_plugins.cuda import quantized

    quantized.device_arch.cache_clear()
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda device=None: (8, 0))
    _, values, scales = _quantized(32, 127, 4)
    packed, packed_scales = quantized.prepare(values, scales, 4)
    assert list(packed.shape) == [16, 128] and packed_scales.dtype == paddle.float16
    log: list = []
    substitute(monkeypatch, paddle.nn.quant, "weight_only_linear", log, result=paddle.zeros([3, 32], dtype="float16"))
    quantized.quant_matmul(paddle.ones([3, 127], dtype="float16"), packed, packed_scales, 4)
    [(_, args, _)] = log
    assert list(args[0].shape) == [3, 128] and not args[0].astype("float32")[:, 127].numpy().any()
    quantized.device_arch.cache_clear()


def test_an_architecture_without_weight_only_kernels_keeps_fds_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compute capability is substituted (6.1: no weight-only kernel in Paddle). Not on a GPU."""
    from fd_plugins.cuda import quantized

    quantized.device_arch.cache_clear()
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda device=None: (6, 1))
    _, values, scales = _quantized(32, 128, 8)
    kept = quantized.prepare(values, scales, 8)
    assert kept[0] is values and kept[1] is scales
    quantized.device_arch.cache_clear()
