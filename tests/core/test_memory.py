"""Device memory: what a platform reports (per device), one rank's share of the weights against it, the KV-cache
capacity that is left at --memory-fraction, and the engine keeping each batch's cache within it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakedist import run_fd
from fd_core import Detection, DeviceMemory, ModelConfig
from fd_core.errors import SETTINGS_STYLE_ENV, ConfigError
from fd_core.runtime.memory import DEFAULT_MAX_PREFILL_TOKENS, MemoryPlan, plan_memory, scratch_bytes
from fd_plugins.cpu.memory import cgroup_limit, host_memory

GiB = 2**30

# Qwen2-7B's sizes, about 14.2 GiB of bfloat16 weights: refused on one 16 GiB device at tp=1 is right; at tp=2 each rank
# holds half.
BIG = ModelConfig(architecture="big", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
                  tie_word_embeddings=False, dtype="bfloat16")


def devices(*free_gib: float, total: float = 16) -> Detection:
    return Detection(detected=True, device_memory=tuple(DeviceMemory(total=int(total * GiB), free=int(f * GiB))
                                                        for f in free_gib))


def test_each_rank_is_checked_for_its_share_of_the_weights_not_the_whole_model() -> None:
    whole = BIG.weight_bytes_per_rank(1)
    assert 14 * GiB < whole < 15 * GiB
    assert BIG.weight_bytes_per_rank(2) < whole / 2 + 2**20  # half, plus the replicated norms
    with pytest.raises(ConfigError, match=r"^big needs about 14\.\d\d GiB of weights per rank \(bfloat16, tp=1\), and device 0 of platform "
                       r"'chip' has 15\.00 GiB free of 16\.00 GiB, of which --memory-fraction 0\.9 allows 13\.50 GiB; use a larger --tp"):
        plan_memory(BIG, 1, devices(15, 15), 0.9, "chip", "big", ranks_here=1)
    plan = plan_memory(BIG, 2, devices(15, 15), 0.9, "chip", "big", ranks_here=2)
    scratch = scratch_bytes(BIG, 2, DEFAULT_MAX_PREFILL_TOKENS, 8)
    room = int(15 * GiB * 0.9) - BIG.weight_bytes_per_rank(2) - scratch
    assert plan.capacity_tokens == room // BIG.cache_bytes_per_token(2) and plan.ranks_per_device == 1
    # The pool: what the room holds in blocks of 16 (less than 8 sequences of the 32768-token context would use).
    assert plan.scratch_bytes == scratch and 0 < scratch < 2 * GiB
    assert (plan.block_size, plan.blocks, plan.blocks_bound) == (16, plan.capacity_tokens // 16, "memory")
    # A token's cache on one rank: keys and values of every layer for its share of the kv heads.
    assert BIG.cache_bytes_per_token(2) == 2 * 28 * (4 // 2) * 128 * 2


def test_the_device_with_least_free_memory_binds_and_ranks_on_one_device_share_it() -> None:
    plan = plan_memory(BIG, 2, devices(15, 9), 0.9, "chip", "big", ranks_here=2)
    assert plan.device == 1 and plan.device_free == 9 * GiB
    with pytest.raises(ConfigError, match=r"^big needs about 7\.\d\d GiB of weights per rank \(bfloat16, tp=2\), and device 1 "):
        plan_memory(BIG, 2, devices(15, 7), 0.9, "chip", "big", ranks_here=2)
    # A host platform's one device, shared by both ranks: twice the weights, twice the cost of a token.
    shared = plan_memory(BIG, 2, devices(20, total=20), 1.0, "chip", "big", ranks_here=2)
    assert shared.ranks_per_device == 2
    scratch = scratch_bytes(BIG, 2, DEFAULT_MAX_PREFILL_TOKENS, 8)
    assert shared.capacity_tokens == (20 * GiB - 2 * (BIG.weight_bytes_per_rank(2) + scratch)) // (2 * BIG.cache_bytes_per_token(2))
    # The older host-wide memory_bytes is read as such a shared device; no report sizes nothing and refuses nothing.
    old = plan_memory(BIG, 2, Detection(detected=True, memory_bytes=20 * GiB), 1.0, "chip", "big", ranks_here=2)
    assert old.capacity_tokens == shared.capacity_tokens
    unknown = plan_memory(BIG, 1, Detection(detected=True), 0.9, "chip", "big")
    # No report: the pool is what 8 sequences of the whole context could use, and nothing is refused for memory.
    assert unknown.capacity_tokens is None and unknown.blocks == 8 * 32768 // 16 and unknown.blocks_bound == "batch"
    assert unknown.summary().endswith("the platform reports no device memory")


@pytest.fixture(autouse=True)
def flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks here pin what `fd run` and `fd explain` print, which names flags (fd_core.errors.setting)."""
    monkeypatch.setenv(SETTINGS_STYLE_ENV, "cli")


