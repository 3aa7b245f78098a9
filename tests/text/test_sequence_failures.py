"""One sequence's failure is its own (issue 44): what fails while the engine handles one sequence (its grammar, a
kernel error confined to its rows) ends that sequence with its own error, and every other sequence of the same steps
gets exactly the tokens it gets alone. Grammars the model's tokens cannot follow are refused when the request is
built, before any rank works on them, and so is one past its compile budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from fd_core.errors import SequenceError
from fd_core.host.loading import PluginSet, load_plugins
from fd_core.runtime import LLM, SamplingParams
from fd_core.runtime.engine.loop import Completion, Engine, Job
from fd_core.runtime.memory import MemoryPlan
from tiny_engine import run_jobs

pytest.importorskip("llguidance", reason="structured output needs llguidance: pip install -e '.[test]'")

from fd_core.runtime.text.grammar import GrammarError, constraint_spec  # noqa: E402

# A schema whose references never bottom out (a -> b -> a): llguidance compiles it, and its first mask fails.
LOOPING = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}
NO_MATCH = r"[^\s\S]"  # a character class nothing is in
CATASTROPHIC = r"(a{1000}){1000}"  # seconds to build its lexer's first state
PROMPTS = [(1, 2, 3, 4), (9, 8, 7), (5, 6, 7, 8, 9, 10)]
MAGIC_PENALTY = 1.75  # the presence penalty the broken penalties kernel below fails on


@pytest.fixture(scope="module")
def plugins() -> PluginSet:
    return load_plugins()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fd_core.serve.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("failures") / "tiny")


def _engine(plugins: PluginSet, checkpoint: Path) -> Engine:
    """The tiny ERNIE-4.5 preset with the tiny tokenizer (as tests/text/test_continuous_batching.py builds one)."""
    from fd_core.host.backend import Backend
    from fd_core.runtime import load_tokenizer
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for

    arch = plugins.registry.get("ernie4_5")
    runner = ModelRunner(Backend(plugins), arch, model_config_for(arch, None), graph="off")
    runner.load()
    runner.decide()
    memory = MemoryPlan(1.0, runner.config.dtype, 1, 0, 1, block_size=16, blocks=24, blocks_from="the test")
    return Engine(runner, tokenizer=load_tokenizer(checkpoint), max_batch=8, memory=memory)


def _bystanders() -> list[Job]:
    """Greedy and sampled sequences that must not notice a neighbour's failure."""
    sampled = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=20, seed=4, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=10, ignore_eos=True)
    return [Job(i, p, sampled if i == 1 else greedy, index=i) for i, p in enumerate(PROMPTS)]


def test_a_grammar_that_fails_in_the_step_ends_its_sequence_alone(plugins: PluginSet, checkpoint: Path) -> None:
    engine = _engine(plugins, checkpoint)
    alone = {job.key: run_jobs(engine, [job])[job.key].token_ids for job in _bystanders()}
    # Past the request checks (which would refuse it), as a grammar failing mid-run reaches the engine.
    broken = Job(10, (4, 5, 6), SamplingParams(max_new_tokens=10, grammar=constraint_spec(LOOPING)))
    done = run_jobs(engine, [*_bystanders()[:2], broken, _bystanders()[2]])
    assert {key: done[key].token_ids for key in alone} == alone
    assert all(done[key].finish_reason == "length" for key in alone)
    failed = done[10]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert failed.failure is not None and failed.failure.request
    message = failed.failure.message
    assert "\n" not in message and "admits no output" in message and "NoExtensionBias" not in message
    assert engine.pending == 0 and engine.pool.used == 0  # its blocks went back with everyone else's


