"""Tool calling for chat: the OpenAI `tools` checked and handed to the chat template, `tool_choice` "required" or a
named function enforced as a grammar, and the model's tool-call text parsed back into OpenAI's `tool_calls`.

fd parses the tool-call format that Qwen's templates (Qwen3-VL's among them) and other Hermes-style templates teach
the model: each call a JSON object {"name", "arguments"} between <tool_call> and </tool_call>. A template that
renders `tools` but writes calls another way is refused, not guessed at: the calls would come back as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from fd_core.errors import ConfigError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# OpenAI's rule for a function's name.
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
# How many tool names a message lists before "and N more".
SHOWN_NAMES = 5


class ToolError(ConfigError):
    """Tools or a tool choice that cannot be served: a malformed tool, an unknown name, a template without tools."""


def template_calls_tools(template: str) -> bool:
    """Whether a chat template renders `tools` and teaches the <tool_call> JSON format fd parses."""
    return "tools" in template and OPEN in template


@dataclass(frozen=True)
class Tools:
    """A request's checked tools (OpenAI's {"type": "function", "function": {"name", "description", "parameters"}}) and
    its tool choice: "auto", "none", "required", or a function's name."""

    tools: tuple[Mapping[str, Any], ...]
    choice: str
    parallel: bool = True  # False: at most one call (OpenAI's parallel_tool_calls)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def for_template(self) -> list[dict[str, Any]] | None:
        """What the chat template's `tools` variable receives (None: no tools offered, as with choice "none")."""
        if not self.tools or self.choice == "none":
            return None
        return [dict(t) for t in self.tools]

    def grammar(self) -> str | None:
        """The grammar that enforces the choice ("required": one or more calls of any tool; a name: one call of
        it), or None ("auto" and "none" leave the text free)."""
        if self.choice in ("auto", "none"):
            return None
        from fd_core.runtime.text.grammar import JSON_LAYOUT, check_schema_numbers, lark_grammar

        chosen = self.tools if self.choice == "required" else [t for t in self.tools if t["function"]["name"]
                                                              == self.choice]
        definitions: dict[str, Any] = {}
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "arguments": _hoisted(t["function"].get("parameters") or {"type": "object"},
                                                       f"{t['function']['name']}.", definitions)}}
                 for t in chosen]
        schema = {"x-guidance": JSON_LAYOUT, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
        if definitions:
            schema["$defs"] = definitions
        check_schema_numbers(schema, "tools")
        repeat = "+" if self.choice == "required" and self.parallel else ""
        lark = (f'start: call{repeat}\ncall: "{OPEN}\\n" body "\\n{CLOSE}" "\\n"?\n'
                f"body: %json {json.dumps(schema)}")
        return lark_grammar(lark, "tool_choice")

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(the content left once the calls are taken out, None when nothing is left; the calls in OpenAI's
        `tool_calls` form). A block that is not a JSON call of an offered tool stays in the content. The whitespace
        before a call goes with it, and so does the content's trailing whitespace once a call is taken out; the text
        between and after calls stays as written (what ToolStream shows piece by piece adds up to it)."""
        if self.choice == "none" or not self.tools:
            return text, []
        calls: list[dict[str, Any]] = []
        kept: list[str] = []
        at = 0
        for match in _CALL.finditer(text):
            call = _call(match.group(1), self.names)
            if call is None or (calls and not self.parallel):  # past the one call allowed: left as text
                continue
            kept.append(text[at : match.start()].rstrip())
            at = match.end()
            calls.append(call)
        kept.append(text[at:])
        content = "".join(kept).rstrip()
        return (content or None) if calls else text, calls


def _hoisted(parameters: Mapping[str, Any], prefix: str, definitions: dict[str, Any]) -> Any:
    """A tool's parameters schema to nest inside the calls' schema: its `$defs` (or `definitions`) moved into
    `definitions` under names that start with `prefix`, and its `#/$defs/...` references renamed to match (a
    reference resolves from the top of the whole schema, where they now are)."""
    local = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}

    def renamed(value: Any) -> Any:
        if isinstance(value, Mapping):
            out = {}
            for key, item in value.items():
                if key == "$ref" and isinstance(item, str):
                    for root in ("#/$defs/", "#/definitions/"):
                        if item.startswith(root):
                            item = f"#/$defs/{prefix}{item[len(root):]}"
                out[key] = renamed(item)
            return out
        if isinstance(value, list):
            return [renamed(item) for item in value]
        return value

    for name, definition in local.items():
        definitions[f"{prefix}{name}"] = renamed(definition)
    return renamed({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")})


def _call(body: str, names: Sequence[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def listed(names: Iterable[str]) -> str:
    """Names as a message lists them: sorted, the first SHOWN_NAMES, then how many more (a request may offer thousands
    of tools, and the message is one line)."""
    ordered = sorted(names)
    if not ordered:
        return "none"
    more = len(ordered) - SHOWN_NAMES
    return ", ".join(ordered[:SHOWN_NAMES]) + (f" and {more} more" if more > 0 else "")


def check_tools(tools: Any, choice: Any, template: str | None, parallel: bool = True) -> Tools:
    """A request's `tools` and `tool_choice` as OpenAI defines them, checked: a one-line ToolError naming the field
    otherwise. `template` is the checkpoint's chat template (None: it has none); `parallel` False allows one call."""
    tools = list(tools or [])
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
            raise ToolError(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolError(f"tools[{index}].function.name must be 1 to 64 letters, digits, underscores or dashes, "
                            f"got {name!r:.40}")
        if name in seen:
            raise ToolError(f"tools[{index}].function.name {name!r} names a second tool of that name")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ToolError(f"tools[{index}].function.parameters must be a JSON schema object")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if choice.get("type") == "function" and isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}')
        if name not in seen:
            raise ToolError(f"tool_choice names function {name!r:.70}, which is not among tools ({listed(seen)})")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise ToolError(f'tool_choice must be "none", "auto", "required" or a function, got {choice!r:.40}')
    elif choice in ("required", "auto") and not tools:
        raise ToolError(f'tool_choice "{choice}" needs tools to call; send tools, or tool_choice "none"')
    if tools and choice != "none" and (template is None or not template_calls_tools(template)):
        raise ToolError("this checkpoint's chat template defines no tool calls fd can parse (it must render `tools` "
                        f"and write calls as {OPEN} JSON {CLOSE}); drop tools, or send tool_choice \"none\"")
    return Tools(tuple(dict(t) for t in tools), str(choice), parallel)


class ToolStream:
    """Streamed text with tool calls taken out: feed() returns the content that can be shown now (text before the
    first <tool_call>, less any tail that may begin one); finish() parses the rest into content and calls."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.held = ""  # from the first possible <tool_call> on
        self.calling = False

    def feed(self, text: str) -> str:
        if not text:
            return ""
        if self.calling:
            self.held += text
            return ""
        text = self.held + text
        at = text.find(OPEN)
        if at >= 0:
            # The whitespace before a call goes with it: parse() drops it from the content, as the whole answer does.
            shown = text[:at].rstrip()
            self.calling, self.held = True, text[len(shown):]
            return shown
        # A tail that could be the start of <tool_call>, or whitespace that may precede one, waits for the next piece.
        keep = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-n:])), 0)
        shown = text[: len(text) - keep].rstrip()
        self.held = text[len(shown):]
        return shown

    def finish(self) -> tuple[str | None, list[dict[str, Any]]]:
        """(content still to show, None when none; the calls), once the text has ended."""
        if not self.calling:
            rest, self.held = self.held, ""
            return rest or None, []
        content, calls = self.tools.parse(self.held)
        self.held = ""
        return content, calls