def test_a_python_caller_is_told_the_keyword_it_passed_not_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SETTINGS_STYLE_ENV)
    with pytest.raises(ConfigError, match=r"^LLM\(memory_fraction=\.\.\.\) must be a number in \(0, 1\]"):
        plan_memory(BIG, 2, devices(15, 15), 0, "chip", "big")
    with pytest.raises(ConfigError, match=r"use a larger LLM\(tp=\.\.\.\), a higher LLM\(memory_fraction=\.\.\.\) or a smaller model$"):
        plan_memory(BIG, 1, devices(15), 0.9, "chip", "big")


def test_the_fraction_scales_the_capacity_and_is_checked() -> None:
    small, large = (plan_memory(BIG, 2, devices(15, 15), f, "chip", "big", ranks_here=2) for f in (0.8, 1.0))
    assert small.capacity_tokens < large.capacity_tokens
    for bad in (0, -0.1, 1.01, float("nan"), True):
        with pytest.raises(ConfigError, match=r"^--memory-fraction must be a number in \(0, 1\]"):
            plan_memory(BIG, 2, devices(15, 15), bad, "chip", "big")


def test_a_request_that_could_never_fit_the_pool_is_refused_naming_what_bounds_it() -> None:
    plan = MemoryPlan(0.9, "float32", 1, 0, 256, 0, 10, 10, 1, capacity_tokens=100, block_size=16, blocks=6,
                      blocks_from="what --memory-fraction 0.9 leaves after the weights", blocks_bound="memory")
    with pytest.raises(ConfigError, match=r"^this request needs 7 KV-cache blocks of 16 positions \(its longest prompt, 10 tokens, and 100 new\), and m at tp=1 has 6 \(what --memory-fraction 0\.9 leaves after the weights; 4096 bytes a block per rank\); ask for fewer tokens, or raise --memory-fraction or --tp$"):
        plan.check_request([(1,) * 10], 100, 4096, "m")
    plan.check_request([(1,) * 10], 86, 4096, "m")  # 96 positions: 6 blocks
    capped = MemoryPlan(**{**plan.to_dict(), "blocks_bound": "kv_cache_blocks"})
    with pytest.raises(ConfigError, match=r"raise --kv-cache-blocks \(up to what --memory-fraction leaves\)$"):
        capped.check_request([(1,) * 10], 100, 4096, "m")


