"""Continuous batching: sequences admitted into a running batch at step boundaries and retired when they end or
are cancelled, each getting exactly what it gets alone; and the Python API from many threads at tp=1 and tp=2
(submit, cancel, a break out of a stream, a script that forgets close())."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from fd_core.errors import ConfigError
from fd_core.host.loading import PluginSet, load_plugins
from fd_core.runtime import LLM, SamplingParams
from fd_core.runtime.engine.loop import Completion, Engine, Job
from fd_core.runtime.memory import MemoryPlan
from fd_core.runtime.request import Request
from kit import text_checkpoint

# Unequal lengths (so prefills that take several are padded) and unequal limits (so sequences end at different steps).
PROMPTS = [[1, 2, 3 + i] + [7 + i] * (2 * i) for i in range(7)]
LIMITS = [6 + 3 * i for i in range(7)]
SAMPLED = SamplingParams(max_new_tokens=9, temperature=1.0, top_k=20, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def plugins() -> PluginSet:
    return load_plugins()


def _engine(plugins: PluginSet, model: str, graph: str, max_batch: int) -> Engine:
    from fd_core.host.backend import Backend
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for

    arch = plugins.registry.get(model)
    runner = ModelRunner(Backend(plugins), arch, model_config_for(arch, None), graph=graph)
    runner.load()
    runner.decide()
    # A pool of 12 blocks of 16: enough for the tests' batches, small enough that freed blocks are reused.
    memory = MemoryPlan(1.0, runner.config.dtype, 1, 0, 1, block_size=16, blocks=12, blocks_from="the test")
    return Engine(runner, max_batch=max_batch, memory=memory)


def _job(i: int) -> Job:
    sampling = SAMPLED if i == 3 else SamplingParams(max_new_tokens=LIMITS[i], ignore_eos=True)
    return Job(i, tuple(PROMPTS[i]), sampling)


def _step(engine: Engine, done: dict[int, Completion], held: dict[int, set[int]]) -> None:
    """One step; what ended, and which keys each KV-cache block has held."""
    for event in engine.step():
        if event.done is not None:
            done[event.key] = event.done
    for key, blocks in engine.block_tables().items():
        for block in blocks:
            held.setdefault(block, set()).add(key)


@pytest.mark.parametrize(("model", "graph"), [("ernie4_5", "off"), ("ernie4_5", "on"), ("qwen3_vl", "off")])
def test_sequences_joining_a_running_batch_get_their_alone_tokens(plugins: PluginSet, model: str, graph: str) -> None:
    engine = _engine(plugins, model, graph, max_batch=4)
    alone = [
        engine.generate(Request((tuple(j.prompt),), j.sampling))[0].token_ids for j in map(_job, range(len(PROMPTS)))
    ]
    done: dict[int, Completion] = {}
    held: dict[int, set[int]] = {}
    # Two at once (one padded prefill), one more a step later (prefilled while they decode), two together, then two
    # that wait for the batch (and blocks) to free up.
    most = 0
    for arrivals in ([0, 1], [2], [], [3, 4], [5, 6], *[[]] * 40):
        for i in arrivals:
            engine.add(_job(i))
        _step(engine, done, held)
        most = max(most, len(engine.running))
    assert {k: c.token_ids for k, c in done.items()} == dict(enumerate(alone))
    assert most == 4 and engine.pending == 0, "the sequences were not decoding together"
    assert any(len(keys) > 1 for keys in held.values()), "no block was reused after its sequence ended"
    assert all(c.finish_reason == "length" for c in done.values())


def test_a_cancelled_sequence_frees_its_slot_and_the_others_go_on(plugins: PluginSet) -> None:
    engine = _engine(plugins, "ernie4_5", "off", max_batch=2)
    long, other, later = (Job(k, tuple(PROMPTS[i]), SamplingParams(max_new_tokens=n, ignore_eos=True))
                          for k, i, n in ((0, 0, 30), (1, 2, 12), (2, 4, 8)))
    alone = {j.key: engine.generate(Request((j.prompt,), j.sampling))[0].token_ids for j in (long, other, later)}
    done: dict[int, Completion] = {}
    held: dict[int, set[int]] = {}
    engine.add(long)
    engine.add(other)
    for _ in range(3):
        _step(engine, done, held)
    engine.cancel(long.key)
    engine.add(later)  # waits for the batch (max 2): both places are taken until the cancel retires one
    _step(engine, done, held)
    cut = done[long.key]
    assert (cut.finish_reason == "cancelled" and 0 < len(cut.token_ids) < 30
            and cut.token_ids == alone[long.key][: len(cut.token_ids)])
    assert engine.running == [other.key, later.key], "the cancelled sequence's place did not go to the waiting one"
    while engine.pending:
        _step(engine, done, held)
    assert done[other.key].token_ids == alone[other.key] and done[later.key].token_ids == alone[later.key]


def test_a_prompt_with_a_picture_joins_a_running_batch(plugins: PluginSet) -> None:
    import numpy as np

    engine = _engine(plugins, "qwen3_vl", "off", max_batch=4)
    config = engine.runner.config
    picture = np.random.default_rng(0).random((3, 64, 64), dtype=np.float32)
    count = engine.runner.arch.image_tokens(config, picture.shape)  # type: ignore[misc]
    with_picture = (1, 2, *[int(config.extra["image_token_id"])] * count, 5, 6)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    jobs = [Job(0, (1, 2, 3, 4), params), Job(1, with_picture, params, (), (picture,)), Job(2, (9, 8, 7), params)]
    alone = [engine.generate(Request((j.prompt,), j.sampling, (), j.images))[0].token_ids for j in jobs]
    done: dict[int, Completion] = {}
    for job in jobs:  # one a step: the picture's prompt is prefilled while the first decodes, its rotary delta its own
        engine.add(job)
        _step(engine, done, {})
    assert len(engine.running) == 3
    while engine.pending:
        _step(engine, done, {})
    assert [done[j.key].token_ids for j in jobs] == alone


# -- the Python API ---------------------------------------------------------------------------
TEXTS = ["Hello world", "The quick brown fox", "Привет", "Numbers 12345 and more", "a", "Café crème", "zz top",
         "one two three four"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_checkpoint(tmp_path_factory.mktemp("continuous") / "ernie4_5", "ernie4_5")


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def llm(request: pytest.FixtureRequest, checkpoint: Path) -> Iterator[LLM]:
    with LLM(checkpoint, tp=request.param, graph="off", max_batch=4) as session:
        yield session


def _until(condition: Any, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_eight_threads_each_get_their_sequential_output(llm: LLM) -> None:
    params = [SamplingParams(max_new_tokens=4 + 2 * i, ignore_eos=True) for i in range(len(TEXTS))]
    sequential = [llm.generate(t, p)[0] for t, p in zip(TEXTS, params, strict=True)]
    got: dict[int, Any] = {}
    barrier = threading.Barrier(len(TEXTS))

    def run(i: int) -> None:
        barrier.wait()
        if i % 2:
            got[i] = "".join(llm.stream(TEXTS[i], params[i]))
        else:
            got[i] = llm.generate(TEXTS[i], params[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(TEXTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [got[i] if i % 2 else got[i].token_ids for i in range(len(TEXTS))] == [
        c.text if i % 2 else c.token_ids for i, c in enumerate(sequential)]
    assert llm.queued() == 0


def test_a_request_submitted_while_another_runs_joins_it(llm: LLM) -> None:
    long_params, short_params = (SamplingParams(max_new_tokens=48, ignore_eos=True),
                                 SamplingParams(max_new_tokens=3, ignore_eos=True))
    alone_long, alone_short = llm.generate(TEXTS[1], long_params)[0], llm.generate(TEXTS[3], short_params)[0]
    long = llm.submit(TEXTS[1], long_params)
    assert _until(lambda: long.first_token_at is not None)
    short = llm.submit(TEXTS[3], short_params)
    assert short.result(60).token_ids == alone_short.token_ids
    assert not long.done, "the short request waited for the long one instead of joining it"
    assert long.result(60).token_ids == alone_long.token_ids and long.prompt_tokens == len(alone_long.prompt_ids)


def test_cancel_mid_stream_ends_it_and_the_others_go_on(llm: LLM) -> None:
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    other_params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    alone = llm.generate(TEXTS[0], other_params)[0]
    doomed, other = llm.submit(TEXTS[2], params), llm.submit(TEXTS[0], other_params)
    pieces = iter(doomed)
    next(pieces)
    doomed.cancel()
    list(pieces)  # ends (does not hang)
    cut = doomed.result(10)
    assert cut.finish_reason == "cancelled" and len(cut.token_ids) < 64
    assert other.result(60).token_ids == alone.token_ids
    assert _until(lambda: llm.queued() == 0)


def test_a_break_out_of_a_stream_cancels_it_and_generate_gets_its_own(llm: LLM) -> None:
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    want = llm.generate(TEXTS[5], SamplingParams(max_new_tokens=6))[0]
    full = llm.generate(TEXTS[6], params)[0].text
    half = llm.stream(TEXTS[6], params)
    first = next(half)
    # A generate() while a stream is half read gets its own tokens; the stream then goes on with its own.
    assert llm.generate(TEXTS[5], SamplingParams(max_new_tokens=6))[0].token_ids == want.token_ids
    assert first + "".join(half) == full
    for _ in llm.stream(TEXTS[6], SamplingParams(max_new_tokens=200, ignore_eos=True)):
        break
    # The break cancelled the stream before this generate was queued: nothing is left when it returns.
    assert llm.generate(TEXTS[5], SamplingParams(max_new_tokens=6))[0].token_ids == want.token_ids
    assert llm.queued() == 0, "the abandoned stream kept its slot"


def test_a_bad_request_is_refused_by_submit_before_it_queues(llm: LLM) -> None:
    with pytest.raises(ConfigError, match="exceed the model's context"):
        llm.submit(TEXTS[0], SamplingParams(max_new_tokens=10**6))
    assert llm.queued() == 0


def test_chat_messages_are_rendered_through_the_template(llm: LLM) -> None:
    params = SamplingParams(max_new_tokens=6)
    submitted = llm.submit([{"role": "user", "content": TEXTS[1]}], params).result(60)
    assert submitted.token_ids == llm.generate(TEXTS[1], params, chat=True)[0].token_ids
    with pytest.raises(ConfigError, match="message 1 must be a mapping with a 'role'"):
        llm.submit([{"content": "no role"}], params)


def test_a_script_that_forgets_close_exits_promptly(checkpoint: Path, tmp_path: Path) -> None:
    script = tmp_path / "forgets.py"
    script.write_text(textwrap.dedent(f"""
        from fd_core.runtime import LLM, SamplingParams

        if __name__ == "__main__":
            llm = LLM({str(checkpoint)!r}, tp=2, graph="off")
            print(*llm._session.pids, flush=True)
            stream = llm.stream("Hello", SamplingParams(max_new_tokens=200, ignore_eos=True))
            next(stream)  # left half read
            print(llm.generate("Hello", SamplingParams(max_new_tokens=2))[0].finish_reason, flush=True)
    """))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        pids = [int(p) for p in process.stdout.readline().split()]
        last = process.stdout.readline().strip()
        ended = time.monotonic()  # its last line: the script is done, and only its exit is left
        code = process.wait(60)
    finally:
        process.kill()
    took = time.monotonic() - ended
    assert code == 0 and last == "length", process.stderr.read() if process.stderr else ""
    assert took < 15, f"the script took {took:.1f} s to exit after its last line"
    assert len(pids) == 2 and _until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 5), (
        "ranks left running")


def test_an_exception_in_the_with_block_stops_the_ranks_and_fails_what_runs(checkpoint: Path) -> None:
    from fd_core.errors import RankError

    with pytest.raises(ValueError, match="the caller's own"):
        with LLM(checkpoint, tp=2, graph="off") as llm:
            pids = list(llm._session.pids)  # type: ignore[union-attr]
            running = llm.submit(TEXTS[0], SamplingParams(max_new_tokens=400, ignore_eos=True))
            assert _until(lambda: running.first_token_at is not None)
            raise ValueError("the caller's own")
    with pytest.raises(RankError, match="the ranks were stopped"):
        running.result(10)
    assert _until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 5), "ranks left running"


def test_a_rank_that_dies_between_requests_is_seen_without_a_request(checkpoint: Path) -> None:
    """No step runs while the LLM is idle: `error` must still report a rank that died then (fd
    serve's idle watch reads it)."""
    import os
    import signal

    from fd_core.errors import RankError

    with LLM(checkpoint, tp=2, graph="off") as llm:
        pids = list(llm._session.pids)  # type: ignore[union-attr]
        assert llm.error is None
        os.kill(pids[1], signal.SIGKILL)
        assert _until(lambda: llm.error is not None, 30), "the dead rank was not reported"
        assert isinstance(llm.error, RankError) and "rank 1" in str(llm.error)
        with pytest.raises(RankError, match="ranks failed earlier"):
            llm.submit(TEXTS[0])
    assert _until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 5), "ranks left running"
