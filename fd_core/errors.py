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
