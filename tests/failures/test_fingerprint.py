"""The run-time cross-rank fingerprint (issue 44): at tp > 1, every FINGERPRINT_EVERY steps each rank sums what its
all-reduces returned and the session compares the sums across ranks. A platform whose rank-1 all-reduce returns a
stale buffer (tests/mutants/platforms/mutant_stale_rank1.py) gave tokens with exit 0 before (the ranks compared only
tokens); now `fd run --tp 2` stops with one line naming the step and the fix. A real two-rank run over gloo."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakedist import make_distribution, run_fd
from fd_core.runtime.engine.checked_graphs import float_sums
from fd_core.runtime.engine.loop import FINGERPRINT_EVERY, fingerprints_agree

PLATFORMS = Path(__file__).parents[1] / "mutants" / "platforms"


def test_a_rank_whose_all_reduce_returns_a_stale_buffer_stops_the_run(tmp_path: Path) -> None:
    dist = make_distribution(tmp_path / "stale", "mutant-stale-rank1", {},
                             {"fd.platforms": {"mutant_stale_rank1": "mutant_stale_rank1"}})
    done = run_fd(["run", "--tp", "2", "--steps", "6", "--json"], path=Path(f"{PLATFORMS}:{dist}"),
                  env={"FD_PLATFORM": "mutant_stale_rank1"}, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and not done.stdout, (done.returncode, done.stdout, done.stderr[-1500:])
    assert last.startswith("fd: error: rank 1's all-reduce results at step 0 differ from rank 0's"), last
    assert "run fd check mutant_stale_rank1" in last


def test_fingerprints_agree_within_rounding_only() -> None:
    """Two ranks' sums of the same results agree; an all-reduce summed in another order moves them by rounding only;
    a stale or partial result does not agree."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    mine = (FINGERPRINT_EVERY, *float_sums(x))
    reordered = (FINGERPRINT_EVERY, *float_sums(x[::-1].copy()))
    assert fingerprints_agree(mine, reordered)
    assert not fingerprints_agree(mine, (FINGERPRINT_EVERY, *float_sums(x * 0.5)))
    assert not fingerprints_agree(mine, (FINGERPRINT_EVERY + 1, *mine[1:]))  # another step's


@pytest.mark.parametrize("tp", [2])
def test_a_sound_platform_passes_the_fingerprint(tp: int) -> None:
    """The cpu platform's shared-memory all-reduce returns one tensor to every rank: a run long enough for several
    fingerprinted steps ends with exit 0."""
    done = run_fd(["run", "--tp", str(tp), "--steps", str(3 * FINGERPRINT_EVERY), "--json"], timeout=300)
    assert done.returncode == 0, done.stderr[-1500:]