def test_the_pool_is_capped_by_the_user_the_platform_and_the_batch() -> None:
    free = devices(15, 15)
    assert plan_memory(BIG, 2, free, 0.9, "chip", "big", ranks_here=2, kv_cache_blocks=100).blocks == 100
    budget = Detection(detected=True, device_memory=free.device_memory, kv_cache_bytes=64 * 2**20)
    platform = plan_memory(BIG, 2, budget, 0.9, "chip", "big", ranks_here=2)
    assert (platform.blocks, platform.blocks_bound) == (64 * 2**20 // (16 * BIG.cache_bytes_per_token(2)), "platform")
    small = ModelConfig(**{**BIG.to_dict(), "max_position_embeddings": 64})
    batch = plan_memory(small, 2, free, 0.9, "chip", "big", ranks_here=2, max_batch=3, block_size=32)
    assert (batch.blocks, batch.block_size, batch.blocks_bound) == (6, 32, "batch")
    with pytest.raises(ConfigError, match=r"^--kv-cache-blocks 10000000 needs .* GiB on device 0, and --memory-fraction 0\.9 of its 15\.00 GiB free leaves room for \d+ blocks of 16 after the weights; ask for fewer$"):
        plan_memory(BIG, 2, free, 0.9, "chip", "big", ranks_here=2, kv_cache_blocks=10_000_000)
    with pytest.raises(ConfigError, match=r"^--kv-block-size must be a positive integer, got 0$"):
        plan_memory(BIG, 2, free, 0.9, "chip", "big", ranks_here=2, block_size=0)


def test_a_detection_with_a_malformed_memory_report_is_the_plugins_problem() -> None:
    assert Detection(detected=True, device_memory=(DeviceMemory(total=10, free=4),)).problem() is None
    assert "device_memory[0] has free=11 is more than total=10" in Detection(detected=True, device_memory=(DeviceMemory(10, 11),)).problem()
    assert "device_memory[0] has total='10'" in Detection(detected=True, device_memory=(DeviceMemory("10", 1),)).problem()  # type: ignore[arg-type]
    assert "expected a tuple of fd_core.DeviceMemory" in Detection(detected=True, device_memory=(10,)).problem()  # type: ignore[arg-type]


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


MEMINFO = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n"


def test_host_memory_is_meminfo_within_the_cgroup_limit(tmp_path: Path) -> None:
    """/proc and /sys/fs/cgroup as files under a fake root: cgroup v2 (this process's group), v1, and none."""
    v2 = write(tmp_path / "v2", {"proc/meminfo": MEMINFO, "proc/self/cgroup": "0::/job/fd\n",
                                 "sys/fs/cgroup/job/fd/memory.max": "4294967296\n",
                                 "sys/fs/cgroup/job/fd/memory.current": "1073741824\n"})
    assert host_memory(v2) == DeviceMemory(total=4 * GiB, free=3 * GiB)
    v1 = write(tmp_path / "v1", {"proc/meminfo": MEMINFO, "proc/self/cgroup": "4:memory:/process_api/abc\n1:cpu:/\n",
                                 "sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes": str(2 * GiB),
                                 "sys/fs/cgroup/memory/process_api/abc/memory.usage_in_bytes": str(GiB // 2),
                                 "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712"})
    assert cgroup_limit(v1) == (2 * GiB, GiB // 2)
    assert host_memory(v1) == DeviceMemory(total=2 * GiB, free=GiB + GiB // 2)
    unlimited = write(tmp_path / "none", {"proc/meminfo": MEMINFO, "proc/self/cgroup": "0::/\n",
                                          "sys/fs/cgroup/memory.max": "max\n"})
    assert host_memory(unlimited) == DeviceMemory(total=16000000 * 1024, free=8000000 * 1024)
    assert host_memory(tmp_path / "nothing") is None


def test_the_cpu_platform_reports_this_host_as_one_device() -> None:
    from fd_plugins.cpu import platform as cpu

    [host] = cpu.fd_platform_detect().device_memory
    total = int(open("/proc/meminfo").read().split("MemTotal:")[1].split()[0]) * 1024
    assert 0 < host.free <= host.total <= total


def test_fd_run_json_has_the_dtype_and_the_memory_plan_whose_weights_are_each_ranks_own() -> None:
    done = run_fd(["run", "--tp", "2", "--steps", "2", "--graph", "off", "--memory-fraction", "0.5", "--json"])
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["dtype"] == "float32"
    memory = result["memory"]
    assert (memory["fraction"], memory["tp"], memory["ranks_per_device"], memory["dtype"]) == (0.5, 2, 2, "float32")
    # The plan's estimate of a rank's weights is what each rank's parameters hold (ernie4_5's dense preset).
    assert result["weight_bytes_by_rank"] == [memory["weights_per_rank"]] * 2
    # Its cost of a token is what each rank's cache holds per position and sequence.
    assert all(kv % memory["cache_bytes_per_token"] == 0 and kv > 0 for kv in result["kv_cache_bytes_by_rank"])
    assert memory["capacity_tokens"] > 0 and memory["blocks"] > 0
    # Each rank's pool: the plan's blocks and the null block, every layer's keys and values.
    assert result["kv_cache_bytes_by_rank"] == [(memory["blocks"] + 1) * memory["block_size"] * memory["cache_bytes_per_token"]] * 2
    text = run_fd(["explain", "--memory-fraction", "0.5"])
    assert text.returncode == 0, text.stderr
    joined = " ".join(text.stdout.split())
    assert "dtype: float32" in joined
    assert "memory: weights 0.20 MiB per rank (tp=2, float32); KV cache " in joined
    assert "--memory-fraction 0.5 of " in joined and "free on device 0, shared by 2 ranks" in joined


def test_a_pool_too_small_for_the_batch_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four prompts that each need 2 blocks, in a pool of 4: two run at a time (the others wait, or are preempted and
    recomputed), and every prompt gets the tokens it gets with room for all."""
    from fd_core.runtime import LLM, SamplingParams

    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]
    params = SamplingParams(max_new_tokens=20)  # 22 to 24 positions: 2 blocks of 16 each
    with LLM(model="ernie4_5", tp=1, graph="off") as free:
        expected = [c.token_ids for c in free.generate(prompts, params)]
    with LLM(model="ernie4_5", tp=1, graph="off", kv_cache_blocks=4) as tight:
        got = [c.token_ids for c in tight.generate(prompts, params)]
        counts = tight.kv_cache
    assert got == expected
    assert counts["blocks_total"] == 4 and counts["blocks_used"] == 0


def test_fd_run_allocates_the_blocks_its_own_prompts_and_tokens_use() -> None:
    """fd run knows its whole job: its cache is the blocks its prompts and new tokens use (each sequence to its last
    token), not the memory plan's room; --kv-cache-blocks is kept as given; the tokens are those of a larger cache."""
    three = ["--prompt-ids", "1,2,3,4", "--prompt-ids", ",".join(["5"] * 20), "--prompt-ids", "9,8"]
    done = run_fd(["run", "--tp", "1", "--steps", "13", "--graph", "off", *three, "--json"])
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    memory = result["memory"]
    size = memory["block_size"]
    want = sum(-(-(n + 13) // size) for n in (4, 20, 2))
    assert (memory["blocks"], memory["blocks_bound"]) == (want, "job"), memory
    assert memory["blocks_from"] == "what its 3 prompt(s) and 13 new tokens each use"
    # The pool each rank allocated: those blocks and the null block.
    assert result["kv_cache_bytes_by_rank"] == [(want + 1) * size * memory["cache_bytes_per_token"]]
    given = run_fd(["run", "--tp", "1", "--steps", "13", "--graph", "off", *three, "--kv-cache-blocks", "40",
                    "--json"])
    assert given.returncode == 0, given.stderr
    assert json.loads(given.stdout)["memory"]["blocks"] == 40
    assert json.loads(given.stdout)["tokens"] == result["tokens"]
    # fd explain plans no job: the memory plan's own bound.
    explained = json.loads(run_fd(["explain", "--tp", "1", "--json"]).stdout)
    assert explained["memory"]["blocks"] > want and explained["memory"]["blocks_bound"] != "job"


def test_a_job_sized_cache_under_a_small_batch_with_shared_prefixes_gives_the_same_tokens() -> None:
    """Five prompts sharing a 20-token prefix, two decoded at a time (--max-batch 2): with the cache sized to the job
    (prefix-cache hits, sequences admitted as others end) each prompt's tokens equal those of a 64-block cache."""
    prefix = ",".join(str(t) for t in range(10, 30))
    prompts = [arg for i in range(5) for arg in ("--prompt-ids", f"{prefix},{40 + i},{50 + i}")]
    base = ["run", "--tp", "1", "--steps", "9", "--graph", "off", "--max-batch", "2", *prompts, "--json"]
    sized, roomy = run_fd(base), run_fd([*base, "--kv-cache-blocks", "64"])
    assert sized.returncode == 0 and roomy.returncode == 0, sized.stderr + roomy.stderr
    job, big = json.loads(sized.stdout), json.loads(roomy.stdout)
    assert job["memory"]["blocks_bound"] == "job" and job["memory"]["blocks"] < 64
    assert [o["ids"] for o in job["outputs"]] == [o["ids"] for o in big["outputs"]]
