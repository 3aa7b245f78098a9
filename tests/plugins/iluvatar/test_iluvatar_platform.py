"""The iluvatar platform on a machine without Iluvatar GPUs: checked against the installed Paddle's real API,
and with its device calls substituted and recorded. None of these tests runs on Iluvatar hardware."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import paddle
import paddle.distributed as dist
import pytest

from fakedist import run_fd
from fd_core import DeviceMemory, ModelConfig, ParallelConfig
from fd_core.host.backend import load_backend
from fd_core.testing import Capabilities, PlatformSuite
from fd_plugins.iluvatar import platform as iluvatar
from recording import substitute

# What detection says on this machine (Paddle's CPU build, no Iluvatar plugin).
NOT_INSTALLED = (
    f"paddle-iluvatar-gpu is not installed and paddle is the CPU build (paddlepaddle {paddle.__version__}): "
    "Iluvatar GPUs need Paddle's CPU build (paddlepaddle) plus its paddle-iluvatar-gpu custom-device plugin, see docs/install.md"
)


class TestIluvatarPlatform(PlatformSuite):
    """The conformance suite: contract checks run; device checks skip (no Iluvatar device). Not on hardware."""

    @pytest.fixture
    def platform_name(self) -> str:
        return "iluvatar"

    @pytest.fixture
    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=("float32", "float16", "bfloat16"))


def test_stream_all_reduce_takes_use_calc_stream_and_sync_op() -> None:
    """The installed Paddle's real signature; does not run on Iluvatar hardware."""
    params = inspect.signature(dist.stream.all_reduce).parameters
    assert {"tensor", "op", "group", "sync_op", "use_calc_stream"} <= set(params)
    assert callable(paddle.is_compiled_with_custom_device) and callable(paddle.device.get_available_custom_device)


def test_all_reduce_runs_on_the_calc_stream_synchronously(monkeypatch: pytest.MonkeyPatch) -> None:
    """Substituted paddle.distributed.stream.all_reduce, recorded; does not run on Iluvatar hardware."""
    log: list = []
    substitute(monkeypatch, dist.stream, "all_reduce", log)
    tensor, group = paddle.ones([8]), object()
    assert iluvatar.fd_all_reduce(tensor, group) is tensor
    (name, args, kwargs), = log
    assert args == (tensor,)
    assert kwargs == {"op": dist.ReduceOp.SUM, "group": group, "sync_op": True, "use_calc_stream": True}


@pytest.mark.parametrize(
    ("architecture", "tp", "allowed"),
    [("ernie4_5_vl", 2, False), ("ernie4_5_vl", 4, False), ("ernie4_5_vl", 1, True), ("ernie4_5", 2, True),
     ("qwen3_vl", 2, True)],
)
def test_veto_fires_for_ernie_vl_only_above_one_rank(architecture: str, tp: int, allowed: bool) -> None:
    vote = iluvatar.fd_graph_eligibility(ModelConfig(architecture=architecture), ParallelConfig(tp_size=tp),
                                         "cuda_graph")
    assert vote.allow is allowed
    if not allowed:
        assert vote.reason == f"ERNIE-4.5-VL (Ernie4_5_VLMoeForConditionalGeneration) with tp={tp} fails under CUDA graph capture on Iluvatar"


def test_the_backend_decision_carries_the_veto_and_its_reason() -> None:
    """Forced platform without its hardware: the decision is computed, nothing runs on a device."""
    backend = load_backend(ParallelConfig(tp_size=2), env={"FD_PLATFORM": "iluvatar"})
    decision = backend.graph_decision(ModelConfig(architecture="ernie4_5_vl"))
    assert not decision.allowed
    assert decision.summary() == "cuda_graph off: iluvatar vetoed: ERNIE-4.5-VL (Ernie4_5_VLMoeForConditionalGeneration) with tp=2 fails under CUDA graph capture on Iluvatar"
    assert backend.all_reduce_binding == "direct: iluvatar.fd_all_reduce"