def test_a_kernel_error_confined_to_one_row_ends_that_sequence_alone(plugins: PluginSet, checkpoint: Path) -> None:
    """The apply_penalties kernel is substituted by one that fails on a row whose presence penalty is MAGIC_PENALTY
    (a plausibly broken vendor kernel); the engine retries the rows alone and ends only that sequence."""
    engine = _engine(plugins, checkpoint)
    penalized = SamplingParams(max_new_tokens=6, ignore_eos=True, presence_penalty=0.5)
    jobs = [Job(0, PROMPTS[0], penalized), Job(1, PROMPTS[1], penalized)]
    alone = {job.key: run_jobs(engine, [job])[job.key].token_ids for job in jobs}
    ops = engine.runner.backend.ops
    native = ops.apply_penalties

    def broken(logits: Any, seen: Any, counts: Any, presence: Any, frequency: Any, repetition: Any) -> Any:
        if any(abs(float(p) - MAGIC_PENALTY) < 1e-6 for p in presence.numpy()):
            raise IndexError("kernel index out of range")
        return native(logits, seen, counts, presence, frequency, repetition)

    ops.apply_penalties = broken
    try:
        bad = Job(5, PROMPTS[2], SamplingParams(max_new_tokens=6, ignore_eos=True, presence_penalty=MAGIC_PENALTY))
        done = run_jobs(engine, [jobs[0], bad, jobs[1]])
    finally:
        ops.apply_penalties = native
    assert {key: done[key].token_ids for key in alone} == alone
    assert done[5].finish_reason == "error" and done[5].failure is not None
    assert done[5].failure.message == "IndexError: kernel index out of range" and not done[5].failure.request


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> Iterator[LLM]:
    with LLM(checkpoint, tp=1, graph="off") as session:
        yield session


@pytest.mark.parametrize(("what", "response_format", "regex"), [
    ("a $ref that loops", LOOPING, None), ("a regex that matches nothing", None, NO_MATCH)])
def test_a_grammar_that_admits_nothing_is_refused_with_the_request(
    llm: LLM, what: str, response_format: Any, regex: str | None
) -> None:
    grammar = constraint_spec(response_format, regex)  # compiles without the model's tokens
    with pytest.raises(GrammarError, match="admits no output at all") as refused:
        llm.submit("Hello", SamplingParams(max_new_tokens=4, grammar=grammar))
    assert "\n" not in str(refused.value)
    assert llm.generate("Hello", SamplingParams(max_new_tokens=3, ignore_eos=True))[0].finish_reason == "length"


def test_a_grammar_past_its_compile_budget_is_refused_with_the_request(checkpoint: Path) -> None:
    with LLM(checkpoint, tp=1, graph="off", grammar_timeout=0.05) as llm:
        with pytest.raises(GrammarError, match=r"past the budget of 0.05 s") as refused:
            llm.submit("Hello", SamplingParams(max_new_tokens=4, grammar=constraint_spec(None, CATASTROPHIC)))
        assert "\n" not in str(refused.value)
        # Kept compiled, the same grammar is still refused: the budget is its first compile's time.
        with pytest.raises(GrammarError, match="past the budget"):
            llm.submit("Hello", SamplingParams(max_new_tokens=4, grammar=constraint_spec(None, CATASTROPHIC)))
        ok = llm.generate("Hello", SamplingParams(max_new_tokens=4, grammar=constraint_spec(None, "(yes|no)!")))
        assert ok[0].text in ("yes!", "no!")


def test_an_error_completion_fails_its_own_submission() -> None:
    """The scheduler's side: an event ending a sequence with "error" fails that submission (result and iteration raise
    a SequenceError saying whose fault it was), and pickles across ranks as plain data."""
    import pickle

    from fd_core.runtime.engine.loop import Event, SequenceFailure
    from fd_core.runtime.engine.scheduler import Submission

    mine = Submission(0, 3, lambda key: None)
    event = Event(0, None, "", Completion([1, 2, 3], [], "", "error", failure=SequenceFailure("grammar: boom", True)))
    mine.deliver(pickle.loads(pickle.dumps(event)))
    with pytest.raises(SequenceError, match="grammar: boom") as raised:
        mine.result(timeout=1)
    assert raised.value.request_fault and pickle.loads(pickle.dumps(raised.value)).request_fault
    with pytest.raises(SequenceError):
        list(mine)


# -- fair shares: one request cannot hold the batch ------------------------------------------------------------------
def _first_token_step(engine: Engine, jobs: list[Job], late: list[Job], after: int) -> tuple[dict[int, int], dict]:
    """Run `jobs`, add `late` after `after` steps; each key's step of its first token, and every completion."""
    for job in jobs:
        engine.add(job)
    first: dict[int, int] = {}
    done: dict[int, Completion] = {}
    step = 0
    while engine.pending or late:
        if step == after:
            for job in late:
                engine.add(job)
            late = []
        for event in engine.step():
            if event.token is not None:
                first.setdefault(event.key, step)
            if event.done is not None:
                done[event.key] = event.done
        step += 1
    return first, done


