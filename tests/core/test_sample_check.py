"""The sample op's check (kernel_checks.cases and compare): an independent float64 implementation of the op's stated
semantics (kernels.OPS) passes every case, and kernels a few percent off the semantics fail: a top-p boundary made
exclusive (which 20 random draws may or may not see; the 64-uniform grid always does), greedy and top-k ties broken
the other way (which random float32 logits never show; the tied logits do)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from fd_core import native_ops
from fd_core.runtime.kernel_checks import ODD_SIZES, cases, compare


def _draw(row: np.ndarray, temperature: float, top_k: int, top_p: float, u: float, *, exclusive: bool = False,
          ties_high: bool = False, exact_k: bool = False) -> int:
    if temperature == 0:
        return int(row.size - 1 - np.argmax(row[::-1])) if ties_high else int(np.argmax(row))
    scores = row.astype(np.float64) / temperature
    if 0 < top_k < scores.size:
        if exact_k:  # exactly k tokens, the later of tied ones dropped
            kept = np.argsort(-scores, kind="stable")[:top_k]
            scores = np.where(np.isin(np.arange(scores.size), kept), scores, -np.inf)
        else:  # every token tied with the k-th highest kept
            scores = np.where(scores < np.sort(scores)[-top_k], -np.inf, scores)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        end = int(np.searchsorted(np.cumsum(probs[order]), top_p))  # the token whose mass reaches top_p
        kept = order[: max(end, 1)] if exclusive else order[: end + 1]
        probs = np.where(np.isin(np.arange(probs.size), kept), probs, 0.0)
        probs /= probs.sum()
    cumulative = np.cumsum(probs)
    return int(min(np.searchsorted(cumulative, u * cumulative[-1], side="right"), probs.size - 1))


def _kernel(**flags: bool) -> Callable[..., list[int]]:
    def sample(logits: Any, temperature: float, top_k: int, top_p: float, uniform: list[float]) -> list[int]:
        rows = logits.numpy()
        return [_draw(row, temperature, top_k, top_p, u, **flags) for row, u in zip(rows, uniform, strict=True)]

    return sample


def _problems(kernel: Callable[..., list[int]]) -> list[str]:
    found = []
    for name, args in cases("sample", [ODD_SIZES], "float32", seed=3):
        problem = compare("sample", kernel(*args), native_ops.sample(*args), "float32", args, native_ops)
        if problem:
            found.append(f"{name}: {problem}")
    return found


def test_the_stated_semantics_pass_every_case() -> None:
    assert _problems(_kernel()) == []


@pytest.mark.parametrize("flag", ["exclusive", "ties_high", "exact_k"])
def test_a_kernel_a_few_percent_off_fails(flag: str) -> None:
    problems = _problems(_kernel(**{flag: True}))
    assert problems, f"{flag}: no case failed"
    if flag == "exclusive":  # the grid over one row sees it whatever the random draws did
        assert any(p.startswith("one row of logits") for p in problems), problems
    else:  # ties: only the tied logits show them
        assert all(p.startswith("tied logits") for p in problems), problems
