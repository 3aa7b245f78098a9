"""The platform's graph backend as the runtime uses it: each captured key's first replay is compared with the
captured function run eagerly on the same inputs, so a replay that does not compute from its inputs (the capture's
stale output, say) stops the run naming the platform instead of giving wrong tokens with exit 0. The state the step
writes in place (the KV cache) is compared too: a replay that returns the right output but loses its cache write
would give wrong tokens from the next step on."""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Sequence

from fd_core.errors import PlatformError
from fd_core.graphs import GraphBackend

# How far a replay may be from the eager step, relative to the step's largest magnitude, by the output's dtype: a
# static program or a device graph may fuse or reorder sums (a 16-bit logit's own rounding is 2^-8 or 2^-11 of it);
# a stale output is off by the logits' own size.
REPLAY_TOLERANCE = {"float32": 1e-3, "float16": 4e-3, "bfloat16": 3e-2}
# How much of what a step writes in place the eager step may still change after the replay: rounding moves a tiny
# share of it (a replay fuses or reorders sums), a lost write all of it.
STATE_SHARE = 0.25
# Below this share of a cache's absolute sum, what the eager step still changes is rounding, whatever the step wrote:
# a platform's eager kernels may round otherwise than its captured program (numpy kernels in eager steps, Paddle's
# ops in a static one: 2e-8 of the sum measured), and a step that rewrites the values a slot already holds (a reload's
# same prompt) writes a net nothing, so that its replay's rounding is all that moves. The sum counts the positions
# written so far, not the cache's size: a lost write of one position among N written moves about 1/N of it into a
# zeroed slot, less into a reused one, so a loss is certain to be seen up to about a million positions written when
# the first replay is checked (a capture's first steps, or the first after a reload).
STATE_ROUNDING = 1e-7
SUM_CHUNK = 1 << 22  # elements a state sum widens to float64 at a time (32 MiB)