def test_a_request_of_many_sequences_leaves_room_for_the_next(plugins: PluginSet, checkpoint: Path) -> None:
    """A request of 4 choices on a batch of 4 (n=4, 40 tokens each) and one of long prompts filling the prefill budget,
    then a short request: it gets its first token within a few steps (before, it waited for a slot, 40 steps), and
    every sequence gets the tokens it gets alone."""
    engine = _engine(plugins, checkpoint)
    engine.max_batch, engine.max_prefill_tokens = 4, 64
    many = [Job(i, (3, 4, 5), SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=1.0, seed=1, n=4),
                index=i, group=0, owner=0) for i in range(4)]
    short = Job(9, (7, 8), SamplingParams(max_new_tokens=3, ignore_eos=True), owner=9)
    alone = run_jobs(engine, list(many)) | run_jobs(engine, [short])
    first, done = _first_token_step(engine, many, [short], after=2)
    assert first[9] <= 4, f"the short request's first token came at step {first[9]}"
    assert {k: c.token_ids for k, c in done.items()} == {k: c.token_ids for k, c in alone.items()}
    # Long prompts (4 x 300 tokens, 64 a step): the short one's prompt is prefilled beside them, not after them.
    prompts = [Job(20 + i, tuple(range(10 + i, 310 + i)), SamplingParams(max_new_tokens=2, ignore_eos=True),
                   owner=20) for i in range(2)]
    first, _ = _first_token_step(engine, prompts, [short], after=1)
    assert first[9] <= 3 < min(first[k] for k in (20, 21)), first


def test_a_picture_the_vision_tower_fails_on_ends_its_sequence_alone(plugins: PluginSet) -> None:
    """A prompt with pictures is prefilled alone: a picture the model refuses (four channels, past the request checks
    here) ends that sequence with its error while the text prompts beside it get their tokens alone."""
    import numpy as np

    from fd_core.host.backend import Backend
    from fd_core.runtime.engine.runner import ModelRunner
    from fd_core.runtime.plan import model_config_for
    from fd_core.runtime.request import Request

    arch = plugins.registry.get("qwen3_vl")
    runner = ModelRunner(Backend(plugins), arch, model_config_for(arch, None), graph="off")
    runner.load()
    runner.decide()
    engine = Engine(runner, max_batch=4)
    config = runner.config
    count = arch.image_tokens(config, (3, 64, 64))  # type: ignore[misc]
    with_picture = (1, 2, *[int(config.extra["image_token_id"])] * count, 5, 6)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    texts = [Job(0, (1, 2, 3, 4), params), Job(2, (9, 8, 7), params)]
    alone = {j.key: engine.generate(Request((j.prompt,), j.sampling))[0].token_ids for j in texts}
    bad = np.random.default_rng(0).random((4, 64, 64), dtype=np.float32)  # RGBA: not what the processor takes
    done = run_jobs(engine, [texts[0], Job(1, with_picture, params, (), (bad,)), texts[1]])
    assert {k: done[k].token_ids for k in alone} == alone
    assert done[1].finish_reason == "error" and done[1].failure is not None and "\n" not in done[1].failure.message
    assert engine.pending == 0 and engine.pool.used == 0


def test_the_scheduler_makes_each_submit_call_one_request_unless_told_a_share() -> None:
    """What the engine's fair shares see: a submit call's jobs share one owner (its choices' group remapped with their
    keys), another call another owner, and calls given one share() the same owner (fd serve's prompts of one HTTP
    request)."""
    from fd_core.runtime.engine.scheduler import Scheduler

    seen: list[Job] = []

    def tick(adds: Any, cancels: Any) -> list[Any]:
        seen.extend(adds)
        from fd_core.runtime.engine.loop import Event

        return [Event(job.key, None, "", Completion(list(job.prompt), [], "", "length")) for job in adds]

    scheduler = Scheduler(tick)
    try:
        choices = [Job(0, (1,), SamplingParams(n=2), group=0), Job(1, (1,), SamplingParams(n=2), group=0)]
        first = scheduler.submit(choices)
        second = scheduler.submit([Job(0, (2,))])
        share = scheduler.new_share()
        third = scheduler.submit([Job(0, (3,))], share) + scheduler.submit([Job(0, (4,))], share)
        for s in first + second + third:
            s.result(timeout=10)
    finally:
        scheduler.close()
    owners = {job.prompt: job.owner for job in seen}
    assert seen[0].owner == seen[1].owner != owners[(2,)]
    assert owners[(3,)] == owners[(4,)] == share and len({owners[(2,)], share, seen[0].owner}) == 3
    assert seen[0].group == seen[1].group == seen[0].key and seen[1].key != seen[0].key
