"""The exceptions fd raises; each message is one line saying what is wrong and what to do."""

from __future__ import annotations


class FdError(Exception):
    """Base of every error fd reports to a user (the CLI prints it and exits 2)."""


class ConfigError(FdError):
    """A model, parallel or graph setting is invalid."""


class PluginError(FdError):
    """A plugin failed to load, misnamed a hook, or broke the contract."""


class PlatformError(FdError):
    """No usable platform could be selected, or the chosen one cannot serve the request."""


class CheckpointError(FdError):
    """A checkpoint directory or file cannot be loaded as asked."""


class RankError(FdError):
    """A rank of a multi-process run failed; the message names the rank."""


class NumericsError(FdError):
    """Non-finite numbers where a run needs finite ones (weights, an image, logits, a collective's result)."""


class RequestRefused(FdError):
    """A plugin's fd_check_request refused a request before any rank worked on it; the message names the plugin."""


def package_failure(package: str, hook: str, exc: BaseException, kind: type[FdError] = PluginError) -> FdError:
    """A package's own exception from `hook` as one line naming the package and the hook; the whole
    traceback goes to a file that outlives the run, as a rank's does, for whoever must fix the package."""
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix="fd-package-error-", suffix=".traceback")
    with open(fd, "w") as f:
        f.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    text = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return kind(f"model package {package or '(unnamed)'!r}: {hook} raised {detail}; fix the package (its traceback is in {path})")
