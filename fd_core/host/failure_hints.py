"""A failed step's Paddle message read for its likely cause, once it failed (the hot path pays nothing): a kernel that
returned another dtype than it was given, or a dtype the platform claims but Paddle cannot run here."""

from __future__ import annotations

import os
import re
import traceback
from typing import TYPE_CHECKING

from fd_core.error_lines import informative_line
from fd_core.errors import setting
from fd_core.kernels import OPS

if TYPE_CHECKING:
    from fd_core.host.backend import Backend

# Paddle's "no kernel for this dtype": "... of kernel `matmul` is not registered. Selected wrong DataType `bfloat16`".
_NOT_REGISTERED = re.compile(r"kernel `(\w+)` is not registered\. Selected wrong DataType `(\w+)`")
# Paddle's ways of saying two tensors of one op differ in dtype (eager and static graphs, kernels and the API).
_MISMATCH = re.compile(
    r"data ?type of .*(?:must be (?:the )?same|isn't consistent|is not consistent)|type of data .*does not match"
    r"|must have the same data ?type|dtype.* (?:does not match|mismatch)", re.IGNORECASE)
_DTYPES = ("bfloat16", "float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool")
# A frame a static-graph report lists in its message.
_FILE_LINE = re.compile(r'File "([^"]+)", line \d+, in (\w+)')
_NATIVE_OPS = os.path.join("fd_core", "native_ops.py")


def dtype_hint(exc: BaseException, backend: Backend, dtype: str) -> str | None:
    """What a step's failure likely means when Paddle's message is about a dtype, and its fix, in a run computing in
    `dtype` on `backend`; None for any other failure."""
    # The error itself, not a static-graph report's source lines (which name dtypes of their own).
    text = informative_line(str(exc)) or ""
    platform = backend.platform
    check = f"run fd check {platform}"
    missing = _NOT_REGISTERED.search(text)
    if missing is not None and missing.group(2) == dtype:
        op, claimed = missing.group(1), backend.detection.dtypes
        others = [d for d in claimed if d != dtype] or ["float32"]
        claim = (f", yet platform {platform!r} claims {dtype} (Detection.dtypes={tuple(claimed)})"
                 if dtype in claimed else "")
        return (f"Paddle has no {dtype} {op} here{claim}; pass {setting('dtype', others[0])}, or {check} and drop "
                f"from its Detection.dtypes what it cannot run")
    if missing is None and not _MISMATCH.search(text):
        return None
    found = [d for d in _DTYPES if re.search(rf"\b{d}\b", text) and d != dtype]
    what = f"a {found[0]} tensor" if len(found) == 1 else "a tensor of another dtype"
    where = _failed_in(exc, backend) or "a Paddle op"
    return (f"{what} reached {where} in a {dtype} run: likely a kernel returning another dtype than it was given "
            f"({_suspects(backend)}); {check}")


def _failed_in(exc: BaseException, backend: Backend) -> str | None:
    """The op the failure happened in (its kernel's or the native function, innermost first), if a frame shows it."""
    frames = [(f.f_code.co_filename, f.f_code.co_name) for f, _ in traceback.walk_tb(exc.__traceback__)]
    frames += _FILE_LINE.findall(str(exc))  # a static-graph report's frames: the Python traceback ends at the replay
    kernels = {}
    for op in OPS:
        kernel = backend.kernels.chosen(op)
        code = getattr(kernel.fn, "__code__", None) if kernel is not None else None
        if kernel is not None and code is not None:
            kernels[(code.co_filename, code.co_name)] = f"{op} (the kernel of plugin {kernel.plugin!r})"
    for filename, function in reversed(frames):
        if (filename, function) in kernels:
            return kernels[(filename, function)]
        if filename.endswith(_NATIVE_OPS) and function in OPS:
            return f"the native {function}"
    return None


def _suspects(backend: Backend) -> str:
    """The ops served by plugins' kernels, an extension's first, by plugin: where a wrong dtype comes from."""
    by_plugin: dict[str, list[str]] = {}
    for op, plugin in backend.kernels.providers().items():
        if backend.kernels.chosen(op) is not None:
            by_plugin.setdefault(plugin, []).append(op)
    if not by_plugin:
        return f"every op runs fd's native kernel: the dtypes platform {backend.platform!r} claims are the suspect"
    order = sorted(by_plugin, key=lambda p: (p == backend.platform, p))
    return "kernels of plugins in use: " + "; ".join(f"{', '.join(by_plugin[p])} from {p!r}" for p in order)
