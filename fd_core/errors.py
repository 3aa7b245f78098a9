"""The exceptions fd raises; each message is one line saying what is wrong and what to do."""

from __future__ import annotations

import os


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
    return kind(
        f"model package {package or '(unnamed)'!r}: {hook} raised {detail}; "
        f"fix the package (its traceback is in {path})"
    )


# How a message names a setting the caller passed: as the command line's flag when fd's command line started
# this process (it sets FD_SETTINGS_STYLE=cli for itself and its ranks), else as the Python API's keyword.
SETTINGS_STYLE_ENV = "FD_SETTINGS_STYLE"
_FLAGS = {"max_new_tokens": "--max-new-tokens", "images": "--image", "prompts": "--prompt"}
# The Python object each keyword belongs to (the rest are LLM's).
_OWNERS = {"max_new_tokens": "SamplingParams", "stop": "SamplingParams", "temperature": "SamplingParams",
           "top_p": "SamplingParams", "top_k": "SamplingParams", "images": "LLM.generate", "chat": "LLM.generate"}
_UNSET = object()


def setting(name: str, value: object = _UNSET) -> str:
    """`name` (a keyword of the Python API, such as "memory_fraction"), with `value` if given, as the caller spelled it:
    "--memory-fraction 2" on the command line, "LLM(memory_fraction=2)" from Python."""
    shown = f"{value:g}" if isinstance(value, float) else repr(value) if isinstance(value, str) else str(value)
    if os.environ.get(SETTINGS_STYLE_ENV) == "cli":
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        return flag if value is _UNSET else f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
    owner = _OWNERS.get(name, "LLM")
    return f"{owner}({name}=...)" if value is _UNSET else f"{owner}({name}={shown})"


def install_hint(extras: str) -> str:
    """The one way fd says how to install an extra (fd-backends is installed from a checkout, not a package index)."""
    return f"pip install '.[{extras}]' in a checkout of fd-backends (docs/install.md)"


def in_terms(cli: str, python: str) -> str:
    """`cli` when fd's command line started this process, else `python`: a fix phrased in what the caller typed."""
    return cli if os.environ.get(SETTINGS_STYLE_ENV) == "cli" else python
