"""The nearest valid name for a misspelled one, for error messages."""

from __future__ import annotations

from typing import Iterable

from fd_core.markers import PROJECT


def edit_distance(a: str, b: str, swaps: bool = False) -> int:
    """Levenshtein edit distance; with `swaps`, two adjacent letters swapped count as one edit (optimal string
    alignment)."""
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(rows[i - 1][j] + 1, row[j - 1] + 1, rows[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if swaps and i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[i - 2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


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
            edit_distance(bare, other) / max(len(bare), len(other), 1)
            - (0.3 if same_verb else 0.0)
            - (0.6 if same_words else 0.0)
        )

    best = min(choices, key=cost, default=None)
    if best is not None and cost(best) <= 0.5:
        return f"did you mean {best!r}?"
    return f"valid names: {', '.join(choices)}"
