"""accept_draft (contract 1.7), speculative decoding's acceptance, computed another way than fd's native op: greedy
rows compared with one argmax over every position at once; sampled rows with every position's distribution made at
once in numpy (temperature, top-k, the top-p nucleus by one sort), then the rejection rule row by row."""

from __future__ import annotations

import os
from typing import Any, Sequence


def accept_draft(logits: Any, proposals: Sequence[Sequence[int]], temperature: float, top_k: int, top_p: float,
                 uniform: Sequence[Sequence[float]], draft_probs: Any = None) -> list[list[int]]:
    """Each row's accepted proposals, then one token (fd_core.kernels.OPS["accept_draft"]).

    FD_EXAMPLE_KERNELS_BREAK=accept_draft breaks a tied argmax toward the higher id (a device argmax that keeps the
    last maximum): `fd check` fails naming accept_draft.
    """
    import numpy as np

    x = np.asarray(logits.numpy() if hasattr(logits, "numpy") else logits, dtype=np.float32).astype(np.float64)
    rows, positions, vocab = x.shape
    if temperature == 0:
        if os.environ.get("FD_EXAMPLE_KERNELS_BREAK") == "accept_draft":
            best = vocab - 1 - x[..., ::-1].argmax(axis=-1)
        else:
            best = x.argmax(axis=-1)
        q0 = None if draft_probs is None else np.asarray(
            draft_probs.numpy() if hasattr(draft_probs, "numpy") else draft_probs, dtype=np.float32)
        out = []
        for b, row in enumerate(proposals):
            guess = np.asarray(list(row), dtype=np.int64)
            wrong = guess != best[b, : len(guess)]
            if q0 is not None:  # a proposal its draft gave no mass is rejected (the ratio is 0)
                wrong |= q0[b, np.arange(len(guess)), guess] <= 0
            wrong = np.flatnonzero(wrong)
            taken = int(wrong[0]) if wrong.size else len(guess)
            out.append([int(t) for t in guess[:taken]] + [int(best[b, taken])])
        return out
    p = _distributions(x / temperature, top_k, top_p)
    q = None if draft_probs is None else np.asarray(
        draft_probs.numpy() if hasattr(draft_probs, "numpy") else draft_probs, dtype=np.float32).astype(np.float64)
    out = []
    for b, row in enumerate(proposals):
        accepted: list[int] = []
        for i, token in enumerate(int(t) for t in row):
            mass = p[b, i, token]
            ratio = mass if q is None else (mass / q[b, i, token] if q[b, i, token] > 0 else 0.0)
            if uniform[b][i] < ratio:
                accepted.append(token)
                continue
            rest = p[b, i].copy()
            if q is None:
                rest[token] = 0.0
            else:
                rest = np.maximum(p[b, i] - q[b, i], 0.0)
            if rest.sum() <= 0:
                rest = p[b, i]
            accepted.append(_pick(rest, (uniform[b][i] - ratio) / (1.0 - ratio) if ratio < 1 else 0.0))
            break
        else:
            accepted.append(_pick(p[b, len(accepted)], uniform[b][len(accepted)]))
        out.append(accepted)
    return out


def _distributions(scores: Any, top_k: int, top_p: float) -> Any:
    """softmax over the last axis after top-k, then renormalised over the top-p nucleus (ties by id), every row and
    position at once."""
    import numpy as np

    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = np.sort(scores, axis=-1)[..., vocab - top_k: vocab - top_k + 1]
        scores = np.where(scores < kth, -np.inf, scores)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        ranked = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(ranked, axis=-1) - ranked  # the mass ahead of each token in that order
        # Kept: every token whose mass ahead falls short of top_p, which is the shortest prefix reaching it.
        keep = np.zeros_like(p, dtype=bool)
        np.put_along_axis(keep, order, before < top_p, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def _pick(p: Any, u: float) -> int:
    """The first id whose cumulative mass exceeds u times the total."""
    import numpy as np

    cumulative = np.cumsum(p)
    return int(min(np.searchsorted(cumulative, u * cumulative[-1], side="right"), p.size - 1))
