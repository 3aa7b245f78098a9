"""Stand-ins that record the device calls of hardware-only plugins (cuda, iluvatar) on a CPU machine."""

from __future__ import annotations

from typing import Any


class Recorder:
    """Callable that records each call's arguments and returns `result` (or its first argument)."""

    def __init__(self, name: str, log: list[tuple[str, tuple[Any, ...], dict[str, Any]]], result: Any = "first-arg") -> None:
        self.name, self.log, self.result = name, log, result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.log.append((self.name, args, kwargs))
        if self.result == "first-arg":
            return args[0] if args else None
        return self.result


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
