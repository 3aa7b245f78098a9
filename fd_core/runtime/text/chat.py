"""Chat templates: the checkpoint's Jinja template rendered as transformers renders it, and the image
placeholders it emits expanded to one token per merged block of each picture."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

from fd_core.errors import CheckpointError, ConfigError, in_terms
from fd_core.runtime.files import read_text
from fd_core.runtime.text.tokenizer import JsonReader, read_json

# Largest chat_template.jinja fd reads (published templates are a few kilobytes).
MAX_TEMPLATE_BYTES = 1 << 20


def find_chat_template(directory: str | Path, read: JsonReader = read_json) -> tuple[str, Path] | None:
    """The chat template of a checkpoint and the file holding it: chat_template.jinja, chat_template.json, or
    tokenizer_config.json."""
    path = Path(directory)
    if os.path.lexists(path / "chat_template.jinja"):
        return (
            read_text(path / "chat_template.jinja", str(path / "chat_template.jinja"), MAX_TEMPLATE_BYTES),
            path / "chat_template.jinja",
        )
    for name in ("chat_template.json", "tokenizer_config.json"):
        template = read(path / name).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if isinstance(template, str):
            return template, path / name
        if template is not None:
            raise CheckpointError(f"{path / name}: chat_template must be a string or a list of named templates")
    return None


def load_chat_template(directory: str | Path, read: JsonReader = read_json) -> str | None:
    """The chat template of a checkpoint (chat_template.jinja, chat_template.json, or tokenizer_config.json's), if
    any."""
    found = find_chat_template(directory, read)
    return None if found is None else found[0]


def _raise(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def user_message(text: str, images: int = 0) -> dict[str, Any]:
    """A user turn: plain text, or (with pictures) one image part per picture followed by the text, as VL templates
    expect."""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": text}]}


# A chat template is checkpoint data, so it renders in jinja's sandbox with bounds a template cannot pass:
# this long at most (published templates take milliseconds), and no string, sequence or output beyond
# this many characters (a prompt longer than any context is refused later anyway).
RENDER_SECONDS = 5.0
MAX_RENDER_CHARS = 8 << 20
# Exponents above this (with a base other than -1, 0, 1) are refused before Python computes them: a huge
# power is one C call that no deadline interrupts.
MAX_EXPONENT = 4096


class _Overrun(BaseException):
    """Raised inside a rendering thread by its watchdog; a BaseException, so that no `except Exception` in jinja keeps
    it."""


class _TooLarge(Exception):
    """A value or output of the template beyond MAX_RENDER_CHARS, or a number it would take too long to compute."""


class _Deadline:
    """Interrupts the calling thread with _Overrun after `seconds` (CPython's asynchronous exception), and again
    every 50 ms until stopped: one that lands in a finaliser run mid-render is swallowed there, the next is not.

    Template code is Python bytecode, so the exception lands between two of its steps, whatever loop it is in.
    """

    def __init__(self) -> None:
        import threading

        self.thread = threading.get_ident()
        self.lock = threading.Lock()
        self.done = self.fired = False
        self.stopped = threading.Event()

    def start(self, seconds: float) -> None:
        """Arm: called inside the try whose finally calls stop(), so that a watch once started is always stopped."""
        import threading

        threading.Thread(target=self._watch, args=(seconds,), name="fd-chat-template-deadline", daemon=True).start()

    def _watch(self, seconds: float) -> None:
        import ctypes

        wait = seconds
        while not self.stopped.wait(wait):
            with self.lock:
                if self.done:
                    return
                self.fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread), ctypes.py_object(_Overrun))
            wait = 0.05

    def stop(self) -> None:
        """Disarm; an interruption set but not yet delivered is withdrawn, so none lands after this returns."""
        import ctypes

        with self.lock:
            self.done = True
            if self.fired:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread), None)
        self.stopped.set()


def _render(env: Any, template: str, variables: Mapping[str, Any]) -> str:
    """The template rendered within RENDER_SECONDS (else _Overrun) and MAX_RENDER_CHARS of output (else _TooLarge)."""
    deadline = _Deadline()
    try:
        deadline.start(RENDER_SECONDS)
        out: list[str] = []
        length = 0
        for piece in env.from_string(template).generate(**variables):
            length += len(piece)
            if length > MAX_RENDER_CHARS:
                raise _TooLarge(f"its output passes {MAX_RENDER_CHARS} characters")
            out.append(piece)
        return "".join(out)
    finally:
        # Until stop() has run, another interruption may land, here too; once it has, none can.
        while True:
            try:
                deadline.stop()
                break
            except _Overrun:
                pass


def _kind(value: Any, length: int) -> str:
    return f"a string of {length} characters" if isinstance(value, str) else f"a sequence of {length} items"


def _size(value: Any) -> Any:
    """`value` if it is not a string or sequence longer than MAX_RENDER_CHARS."""
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_RENDER_CHARS:
        raise _TooLarge(f"it makes {_kind(value, len(value))} (fd allows {MAX_RENDER_CHARS})")
    return value


def _bounded_call(function: Any) -> Any:
    """A filter whose size arguments and result are bounded (`center(10**10)` would allocate first and fail later)."""
    import functools

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        _no_huge_numbers(args, kwargs)
        return _size(function(*args, **kwargs))

    return call


def _no_huge_numbers(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDER_CHARS:
            raise _TooLarge(f"it asks for a size of {value} (fd allows {MAX_RENDER_CHARS})")


def _environment() -> Any:
    """The environment transformers renders chat templates in, with every way a template makes a large value bounded."""
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_Concat(self, node: Any, frame: Any) -> None:  # `a ~ b`: its result checked, as the operators' are
            self.write("environment.bounded(")
            super().visit_Concat(node, frame)
            self.write(")")

    class Environment(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
            if (
                op == "**"
                and isinstance(right, int)
                and right > MAX_EXPONENT
                and isinstance(left, (int, float))
                and abs(left) > 1
            ):
                raise _TooLarge(f"it raises a number to the power {right} (fd allows {MAX_EXPONENT})")
            if op == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
                left, right = right, left
            if (
                op == "*"
                and isinstance(left, (str, list, tuple))
                and isinstance(right, int)
                and len(left) * right > MAX_RENDER_CHARS
            ):
                raise _TooLarge(
                    f"it makes {_kind(left, len(left) * right)} by repetition (fd allows {MAX_RENDER_CHARS})"
                )
            return _size(super().call_binop(context, op, left, right))

        # Jinja's own signature.
        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _no_huge_numbers(args, kwargs)
            return _size(super().call(__context, __obj, *args, **kwargs))

        @staticmethod
        def bounded(value: Any) -> Any:
            return _size(value)

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_call(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def given_chars(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> int:
    """The characters of text a conversation hands a chat template: its messages' text (a string content, text parts,
    earlier tool calls as JSON) and its tools as JSON."""
    total = len(json.dumps(list(tools), default=str)) if tools else 0
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, (list, tuple)):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, Mapping) and isinstance(part.get("text"), str))
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if calls:
            total += len(json.dumps(calls, default=str))
    return total


def render_chat(
    template: str, messages: Sequence[Mapping[str, Any]], special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True, source: str | Path | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The conversation as the model's prompt text, `tools` (OpenAI's function definitions) offered to the template as
    transformers offers them; a template that fails, loops or grows without bound is a one-line ConfigError (naming
    `source`, the file the template came from, when given)."""
    from jinja2 import TemplateError

    given = given_chars(messages, tools)
    if given > MAX_RENDER_CHARS:
        # The caller's text is at fault, not the template: said so before rendering, which would fail on its size
        # (naming the template's file, which a client of fd serve has no use for).
        what = "the messages and tools hold" if tools else "the messages hold"
        raise ConfigError(f"{what} {given} characters of text, more than the {MAX_RENDER_CHARS} fd renders through a "
                          f"chat template; shorten them")
    # A client of fd serve is told neither where the server keeps the template nor to fix what it cannot.
    where = "the chat template" if source is None else f"the chat template in {source}"
    what = in_terms(where, where, http="the model's chat template")
    repair = "fix the template" if source is not None else "fix the checkpoint's chat template"
    fix = in_terms(repair, repair, http="the chat template is at fault: tell the server's operator")
    variables = {"messages": list(messages), "add_generation_prompt": add_generation_prompt,
                 "tools": list(tools) if tools else None,
                 "documents": None, **special_tokens}
    try:
        return _render(_environment(), template, variables)
    except _Overrun:
        raise ConfigError(
            f"{what} did not finish rendering within {RENDER_SECONDS:g} s (a loop without end?); {fix}"
        ) from None
    except TemplateError as exc:
        raise ConfigError(f"{what} failed to render: {exc}".replace("\n", " ")) from None
    except _TooLarge as exc:
        # Within the bound on what it was given, the template made more of it: the client may still send less.
        less = "shorten the messages (if they are short, the chat template is at fault: tell the server's operator)"
        raise ConfigError(f"{what} failed to render: {exc}; {in_terms(repair, repair, http=less)}") from None
    except RecursionError:
        raise ConfigError(f"{what} failed to render: it recurses without end; {fix}") from None
    except MemoryError:
        raise ConfigError(f"{what} failed to render: it ran out of memory; {fix}") from None
    except Exception as exc:  # noqa: BLE001 - whatever the template's own code raises is the template's error
        detail = " ".join(str(exc).split()) or "no message"
        raise ConfigError(f"{what} failed to render: {exc.__class__.__name__}: {detail}; {fix}") from None


def expand_placeholders(ids: Sequence[int], token_id: int, counts: Sequence[int]) -> list[int]:
    """Each lone image placeholder replaced by `counts[k]` copies for the k-th picture, as the reference processors do.

    A prompt whose placeholders do not number one per picture (already expanded, say) is returned as it
    is: the model's prompt check then says what is wrong.
    """
    ids = list(ids)
    if sum(1 for t in ids if t == token_id) != len(counts):
        return ids
    out: list[int] = []
    pictures = iter(counts)
    for token in ids:
        out += [token] * (next(pictures) if token == token_id else 1)
    return out
