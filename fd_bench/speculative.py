"""Speculative decoding rows (ERNIE-4.5-0.3B's size, random bfloat16 weights; the tiny preset in smoke mode), tp=1 on
the cpu platform, batch 1 and batch 8, each against plain decoding in the same engine, interleaved:

- n-gram: prompt lookup on prompts of random ids (random weights soon repeat their own output, which the proposer
  finds: the share accepted is shown);
- every proposal wrong: a proposer whose first proposal is always wrong (the cost where speculation cannot win: each
  failing sequence waits 1, 3, 7, ... steps before proposing again);
- every proposal accepted: a proposer replaying the model's own greedy continuation (what the target as its own draft
  would propose): the machinery's gain at full acceptance;
- half accepted: the same, its third proposal of each step wrong (2 of 4 accepted, 3 tokens a verify step);
- the model as its own draft (`--speculative draft --draft-checkpoint` the same checkpoint): every proposal accepted,
  each costing a draft step as dear as the model's: what the draft machinery costs.

Random weights copy nothing from a quoted passage, so n-gram acceptance on real text cannot be measured here; the
replay proposer fixes the acceptance rate instead. Every side's tokens are checked equal to plain decoding's.
"""

from __future__ import annotations

import statistics
from typing import Any

from fd_bench.paged import bench_checkpoint, random_ids
from fd_bench.report import Line


def _rate(engine: Any, request: Any, proposer: Any) -> tuple[float, list[list[int]], float]:
    """Decode tokens per second of one generation with `proposer` (None: plain), its tokens, the accepted share."""
    engine.proposer = proposer
    tokens, spent = engine.decoded_tokens, engine.decode_s
    proposed, accepted = engine.spec_proposed, engine.spec_accepted
    out = [c.token_ids for c in engine.generate(request)]
    rate = (engine.decoded_tokens - tokens) / max(1e-9, engine.decode_s - spent)
    share = (engine.spec_accepted - accepted) / max(1, engine.spec_proposed - proposed)
    return rate, out, share


def speculative_rows(smoke: bool) -> list[Line]:
    import json

    from fd_core.runtime.engine.sampling import SamplingParams
    from fd_core.runtime.engine.speculation import NgramProposer, ReplayProposer
    from fd_core.runtime.plan import RunConfig, plan_run
    from fd_core.runtime.ranks.worker import RankWorker
    from fd_core.runtime.request import Request

    checkpoint = bench_checkpoint(smoke)
    vocab = json.loads((checkpoint / "config.json").read_text()).get("vocab_size", 512)
    steps, rounds = (12, 1) if smoke else (48, 3)
    plan = plan_run(RunConfig(checkpoint=str(checkpoint), tp=1, max_batch=8, speculative="draft",
                              draft_checkpoint=str(checkpoint), progress=False))
    worker = RankWorker.start(plan, 0, 1, None)
    engine = worker.engine
    draft = engine.proposer
    lines = []
    for batch in (1, 8):
        prompts = tuple(tuple(random_ids(64, 100 + i, vocab)) for i in range(batch))
        request = Request(prompts, SamplingParams(max_new_tokens=steps, ignore_eos=True))
        _rate(engine, request, None)  # warm-up: first calls at these shapes
        _, want, _ = _rate(engine, request, None)
        known = dict(zip(prompts, want, strict=True))
        cases = {"n-gram": NgramProposer(), "every proposal wrong": ReplayProposer(known, wrong=(0,)),
                 "every proposal accepted": ReplayProposer(known), "half accepted": ReplayProposer(known, wrong=(2,)),
                 "the model as its own draft": draft}
        for case, proposer in cases.items():
            _rate(engine, request, proposer)  # warm-up: its shapes' first calls (a draft's graph captures)
            plain: list[float] = []
            fast: list[float] = []
            shares: list[float] = []
            for i in range(rounds):  # interleaved, the order flipping each round
                for side in ((None, proposer) if i % 2 == 0 else (proposer, None)):
                    rate, got, share = _rate(engine, request, side)
                    if got != want:
                        raise AssertionError(f"speculative bench, {case}, batch {batch}: tokens differ from plain "
                                             f"decoding's")
                    (plain if side is None else fast).append(rate)
                    if side is not None:
                        shares.append(share)
            a, b = statistics.median(fast), statistics.median(plain)
            target = {"n-gram": "reported", "every proposal wrong": ">= 0.95",
                      "the model as its own draft": "reported"}.get(case, ">= 1.5")
            lines.append(Line(
                row="speculative", case=f"{case}, batch {batch}, tp=1", a="speculative (k=4)", b="plain decoding",
                a_value=a, b_value=b, unit="tok/s", ratio=a / b, ratio_label="speculative / plain", target=target,
                met=None if target == "reported" else a / b >= float(target.split()[-1]),
                note=(f"engine decode tok/s (verify steps included), medians of {rounds} interleaved round(s), "
                      f"{steps} tokens a prompt; {statistics.median(shares):.0%} of proposals accepted; the same "
                      f"tokens as plain"),
                details={"speculative": fast, "plain": plain, "accepted_share": shares},
            ))
    return lines
