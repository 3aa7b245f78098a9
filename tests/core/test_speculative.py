"""Speculative decoding: the n-gram proposer, the accept_draft op's semantics against independent oracles (the argmax,
the target distribution over many draws), the kernel checks catching subtly wrong acceptance kernels, the engine giving
plain decoding's tokens, and the options' refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest

from fd_core import native_ops
from fd_core.errors import ConfigError
from fd_core.runtime.engine.speculation import NgramProposer, ReplayProposer, Speculation, speculation_of
from fd_core.runtime.kernel_checks import cases, compare
from tiny_engine import tiny_engine

SIZES = [{"hidden": 64, "inter": 96, "head_dim": 16, "heads": 4, "kv": 2}]


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    proposer = NgramProposer()
    assert proposer.propose([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 4) == [4, 5, 6, 7]
    # The 3-gram (9, 2, 3) is new; the 2-gram (2, 3) occurred at the start.
    assert proposer.propose([1, 2, 3, 4, 5, 6, 7, 9, 2, 3], 2) == [4, 5]
    # The latest earlier occurrence with as many tokens after it as asked: (1, 2) was followed by 8 last.
    assert proposer.propose([1, 2, 7, 1, 2, 8, 1, 2], 1) == [8]
    assert proposer.propose([1, 2, 7, 1, 2, 8, 9, 9, 1, 2], 3) == [8, 9, 9]
    # A run repeating itself: the earliest occurrence, whose continuation is the longest.
    assert proposer.propose([3, 5, 5, 5, 5, 5, 5, 5], 4) == [5, 5, 5]
    assert proposer.propose([1, 2, 3, 4, 5], 4) == []  # no suffix of 2 or more tokens occurred before
    assert proposer.propose([7, 3, 7, 4], 4) == []  # one token is too short a key
    # Ids whose bytes straddle: 256 = 00 01 00 00; a byte match across two ids must not count.
    assert proposer.propose([1, 256, 0, 1, 256], 2) == [0, 1]
    assert proposer.propose([0, 1, 0, 0, 1, 0], 3) == [0, 1, 0]
    # Only the window is searched.
    assert NgramProposer(window=6).propose([1, 2, 3, 9, 9, 9, 9, 1, 2], 1) == []


def _row(vocab: int = 6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, vocab)).astype("float32") * 1.5


def test_greedy_acceptance_takes_the_proposals_equal_to_the_argmax_then_the_argmax() -> None:
    logits = _row(vocab=40)
    best = logits[0].argmax(axis=-1).tolist()  # the oracle: numpy's argmax of each position
    accept = native_ops.accept_draft
    assert accept(logits, [best[:2]], 0.0, 0, 1.0, [[0.0] * 3]) == [best[:3]]
    assert accept(logits, [[best[0], (best[1] + 1) % 40]], 0.0, 0, 1.0, [[0.0] * 3]) == [best[:2]]
    assert accept(logits, [[(best[0] + 1) % 40, best[1]]], 0.0, 0, 1.0, [[0.0] * 3]) == [best[:1]]
    assert accept(logits, [[]], 0.0, 0, 1.0, [[0.0]]) == [best[:1]]


def _softmax(row: np.ndarray, temperature: float) -> np.ndarray:
    z = np.exp((row - row.max()) / temperature)
    return z / z.sum()


@pytest.mark.parametrize("draft", [False, True], ids=["certain proposer", "draft distribution"])
def test_rejection_sampling_keeps_the_target_distribution(draft: bool) -> None:
    """Over 20,000 seeded draws, the first token out (the proposal when accepted, else the residual's draw) is
    distributed as softmax(logits / T) computed here with numpy (an oracle independent of the op), within 4.5 standard
    errors for every token; and so is the second, given the first proposal was accepted."""
    temperature, vocab, draws = 0.8, 6, 20_000
    logits = _row(vocab)
    rng = np.random.default_rng(1)
    target = _softmax(logits[0, 0].astype(np.float64), temperature)
    q = np.stack([_softmax(row, 1.0) for row in rng.standard_normal((2, vocab))]).astype("float32") if draft else None
    firsts, seconds = np.zeros(vocab), np.zeros(vocab)
    for _ in range(draws):
        # A draft samples its proposals from q; a certain proposer always proposes the same tokens (1 then 4).
        guess = [int(rng.choice(vocab, p=q[i] / q[i].sum())) for i in range(2)] if q is not None else [1, 4]
        first = guess[0]
        out = native_ops.accept_draft(logits, [guess], temperature, 0, 1.0, [rng.random(3).tolist()],
                                      None if q is None else q[None])[0]
        firsts[out[0]] += 1
        if out[0] == first and len(out) > 1:  # accepted: the second is drawn given it
            seconds[out[1]] += 1 if first == 1 or q is None else 0
    error = np.sqrt(target * (1 - target) / draws)
    assert np.all(np.abs(firsts / draws - target) <= 4.5 * error), (firsts / draws, target)
    after = _softmax(logits[0, 1].astype(np.float64), temperature)
    total = seconds.sum()
    assert total > 1000
    assert np.all(np.abs(seconds / total - after) <= 4.5 * np.sqrt(after * (1 - after) / total) + 1e-12)


def _run_checks(kernel: Any) -> list[str]:
    """The kernel suite's accept_draft cases through `kernel`, each compared with the native op as fd check does."""
    failures = []
    for what, args in cases("accept_draft", SIZES, "float32"):
        problem = compare("accept_draft", kernel(*args), native_ops.accept_draft(*args), "float32", args, native_ops)
        if problem:
            failures.append(f"{what}: {problem}")
    return failures


def _ties_to_the_highest(logits: Any, proposals: Sequence[Sequence[int]], temperature: float, *rest: Any) -> Any:
    if temperature:
        return native_ops.accept_draft(logits, proposals, temperature, *rest)
    flipped = np.asarray(logits.numpy())[:, :, ::-1]
    best = flipped.shape[-1] - 1 - flipped.argmax(axis=-1)
    out = []
    for b, row in enumerate(proposals):
        taken = 0
        while taken < len(row) and row[taken] == best[b, taken]:
            taken += 1
        out.append([*row[:taken], int(best[b, taken])])
    return out


def _scaled_threshold(scale: float) -> Any:
    def kernel(logits: Any, proposals: Any, temperature: float, top_k: int, top_p: float, uniform: Any,
               draft: Any = None) -> Any:
        return native_ops.accept_draft(logits, proposals, temperature, top_k, top_p,
                                       [[u * scale for u in row] for row in uniform], draft)
    return kernel


def _last_draw_at_the_first_uniform(logits: Any, proposals: Any, temperature: float, top_k: int, top_p: float,
                                    uniform: Any, draft: Any = None) -> Any:
    return native_ops.accept_draft(logits, proposals, temperature, top_k, top_p,
                                   [[*row[:-1], row[0]] for row in uniform], draft)


def _draft_ignored(logits: Any, proposals: Any, temperature: float, top_k: int, top_p: float, uniform: Any,
                   draft: Any = None) -> Any:
    return native_ops.accept_draft(logits, proposals, temperature, top_k, top_p, uniform, None)


def _residual_keeps_the_rejected(logits: Any, proposals: Any, temperature: float, top_k: int, top_p: float,
                                 uniform: Any, draft: Any = None) -> Any:
    """Rejection drawn from p itself (the rejected token still in it), at the rescaled uniform."""
    if temperature == 0 or draft is not None:
        return native_ops.accept_draft(logits, proposals, temperature, top_k, top_p, uniform, draft)
    rows = native_ops._host(logits)
    out = []
    for b, row in enumerate(proposals):
        accepted: list[int] = []
        for i, token in enumerate(row):
            p = native_ops._probabilities(rows[b, i], temperature, top_k, top_p)
            if uniform[b][i] < p[token]:
                accepted.append(token)
                continue
            out.append([*accepted, native_ops._inverse_cdf(p, (uniform[b][i] - p[token]) / (1 - p[token]))])
            break
        else:
            out.append([*accepted, native_ops._draw(rows[b, len(accepted)], temperature, top_k, top_p,
                                                    uniform[b][len(accepted)])])
    return out


@pytest.mark.parametrize("kernel", [_ties_to_the_highest, _scaled_threshold(0.9), _scaled_threshold(1.05),
                                    _last_draw_at_the_first_uniform, _draft_ignored, _residual_keeps_the_rejected],
                         ids=["tie broken the other way", "threshold 10% high", "threshold 5% low",
                              "last draw at the wrong uniform", "draft probabilities ignored",
                              "rejected token left in the residual"])
def test_a_subtly_wrong_acceptance_kernel_fails_the_kernel_checks(kernel: Any) -> None:
    assert _run_checks(native_ops.accept_draft) == []
    failures = _run_checks(kernel)
    assert failures, "the accept_draft cases pass a wrong kernel"
    assert "gave" in failures[0] and "the native op" in failures[0]


def test_explain_shows_the_proposer_and_plans_the_verify_steps_scratch() -> None:
    """fd explain names the proposer and k; the memory plan keeps room for a verify step's logits (a row a position)."""
    import json

    from fakedist import run_fd

    plain = run_fd(["explain", "--tp", "1", "--json"])
    spec = run_fd(["explain", "--tp", "1", "--json", "--speculative", "ngram", "--num-speculative-tokens", "6"])
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    before, after = json.loads(plain.stdout), json.loads(spec.stdout)
    assert before["speculative"] is None and after["speculative"] == {"proposer": "ngram", "k": 6, "draft_checkpoint": None}
    assert after["memory"]["scratch_bytes"] > before["memory"]["scratch_bytes"]
    text = run_fd(["explain", "--tp", "1", "--speculative", "ngram"]).stdout
    assert "speculative decoding: ngram, up to 4 tokens a step" in " ".join(text.split())


def test_speculation_options_are_checked() -> None:
    assert speculation_of(None, None) is None
    assert speculation_of("ngram", None) == Speculation("ngram", 4)
    with pytest.raises(ConfigError, match="needs"):
        speculation_of(None, 3)
    with pytest.raises(ConfigError, match="not a proposer"):
        speculation_of("eagle", None)
    with pytest.raises(ConfigError, match=r"1\.\.16"):
        speculation_of("ngram", 0)


def test_sampled_tokens_keep_the_distribution_of_plain_sampling() -> None:
    """The engine with speculation samples each token from the distribution plain sampling draws from: 1,024 samples of
    the first four tokens (temperature 1.5, top-k 3), the proposals the greedy continuation (often right, often
    wrong); the share of each token at each of the three positions after the first agrees with plain sampling's
    within 4 standard errors (a verify whose threshold is 30% off is far outside)."""
    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.engine.speculation import Speculation
    from fd_core.runtime.request import Request

    prompt = (5, 6, 7, 8)
    plain, spec = tiny_engine(max_batch=64), tiny_engine(max_batch=64, speculation=Speculation("ngram", 2))
    greedy = plain.generate(Request.greedy([list(prompt)], 4))[0].token_ids
    spec.proposer = ReplayProposer({prompt: greedy})

    def samples(engine: Any) -> list[tuple[int, ...]]:
        out = []
        for seed in range(16):
            sampling = SamplingParams(max_new_tokens=4, temperature=1.5, top_k=3, seed=seed, n=64, ignore_eos=True)
            out += [tuple(c.token_ids) for c in engine.generate(Request((prompt,), sampling))]
        return out

    want, got = samples(plain), samples(spec)
    assert 0 < spec.spec_accepted < spec.spec_proposed, (spec.spec_proposed, spec.spec_accepted)
    for position in (1, 2, 3):
        a, b = [t[position] for t in got], [t[position] for t in want]
        for value in set(a) | set(b):
            p, q = a.count(value) / len(a), b.count(value) / len(b)
            spread = np.sqrt(max(p * (1 - p), q * (1 - q), 1 / len(a)) * 2 / len(a))
            assert abs(p - q) <= 4 * spread, (position, value, p, q)


def test_greedy_tokens_with_speculation_are_plain_decodings_and_blocks_come_back() -> None:
    """Continuous batching with rows accepting different counts (an oracle proposer, wrong at changing places), logprobs
    and a stop at the token limit inside an accepted run: the same tokens and logprobs as plain decoding, every
    block back in the pool, prefix hashes over accepted tokens only (a second run finds the first's blocks)."""
    from fd_core.runtime.engine.loop import Job
    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.engine.speculation import Speculation
    from fd_core.runtime.request import Request

    rng = np.random.default_rng(3)
    prompts = [tuple(int(t) for t in rng.integers(1, 500, size=n)) for n in (40, 5, 23)]
    limits = (21, 9, 14)
    plain = tiny_engine(max_batch=4)
    want = []
    for prompt, limit in zip(prompts, limits, strict=True):
        sampling = SamplingParams(max_new_tokens=limit, ignore_eos=True, logprobs=2)
        want.append(plain.generate(Request((prompt,), sampling))[0])
    spec = tiny_engine(max_batch=4, speculation=Speculation("ngram", 4))
    spec.proposer = ReplayProposer({p: c.token_ids for p, c in zip(prompts, want, strict=True)}, wrong=(1, 2, 0, 9))
    for key, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        spec.add(Job(key, prompt, SamplingParams(max_new_tokens=limit, ignore_eos=True, logprobs=2)))
    done = {}
    while spec.pending:
        done.update({e.key: e.done for e in spec.step() if e.done is not None})
    for key, completion in enumerate(want):
        got = done[key]
        assert got.token_ids == completion.token_ids
        assert [p.token for p in got.logprobs] == got.token_ids
        for a, b in zip(got.logprobs, completion.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
    assert 0 < spec.spec_accepted < spec.spec_proposed
    assert spec.spec_steps < sum(limits) - len(limits)  # fewer model steps than tokens
    assert spec.pool.used == 0
    # The first prompt again: its full blocks of accepted tokens were published, and are found.
    before = spec.kv_stats()["prefix_cache_hit_tokens"]
    spec.generate(Request((prompts[0] + tuple(want[0].token_ids[:20]),), SamplingParams(max_new_tokens=2)))
    assert spec.kv_stats()["prefix_cache_hit_tokens"] - before == 48


def test_a_model_without_prefill_every_is_refused_in_one_line() -> None:
    from fd_core.runtime.engine.loop import Engine
    from fd_core.runtime.engine.speculation import Speculation

    engine = tiny_engine()
    runner = engine.runner

    class Plain:
        pass

    runner.model = Plain()
    with pytest.raises(ConfigError, match="prefill_every.*run without it"):
        Engine(runner, speculation=Speculation())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fakedist import run_fd

    path = tmp_path_factory.mktemp("draft") / "tiny"
    done = run_fd(["save-random", "--model", "ernie4_5", str(path)])
    assert done.returncode == 0, done.stderr
    return str(path)


def test_the_model_as_its_own_draft_at_tp2_accepts_every_proposal_and_gives_plain_tokens(tiny: str) -> None:
    """fd run --tp 2 --speculative draft with the model's own checkpoint as the draft (a second copy on each rank, in
    an engine of its own): tp=1's plain tokens, every proposal accepted; the memory plan counts both models."""
    import json

    from fakedist import run_fd

    common = ["run", "--checkpoint", tiny, "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,3", "--max-new-tokens", "20",
              "--json"]
    plain = run_fd([*common, "--tp", "1"], timeout=300)
    spec = run_fd([*common, "--tp", "2", "--speculative", "draft", "--draft-checkpoint", tiny], timeout=300)
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    want, got = json.loads(plain.stdout), json.loads(spec.stdout)
    assert [o["ids"] for o in got["outputs"]] == [o["ids"] for o in want["outputs"]]
    stats = got["speculative"]
    assert stats["proposer"] == "draft" and 0 < stats["accepted"] == stats["proposed"], stats
    assert got["memory"]["beside"] == "draft model ernie4_5"
    assert got["memory"]["weights_per_rank"] == 2 * run_fd_json(["explain", "--checkpoint", tiny])["memory"][
        "weights_per_rank"]


def run_fd_json(args: list[str]) -> Any:
    import json

    from fakedist import run_fd

    done = run_fd([*args, "--json"])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_draft_of_another_vocabulary_or_a_draft_without_its_proposer_is_refused_in_one_line(
    tiny: str, tmp_path: Path
) -> None:
    import json

    from fakedist import run_fd

    config = json.loads((Path(tiny) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 700}))
    other = tmp_path / "other"
    assert run_fd(["save-random", "--config", str(tmp_path / "config.json"), str(other)]).returncode == 0
    for args, message in (
        (["--speculative", "draft", "--draft-checkpoint", str(other)],
         f"fd: error: the draft model in {other} has a vocabulary of 700 tokens and the model 512: a draft proposes "
         f"the model's token ids; give --draft-checkpoint a model of the same tokenizer"),
        (["--draft-checkpoint", tiny], "fd: error: --draft-checkpoint needs --speculative (the proposer): add "
                                       "--speculative draft"),
        (["--speculative", "draft"], "fd: error: --speculative draft proposes with a draft model's checkpoint: give "
                                     "both it and --draft-checkpoint"),
        (["--speculative", "draft", "--draft-checkpoint", str(tmp_path / "none")],
         f"fd: error: --draft-checkpoint: checkpoint {tmp_path / 'none'}: not a directory; pass a folder with "
         f"config.json and *.safetensors"),
    ):
        done = run_fd(["run", "--checkpoint", tiny, *args])
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [message], done.stderr


def test_structured_output_speculates_within_its_grammar(tmp_path: Path) -> None:
    """A json_schema sequence with speculation: its proposals (its known continuation, spoiled at changing places, so
    some are ones the grammar forbids) are checked against the grammar before the verify step and its masks apply at
    every position: the same tokens as plain decoding, valid JSON, proposals accepted."""
    import json

    from fd_core.runtime.engine.loop import Engine
    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.plan import RunConfig, plan_run
    from fd_core.runtime.ranks.worker import RankWorker
    from fd_core.runtime.request import Request
    from fd_core.runtime.text.grammar import constraint_spec
    from fd_core.serve.tiny import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tmp_path / "tiny")
    worker = RankWorker.start(plan_run(RunConfig(checkpoint=str(checkpoint), tp=1, progress=False)), 0, 1, None)
    spec = constraint_spec({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"kind": {"enum": ["alpha", "beta", "gamma"]}, "ok": {"type": "boolean"}},
        "required": ["kind", "ok"], "additionalProperties": False}}})
    prompt = tuple(worker.engine.tokenizer.encode("Once upon a time"))
    request = Request((prompt,), SamplingParams(max_new_tokens=120, grammar=spec))
    want = worker.engine.generate(request)[0]
    assert want.finish_reason == "stop" and set(json.loads(want.text or "")) == {"kind", "ok"}
    engine = Engine(worker.runner, worker.engine.tokenizer, speculation=Speculation("ngram", 4))
    engine.proposer = ReplayProposer({prompt: want.token_ids}, wrong=(1, 0, 2, 9))
    got = engine.generate(request)[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    # Spoiled proposals the grammar forbids were cut before the verify step (none here was both wrong and allowed).
    assert 0 < engine.spec_accepted <= engine.spec_proposed
    worker.end()


def test_a_prompt_with_a_picture_speculates_to_the_same_tokens(tmp_path: Path) -> None:
    """A Qwen3-VL prompt with a picture: after its prefill (the picture's rotary delta kept), n-gram speculation gives
    the tokens of plain decoding, verify steps included."""
    import json

    from fakedist import run_fd

    picture = tmp_path / "picture.npy"
    np.save(picture, np.random.default_rng(0).random((3, 32, 32)).astype("float32"))
    args = ["run", "--model", "qwen3_vl", "--tp", "1", "--prompt-ids", "5,17,508,510,510,510,510,509,42", "--image",
            str(picture), "--max-new-tokens", "40", "--json"]
    plain, spec = run_fd(args, timeout=300), run_fd([*args, "--speculative", "ngram"], timeout=300)
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    want, got = json.loads(plain.stdout), json.loads(spec.stdout)
    assert got["tokens"] == want["tokens"] and got["speculative"]["verify_steps"] > 0, got["speculative"]


def test_preempted_sequences_speculate_on_to_the_same_tokens() -> None:
    """Three 30-token prompts in a pool of 6 blocks of 16: at position 32 each needs a third block, so the latest are
    preempted (their proposals never take a block another needs) and recomputed; speculation still gives plain
    decoding's tokens, every block back in the pool."""
    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.memory import MemoryPlan
    from fd_core.runtime.request import Request

    rng = np.random.default_rng(5)
    prompts = tuple(tuple(int(t) for t in rng.integers(1, 500, size=30)) for _ in range(3))
    request = Request(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    want = [c.token_ids for c in tiny_engine(max_batch=4).generate(request)]
    tight = MemoryPlan(1.0, "float32", 1, 0, 1, block_size=16, blocks=6, blocks_from="the test")
    engine = tiny_engine(max_batch=4, memory=tight, prefix_caching=False, speculation=Speculation("ngram", 4))
    engine.proposer = ReplayProposer(dict(zip(prompts, want, strict=True)), wrong=(2, 9))
    assert [c.token_ids for c in engine.generate(request)] == want
    assert engine.preemptions > 0 and 0 < engine.spec_accepted < engine.spec_proposed
    assert engine.pool.used == 0


def test_a_draft_of_other_weights_keeps_its_captured_steps_apart_from_the_models(tiny: str, tmp_path: Path) -> None:
    """A draft with other weights than the model (so its proposals mostly fail and the model decodes plainly between
    verify steps), graphs as the cpu platform decides them: the two models capture decode steps of the same shapes on
    one graph backend, and neither replays the other's (a replayed draft program gave the draft's tokens)."""
    from fakedist import run_fd
    from fd_core.runtime import LLM, SamplingParams

    other = tmp_path / "other"
    assert run_fd(["save-random", "--model", "ernie4_5", "--seed", "7", str(other)]).returncode == 0
    first, second = SamplingParams(max_new_tokens=2, ignore_eos=True), SamplingParams(max_new_tokens=40,
                                                                                          ignore_eos=True)
    with LLM(tiny, tp=1) as llm:
        want = [c.token_ids for c in llm.generate([[5, 6, 7, 8]], first) + llm.generate([[5, 6, 7, 8]], second)]
    with LLM(tiny, tp=1, speculative="draft", draft_checkpoint=other) as llm:
        assert llm.graph.allowed  # the plain steps are captured
        got = [c.token_ids for c in llm.generate([[5, 6, 7, 8]], first) + llm.generate([[5, 6, 7, 8]], second)]
        assert llm.kv_cache["spec_proposed_tokens"] > 0
    assert got == want


@pytest.mark.parametrize("pattern, extra", [("hello", 4), ("hello world, this is fine", 1)])
def test_proposals_running_past_the_grammars_end_stop_at_its_end_of_sequence(tmp_path: Path, pattern: str,
                                                                             extra: int) -> None:
    """A regex's output proposed whole and then end-of-sequence ids (what a draft that ignores EOS proposes): the run
    ends at the first EOS, the grammar's state comes back where it was, the output is plain decoding's (complete,
    "stop"), and every block is back in the pool."""
    from fd_core.runtime.engine.loop import Engine
    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.plan import RunConfig, plan_run
    from fd_core.runtime.ranks.worker import RankWorker
    from fd_core.runtime.request import Request
    from fd_core.runtime.text.grammar import constraint_spec
    from fd_core.serve.tiny import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tmp_path / "tiny")
    worker = RankWorker.start(plan_run(RunConfig(checkpoint=str(checkpoint), tp=1, progress=False)), 0, 1, None)
    tokenizer = worker.engine.tokenizer
    prompt = tuple(tokenizer.encode("Once upon a time"))
    request = Request((prompt,), SamplingParams(max_new_tokens=60, grammar=constraint_spec(None, pattern)))
    want = worker.engine.generate(request)[0]
    assert want.finish_reason == "stop" and want.text == pattern
    eos = tokenizer.role_id("eos_token")
    engine = Engine(worker.runner, tokenizer, speculation=Speculation("ngram", 3))
    engine.proposer = ReplayProposer({prompt: [*want.token_ids, *[eos] * extra]})
    got = engine.generate(request)[0]
    assert (got.token_ids, got.finish_reason, got.text, got.failure) == (want.token_ids, "stop", pattern, None)
    assert engine.pool.used == 0
    worker.end()