def test_fd_explain_shows_the_veto_for_the_registered_architecture() -> None:
    done = run_fd(["explain", "--model", "ernie4_5_vl", "--tp", "2"], env={"FD_PLATFORM": "iluvatar"})
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # the report wraps at 100 columns
    assert f"platform: iluvatar (forced by FD_PLATFORM=iluvatar; its hardware is not detected here: {NOT_INSTALLED})" in text
    assert "model: ernie4_5_vl (registered by ernie4_5_vl), tp=2" in text
    assert "graph: cuda_graph off: iluvatar vetoed: ERNIE-4.5-VL (Ernie4_5_VLMoeForConditionalGeneration) with tp=2 fails under CUDA graph capture on Iluvatar" in text


def test_cleanup_frees_the_state_dict_then_empties_the_custom_device_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device-generic cache call (not the CUDA one, a no-op on custom devices) substituted and
    recorded; not on Iluvatar hardware."""
    from paddle.device import custom_device

    log: list = []
    substitute(monkeypatch, custom_device, "empty_cache", log, None)
    substitute(monkeypatch, paddle.device, "synchronize", log, None)
    # must not be called
    substitute(monkeypatch, paddle.device.cuda, "empty_cache", log, None, label="cuda.empty_cache")
    state = {"w": paddle.ones([4])}
    iluvatar.fd_clean_memory_fragments(state)
    iluvatar.fd_clean_memory_fragments(None)
    staged = {"w": np.ones(4, dtype=np.float32)}  # what the runner passes after seeded weights
    iluvatar.fd_clean_memory_fragments(staged)
    assert state == {} and staged == {}
    assert [n for n, _, _ in log] == ["empty_cache", "synchronize"] * 3  # never cuda.empty_cache


def test_all_reduce_reaches_paddles_process_group_with_the_calc_stream_flags() -> None:
    """iluvatar's fd_all_reduce on two real CPU ranks: the call reaches Paddle's process group, which on gloo
    refuses exactly the calc-stream mode the plugin asks for (XCCL takes it). Not on Iluvatar hardware."""
    from device_workers import all_reduce_on_rank
    from fd_core.runtime.ranks.spawn import spawn_ranks

    results = spawn_ranks(all_reduce_on_rank, ("fd_plugins.iluvatar.platform",), 2, "gloo")
    for result in results:
        assert "does not support all_reduce with sync_op and use_calc_stream flag" in result["error"]


def test_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The custom-device queries are substituted; does not run on Iluvatar hardware."""
    assert iluvatar.fd_platform_detect().reason == NOT_INSTALLED  # this machine's real CPU build
    monkeypatch.setattr(iluvatar, "installed", lambda name: {"paddle-iluvatar-gpu": "3.3.0"}.get(name))
    monkeypatch.setattr(paddle, "is_compiled_with_custom_device", lambda kind: False)
    assert iluvatar.fd_platform_detect().reason == (
        f"paddle is the CPU build (paddlepaddle {paddle.__version__}) but did not load paddle-iluvatar-gpu 3.3.0 "
        "(is_compiled_with_custom_device('iluvatar_gpu') is False): install the paddle-iluvatar-gpu release made for "
        "this paddle, see docs/install.md"
    )
    monkeypatch.setattr(paddle, "is_compiled_with_custom_device", lambda kind: kind == "iluvatar_gpu")
    monkeypatch.setattr(paddle.device, "get_available_custom_device", lambda: ["iluvatar_gpu:0", "iluvatar_gpu:1"])
    from paddle.device import custom_device

    log: list = []
    substitute(monkeypatch, custom_device, "get_device_properties", log, SimpleNamespace(total_memory=32 * 2**30))
    substitute(monkeypatch, custom_device, "memory_reserved", log, 0)
    answer = iluvatar.fd_platform_detect()
    assert answer.detected and answer.priority == 20 and answer.max_ranks == 2 and answer.device == "iluvatar_gpu"
    # Each device's memory, through the device-generic custom_device API, named as the rank's device.
    assert answer.device_memory == (DeviceMemory(total=32 * 2**30, free=32 * 2**30),) * 2
    assert [(name, args) for name, args, _ in log] == [
        ("get_device_properties", ("iluvatar_gpu:0",)), ("memory_reserved", ("iluvatar_gpu:0",)),
        ("get_device_properties", ("iluvatar_gpu:1",)), ("memory_reserved", ("iluvatar_gpu:1",)),
    ]
