"""The nearest valid name for a misspelled one, for error messages."""

from __future__ import annotations

from typing import Iterable

from fd_core.markers import PROJECT


def _distance(a: str, b: str) -> int:
    """Levenshtein edit distance."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def nearest(name: str, choices: Iterable[str]) -> str:
    """Suggest the closest valid name: edit distance (the shared `fd_` prefix aside), and names being
    verb-first, the same leading word counts in a candidate's favour (`fd_clear_grpah_opt_backend`
    means `fd_clear_graphs`, not `fd_graph_backend`)."""
    choices = sorted(choices)
    bare = name.removeprefix(f"{PROJECT}_")

    def cost(choice: str) -> float:
        other = choice.removeprefix(f"{PROJECT}_")
        same_verb = bare.split("_", 1)[0] == other.split("_", 1)[0]
        same_words = sorted(bare.split("_")) == sorted(other.split("_"))  # fd_detect_platform
        return (
            _distance(bare, other) / max(len(bare), len(other), 1)
            - (0.3 if same_verb else 0.0)
            - (0.6 if same_words else 0.0)
        )

    best = min(choices, key=cost, default=None)
    if best is not None and cost(best) <= 0.5:
        return f"did you mean {best!r}?"
    return f"valid names: {', '.join(choices)}"
