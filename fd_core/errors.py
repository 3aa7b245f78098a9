"""The exceptions fd raises; each message is one line saying what is wrong and what to do."""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator


class FdError(Exception):
    """Base of every error fd reports to a user (the CLI prints it and exits 2)."""


class ConfigError(FdError):
    """A model, parallel or graph setting is invalid."""


class PluginError(FdError):
    """A plugin failed to load, misnamed a hook, or broke the contract."""


class KernelMismatch(PluginError):
    """A plugin's kernel gave another result than fd's native op in the kernel canary a rank runs before its first
    request; the message names the plugin, the op, the case and its error."""


class PlatformError(FdError):
    """No usable platform could be selected, or the chosen one cannot serve the request."""


class CheckpointError(FdError):
    """A checkpoint directory or file cannot be loaded as asked."""


class RankError(FdError):
    """A rank of a multi-process run failed; the message names the rank."""


class NumericsError(FdError):
    """Non-finite numbers where a run needs finite ones (weights, an image, logits, a collective's result)."""


class SequenceError(FdError):
    """One sequence failed while the engine handled it alone (its grammar, bias, scoring or pictures) and ended with
    this error; every other sequence of the step went on. `request_fault`: what the request asked for is at fault."""

    def __init__(self, message: str, request_fault: bool = False) -> None:
        super().__init__(message)
        self.request_fault = request_fault

    def __reduce__(self) -> tuple[type, tuple[str, bool]]:
        return type(self), (str(self), self.request_fault)


class RequestRefused(FdError):
    """A plugin's fd_check_request refused a request before any rank worked on it; the message names the plugin."""


def package_failure(package: str, hook: str, exc: BaseException, kind: type[FdError] = PluginError) -> FdError:
    """A package's own exception from `hook` as one line naming the package and the hook; the whole
    traceback goes to a file that outlives the run, as a rank's does, for whoever must fix the package."""
    import tempfile
    import traceback

    from fd_core.error_lines import error_line

    fd, path = tempfile.mkstemp(prefix="fd-package-error-", suffix=".traceback")
    with open(fd, "w") as f:
        f.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    detail = error_line(exc)  # the informative line of a multi-line message (Paddle's)
    return kind(
        f"model package {package or '(unnamed)'!r}: {hook} raised {detail}; "
        f"fix the package (its traceback is in {path})"
    )


# How a message names a setting the caller passed: as the command line's flag when fd's command line started
# this process (it sets FD_SETTINGS_STYLE=cli for itself and its ranks), else as the Python API's keyword; as the
# request's field while the HTTP server checks a request (speaking("http"), below).
SETTINGS_STYLE_ENV = "FD_SETTINGS_STYLE"
_FLAGS = {"max_new_tokens": "--max-new-tokens", "images": "--image", "prompts": "--prompt"}
# The Python object each keyword belongs to (the rest are LLM's).
_OWNERS = {"max_new_tokens": "SamplingParams", "stop": "SamplingParams", "temperature": "SamplingParams",
           "top_p": "SamplingParams", "top_k": "SamplingParams", "images": "LLM.generate", "chat": "LLM.generate"}
# The OpenAI request fields that carry a setting; the others are the server's own flags, which its operator typed.
_FIELDS = {"max_new_tokens": "max_tokens", "images": "the image_url parts", "prompts": "prompt", "stop": "stop",
           "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"}
# Per request rather than per process: `fd serve` was started by the command line, but what it tells a client must be
# in the client's terms (fields of the request, no path on the server). A context variable, so that the worker threads
# a request's checks run in (asyncio.to_thread copies the context) speak as the request does and nothing else does.
_STYLE: contextvars.ContextVar[str | None] = contextvars.ContextVar("fd_settings_style", default=None)
STYLES = ("cli", "python", "http")
_UNSET = object()


def style() -> str:
    """Whose terms messages are in: "http" (a client of fd serve), "cli" (fd's command line) or "python"."""
    return _STYLE.get() or ("cli" if os.environ.get(SETTINGS_STYLE_ENV) == "cli" else "python")


@contextlib.contextmanager
def speaking(terms: str) -> Iterator[None]:
    """Messages raised inside (in this context, and the threads it is copied to) are in `terms`, one of STYLES."""
    assert terms in STYLES, terms
    token = _STYLE.set(terms)
    try:
        yield
    finally:
        _STYLE.reset(token)


def setting(name: str, value: object = _UNSET) -> str:
    """`name` (a keyword of the Python API, such as "memory_fraction"), with `value` if given, as the caller spelled it:
    "--memory-fraction 2" on the command line, "LLM(memory_fraction=2)" from Python, "max_tokens: 2" for a request's
    field over HTTP (a setting that is no request field is the server's flag there)."""
    shown = f"{value:g}" if isinstance(value, float) else repr(value) if isinstance(value, str) else str(value)
    terms = style()
    if terms == "http" and name in _FIELDS:
        return _FIELDS[name] if value is _UNSET else f"{_FIELDS[name]}: {shown}"
    if terms != "python":
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        return flag if value is _UNSET else f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
    owner = _OWNERS.get(name, "LLM")
    return f"{owner}({name}=...)" if value is _UNSET else f"{owner}({name}={shown})"


def install_hint(extras: str) -> str:
    """The one way fd says how to install an extra (fd-backends is installed from a checkout, not a package index)."""
    return f"pip install '.[{extras}]' in a checkout of fd-backends (docs/install.md)"


def in_terms(cli: str, python: str, http: str | None = None) -> str:
    """`cli` when fd's command line started this process, `http` while fd serve checks a client's request (`cli`
    without one: the server's operator typed it), else `python`: a fix phrased in what the caller typed."""
    terms = style()
    if terms == "http" and http is not None:
        return http
    return python if terms == "python" else cli
