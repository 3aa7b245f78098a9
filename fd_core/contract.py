"""The contract's version: what a plugin written for one version may count on, and how a change is made.

`CONTRACT_VERSION` is "MAJOR.MINOR". It covers the hook specs and their arguments, the named ops with their
semantics, dtypes and tolerances, `Detection`, `Capabilities`, `GraphVote`, `Architecture` and its fields, the
`ModelConfig` keys the shared layers read, `KVBatch` and the model protocol the runtime calls, and the conformance
suites' classes and fixtures. Adding is a minor; removing or changing a meaning is a major; a deprecated form keeps
working for at least one minor, with one DeprecationWarning naming its replacement and the version that drops it.

A plugin module says which version it was written for in `FD_CONTRACT = "X.Y"` (beside `FD_CAPABILITIES`); none
said is the first version. A plugin of another major is incompatible: it is skipped with a warning (never registered),
and refused only when it is the platform a run selects; a newer minor than this fd knows loads with a warning.
"""

from __future__ import annotations

import re
import warnings

CONTRACT_VERSION = "1.9"
FIRST_VERSION = "1.0"
_VERSION = re.compile(r"^(\d+)\.(\d+)$")
_warned: dict[str, str] = {}


def parse_version(text: object) -> tuple[int, int] | None:
    """(major, minor) of "X.Y", None when `text` is not one."""
    match = _VERSION.match(text) if isinstance(text, str) else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def declared_contract(module: object) -> tuple[str, bool]:
    """The version `module` declares in FD_CONTRACT (and True), or the first version (and False)."""
    declared = getattr(module, "FD_CONTRACT", None)
    return (FIRST_VERSION, False) if declared is None else (declared, True)


def contract_problem(plugin: str, declared: object) -> str | None:
    """Why `declared` is no contract version (the plugin is broken: every run refuses it), else None."""
    if parse_version(declared) is None:
        return (f"plugin {plugin!r}: FD_CONTRACT = {declared!r} is not a contract version; write it as "
                f"\"MAJOR.MINOR\", the version of fd's contract the plugin was written for (this fd's is "
                f"{CONTRACT_VERSION})")
    return None


def contract_mismatch(plugin: str, declared: object) -> str | None:
    """Why a plugin declaring another major cannot run on this fd, and the fix ("it was written for ..."), else None."""
    version, ours = parse_version(declared), parse_version(CONTRACT_VERSION)
    if version is None or ours is None or version[0] == ours[0]:
        return None
    return (f"it was written for fd's contract {declared}, and this fd-backends has contract {CONTRACT_VERSION}; "
            f"install an fd-backends with contract {version[0]}.x, or a release of {plugin!r} written for {ours[0]}.x")


def contract_warning(plugin: str, declared: object) -> str | None:
    """A one-line warning when a plugin declares a newer minor than this fd knows, else None."""
    version, ours = parse_version(declared), parse_version(CONTRACT_VERSION)
    if version is None or ours is None or version[0] != ours[0] or version[1] <= ours[1]:
        return None
    return (f"plugin {plugin!r} was written for fd's contract {declared}, newer than this fd-backends' "
            f"{CONTRACT_VERSION}: what it uses of {declared} is not here; upgrade fd-backends")


def deprecated(what: str, replacement: str, removed_in: str, stacklevel: int = 2) -> None:
    """One DeprecationWarning per process for `what` (use `replacement`; `what` goes in contract `removed_in`),
    pointing at the caller `stacklevel` frames up from the caller of this function, and kept for `deprecations()`."""
    if what in _warned:
        return
    _warned[what] = (f"{what} is deprecated in fd's contract {CONTRACT_VERSION}: use {replacement}; it is removed in "
                     f"contract {removed_in}")
    warnings.warn(_warned[what], DeprecationWarning, stacklevel=stacklevel + 1)


def deprecations() -> list[str]:
    """Every deprecation this process has met so far, once each (`fd check` lists them under its verdict)."""
    return list(_warned.values())