class CheckedGraphs:
    """A GraphBackend wrapping the platform's: capture and clear pass through; the first replay of each key is also
    run eagerly and compared (once per capture: an extra eager step each, timed in `seconds`)."""

    def __init__(self, inner: GraphBackend, platform: str, namespace: str | None = None) -> None:
        # Two models on one rank (speculative decoding's draft beside the model) share the platform's backend, whose
        # keys are (rows, width): each model's keys carry its namespace, so neither replays the other's program.
        self.inner, self.platform, self.namespace = inner, platform, namespace
        self.mode: str = inner.mode
        self._fns: dict[Hashable, Callable[..., Any]] = {}
        self._unchecked: set[Hashable] = set()
        # Whether a replay's state (what it writes in place) was compared since the last capture was cleared: once is
        # enough (a backend that loses writes loses them for every key), and it reads every cache whole.
        self._state_checked = False
        self.seconds = 0.0

    def _key(self, key: Hashable) -> Hashable:
        return key if self.namespace is None else (self.namespace, key)

    def capture(self, key: Hashable, fn: Callable[..., Any], inputs: Sequence[Any]) -> None:
        self.inner.capture(self._key(key), fn, inputs)
        self._fns[key] = fn
        self._unchecked.add(key)

    def replay(self, key: Hashable, inputs: Sequence[Any]) -> Any:
        if key not in self._unchecked:
            return self.inner.replay(self._key(key), inputs)
        self._unchecked.discard(key)
        state, self._state_checked = not self._state_checked, True
        start = time.perf_counter()
        before = _sums(inputs) if state else []
        self.seconds += time.perf_counter() - start
        out = self.inner.replay(self._key(key), inputs)
        start = time.perf_counter()
        replayed = _sums(inputs) if state else []
        # Eagerly, on the same inputs: its cache writes are the replay's own values at the same slots, so the state
        # moves from `replayed` only where the replay wrote something else (or nothing).
        eager = self._fns[key](*inputs)
        self._compare(key, out, eager)
        if state:
            self._compare_state(key, before, replayed, _sums(inputs))
        self.seconds += time.perf_counter() - start
        return out

    def has(self, key: Hashable) -> bool:
        return self.inner.has(self._key(key))

    def clear(self) -> None:
        self.inner.clear()
        self._fns.clear()
        self._unchecked.clear()
        self._state_checked = False

    def _compare(self, key: Hashable, replayed: Any, eager: Any) -> None:
        import numpy as np

        got, want = _host(replayed), _host(eager)
        dtype = _dtype(eager)
        tolerance = REPLAY_TOLERANCE.get(dtype, REPLAY_TOLERANCE["bfloat16"])
        if got.shape != want.shape:
            raise PlatformError(
                f"platform {self.platform!r}: its graph backend's replay of {key} returned shape {list(got.shape)}, "
                f"the step it replaces {list(want.shape)}; fix its fd_graph_backend, or run with --graph off"
            )
        finite = np.isfinite(want)
        scale = float(np.abs(want[finite]).max()) if finite.any() else 0.0
        error = float(np.abs(got[finite] - want[finite]).max()) if finite.any() else 0.0
        # Where the eager step is not finite (a padding row's, say) the replay need not be either.
        if not np.isfinite(got[finite]).all() or error > tolerance * max(scale, 1.0):
            raise PlatformError(
                f"platform {self.platform!r}: its graph backend's first replay of {key} differs from the eager step "
                f"it replaces (largest difference {error:.3g} at values up to {scale:.3g}): a replay that does not "
                f"compute from its inputs would give wrong tokens; fix its fd_graph_backend, or run with --graph off"
            )


    def _compare_state(self, key: Hashable, before: list[tuple[float, float] | None],
                       replayed: list[tuple[float, float] | None], eager: list[tuple[float, float] | None]) -> None:
        """Each input the step writes in place (the caches) holds after the replay what it holds after the eager step:
        by their sums and absolute sums, what the eager step changed after the replay must be a rounding of what the
        step writes (a lost write changes it by the whole of it)."""
        for index, (b, r, e) in enumerate(zip(before, replayed, eager, strict=True)):
            if b is None or r is None or e is None:
                continue
            written = abs(e[0] - b[0]) + abs(e[1] - b[1])
            left = abs(e[0] - r[0]) + abs(e[1] - r[1])
            if left > STATE_SHARE * written and left > STATE_ROUNDING * max(abs(e[1]), 1.0):
                raise PlatformError(
                    f"platform {self.platform!r}: its graph backend's first replay of {key} did not write the state "
                    f"the eager step writes in place (input {index}, a KV cache: {left:.3g} of the step's "
                    f"{written:.3g} was left to the eager step), so the next steps would read stale keys and values; "
                    f"fix its fd_graph_backend (a replay writes into the tensors it is given), or run with --graph off"
                )


def float_sums(value: Any) -> tuple[float, float]:
    """A tensor's (or an array's) sum and absolute sum, in float64, a slice of SUM_CHUNK elements at a time: a whole KV
    cache widened to float64 at once would need twice its memory. A tensor is reduced where it is (two numbers
    travel); the replay's state check and the engine's cross-rank fingerprint both read it."""
    import numpy as np

    if not (hasattr(value, "astype") and hasattr(value, "numpy")):  # an array: on the host already
        array = np.asarray(value, dtype=np.float64)
        return float(array.sum()), float(np.abs(array).sum())
    flat = value.reshape([-1])
    total = magnitude = 0.0
    for begin in range(0, int(flat.shape[0]), SUM_CHUNK):
        x = flat[begin : begin + SUM_CHUNK].astype("float64")
        total, magnitude = total + float(x.sum().numpy()), magnitude + float(x.abs().sum().numpy())
    return total, magnitude


def _sums(inputs: Sequence[Any]) -> list[tuple[float, float] | None]:
    """Each float tensor input's float_sums (None for the others: ids, positions, tables)."""
    return [float_sums(value) if str(getattr(value, "dtype", "")).replace("paddle.", "") in REPLAY_TOLERANCE
            and hasattr(value, "astype") else None for value in inputs]


def _dtype(value: Any) -> str:
    first = value[0] if isinstance(value, (tuple, list)) else value
    return str(getattr(first, "dtype", "float32")).replace("paddle.", "")


def _host(value: Any) -> Any:
    import numpy as np

    first = value[0] if isinstance(value, (tuple, list)) else value
    array = first.astype("float32").numpy() if hasattr(first, "numpy") else first
    return np.asarray(array, dtype=np.float64)
