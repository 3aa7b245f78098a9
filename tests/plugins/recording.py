"""Stand-ins that record the device calls of hardware-only plugins (cuda, iluvatar) on a CPU machine.

Every recorder is bound to the installed Paddle's real function: a call the real function would
refuse (an unknown keyword, a missing argument) fails the test as it would fail on the device.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable


class Recorder:
    """Callable that checks each call against `real`'s signature, records it,
    and returns `result` (or its first argument)."""

    def __init__(
        self, name: str, log: list[tuple[str, tuple[Any, ...], dict[str, Any]]], result: Any = "first-arg", *,
        real: Callable[..., Any]
    ) -> None:
        self.name, self.log, self.result = name, log, result
        self.signature = inspect.signature(real)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.signature.bind(*args, **kwargs)  # TypeError, as the real function would raise
        self.log.append((self.name, args, kwargs))
        if isinstance(self.result, str) and self.result == "first-arg":
            return args[0] if args else None
        return self.result


def substitute(
    monkeypatch: Any, owner: Any, name: str, log: list, result: Any = "first-arg", label: str | None = None,
) -> Recorder:
    """Replace `owner.name` by a Recorder bound to the real `owner.name`, logging calls as `label` (default: `name`)."""
    recorder = Recorder(label or name, log, result, real=getattr(owner, name))
    monkeypatch.setattr(owner, name, recorder)
    return recorder


class FakeCUDAGraph:
    """Records capture_begin / capture_end / replay / reset in place of paddle's CUDAGraph."""

    log: list[str] = []

    def __init__(self, place: Any = None, mode: str = "thread_local", pool_id: Any = None) -> None:
        FakeCUDAGraph.log.append("init")

    def capture_begin(self) -> None:
        FakeCUDAGraph.log.append("capture_begin")

    def capture_end(self) -> None:
        FakeCUDAGraph.log.append("capture_end")

    def replay(self) -> None:
        FakeCUDAGraph.log.append("replay")

    def reset(self) -> None:
        FakeCUDAGraph.log.append("reset")
