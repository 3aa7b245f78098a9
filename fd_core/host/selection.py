"""Platform selection: each platform's detection, time-bounded and type-checked, then FD_PLATFORM or the highest
priority."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable, Mapping, TypeVar

from fd_core.detection import Detection
from fd_core.errors import PlatformError, PluginError
from fd_core.host.records import PluginRecord, impl_function

# Seconds a plugin's hook may take when called at selection (detection, votes) before fd gives up on it.
HOOK_TIMEOUT_ENV = "FD_HOOK_TIMEOUT"
DEFAULT_HOOK_TIMEOUT = 60.0
# The longest wait fd accepts (FD_HOOK_TIMEOUT, --rank-timeout, --stall-timeout): a week. Python's own
# waits overflow near 1e10 s, and a wait of more than a week is a typo.
MAX_TIMEOUT_S = 7 * 24 * 3600
T = TypeVar("T")


def hook_timeout(env: Mapping[str, str] | None = None) -> float:
    """The time limit for a plugin's hook at selection: FD_HOOK_TIMEOUT seconds, else the default."""
    raw = (os.environ if env is None else env).get(HOOK_TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_HOOK_TIMEOUT
    except ValueError:
        raise PluginError(f"{HOOK_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise PluginError(f"{HOOK_TIMEOUT_ENV}={raw!r} must be a positive, finite number of seconds")
    if value > MAX_TIMEOUT_S:
        raise PluginError(f"{HOOK_TIMEOUT_ENV}={raw!r} is more than a week; give at most {MAX_TIMEOUT_S} seconds")
    return value


def call_bounded(fn: Callable[[], T], timeout: float, what: str) -> T:
    """fn() in a daemon thread; a PluginError naming `what` if it has not returned within `timeout` seconds.

    A plugin's code cannot be interrupted from outside; its thread is left behind and dies with the process.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"fd-hook {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise PluginError(
            f"{what} did not return within {timeout:g} s; fix or uninstall the plugin (FD_PLUGINS can leave it out, "
            f"{HOOK_TIMEOUT_ENV} raises the limit)"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def detect(record: PluginRecord, timeout: float, quiet: bool = False) -> None:
    """Ask the platform's fd_platform_detect (bounded) and keep its answer, or what went wrong, on `record`; a
    failure is warned about unless `quiet` (a plugin already warned about as incompatible)."""

    def warn(message: str) -> None:
        if not quiet:
            print(f"fd: warning: {message}", file=sys.stderr)

    fn = impl_function(record.module, "fd_platform_detect")
    if fn is None:
        record.detect_error = "implements no fd_platform_detect; add one so it can be selected"
        return
    try:
        answer = call_bounded(fn, timeout, f"platform {record.name!r}: fd_platform_detect")
    except PluginError as exc:  # it never returned: not detected, and said so
        record.detect_error = str(exc).split(": ", 1)[1]
        warn(str(exc))
        return
    # A detection that raises (or calls sys.exit) is reported, never fatal.
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        record.detect_error = f"fd_platform_detect raised {type(exc).__name__}: {exc}"
        warn(f"platform {record.name!r}: {record.detect_error}")
        return
    if answer is None:  # the spec allows it: "not my hardware, nothing to say"
        record.detection = Detection(detected=False, reason="fd_platform_detect returned None")
        return
    if not isinstance(answer, Detection):
        record.detect_error = f"fd_platform_detect returned {type(answer).__name__}, expected fd_core.Detection or None"
        warn(f"platform {record.name!r}: {record.detect_error}")
        return
    problem = answer.problem()
    if problem is not None:
        record.detect_error = f"fd_platform_detect returned a Detection with {problem}; fix the plugin"
        warn(f"platform {record.name!r}: {record.detect_error}")
        return
    record.detection = answer


def select_platform(records: list[PluginRecord], env: Mapping[str, str]) -> tuple[str, str]:
    """Pick the platform: FD_PLATFORM if set, else the highest-priority detection; none detected is an error."""
    platforms = [r for r in records if r.kind == "platform" and r.allowed and r.error is None]
    installed = ", ".join(sorted(r.name for r in platforms)) or "none"
    forced = env.get("FD_PLATFORM", "").strip()
    if forced:
        chosen = next((r for r in platforms if r.name == forced), None)
        if chosen is None:
            left_out = next((r for r in records if r.kind == "platform" and r.name == forced and not r.allowed), None)
            if left_out is not None:
                raise PlatformError(
                    f"FD_PLATFORM={forced!r} names a platform that FD_PLUGINS leaves out; add {forced} to FD_PLUGINS "
                    f"or unset one of them"
                )
            raise PlatformError(f"FD_PLATFORM={forced!r} names no installed platform; installed: {installed}")
        if chosen.module is None:
            raise PlatformError(
                f"FD_PLATFORM={forced!r}: that plugin failed to load ({chosen.load_error}); fix or reinstall it"
            )
        if chosen.detection is not None and not chosen.detection.detected:
            # Forcing is allowed (fd explain, the suite's contract checks), but the listing must not read as "ready".
            return forced, (
                f"forced by FD_PLATFORM={forced}; its hardware is not detected here: {chosen.detection.reason}"
            )
        return forced, f"forced by FD_PLATFORM={forced}"
    usable = [r for r in platforms if r.detection is not None and r.detection.detected]
    if not usable:
        raise PlatformError(
            f"no platform detected its hardware; installed: {installed}; set FD_PLATFORM to one of them"
        )
    top = max(r.detection.priority for r in usable)  # type: ignore[union-attr]
    best = [r for r in usable if r.detection.priority == top]  # type: ignore[union-attr]
    if len(best) > 1:
        names = " and ".join(sorted(r.name for r in best))
        raise PlatformError(
            f"platforms {names} both detected their hardware at priority {top}; set FD_PLATFORM to one of them"
        )
    return best[0].name, (
        f"detected with the highest priority ({top}): {best[0].detection.reason}"  # type: ignore[union-attr]
    )
