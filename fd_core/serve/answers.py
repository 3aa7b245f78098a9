"""A request's answer in the OpenAI format: the whole answer once every generation is done, each choice's (or chunk's)
logprobs in its endpoint's shape, and a completion's echoed prompt."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from fd_core.serve.protocol import FINISH_REASONS, TextOffsets, TokenText, usage
from fd_core.serve.submissions import Generation

if TYPE_CHECKING:
    from fd_core.runtime.engine.sampling import TokenLogprob
    from fd_core.runtime.text.tools import Tools


def choice_logprobs(
    tokens: TokenText, chat: bool, logprobs: "Sequence[TokenLogprob] | None", offsets: TextOffsets | None = None
) -> dict[str, Any] | None:
    """A choice's (or a chunk's) logprobs in its endpoint's shape; None when the request asked for none."""
    if logprobs is None:
        return None
    if chat:
        return tokens.chat(logprobs)
    return tokens.completion(logprobs, offsets or TextOffsets(tokens))


def echo(tokens: TokenText, generation: Generation, echoes: Sequence[str], logprobs: bool, offsets: TextOffsets,
         ) -> tuple[str, dict[str, Any] | None]:
    """A completion choice's echoed prompt: its text, and, asked for, its tokens' logprobs (which move `offsets`
    past it)."""
    text = echoes[generation.prompt]
    if not logprobs:
        return text, None
    s = generation.submission
    scored = s.prompt_logprobs if s.prompt_logprobs is not None else [None] * len(s.prompt_ids)
    return text, tokens.prompt(s.prompt_ids, scored, offsets)


def whole(
    name: str, tokens: TokenText, generations: Sequence[Generation], ident: str, created: int, chat: bool,
    logprobs: bool = False, tools: "Tools | None" = None, echoes: Sequence[str] | None = None, scoring: bool = False,
) -> dict[str, Any]:
    """The whole answer; `scoring` (echo with max_tokens 0): each choice is its prompt alone, with its logprobs, and
    the token the engine chose after it is not shown (nor counted)."""
    choices: list[dict[str, Any]] = []
    prompt_tokens = completion_tokens = 0
    counted: set[int] = set()
    for g in generations:
        c = g.completion
        assert c is not None
        if g.prompt not in counted:  # a prompt's n choices count its tokens once, as OpenAI's usage does
            counted.add(g.prompt)
            prompt_tokens += len(c.prompt_ids)
        completion_tokens += 0 if scoring else len(c.token_ids)
        reason = "length" if scoring else FINISH_REASONS.get(c.finish_reason, c.finish_reason)
        # Echoed, the answer's logprobs are shown after the prompt's, their offsets going on (below).
        shown = choice_logprobs(tokens, chat, c.logprobs if logprobs and echoes is None else None)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text or ""}
            if tools is not None:
                content, calls = tools.parse(c.text or "")
                message["content"] = content
                if calls:  # OpenAI's answer when the model called tools (and was not cut by max_tokens)
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append({"index": g.index, "message": message, "logprobs": shown, "finish_reason": reason})
        elif echoes is not None:
            offsets = TextOffsets(tokens)
            text, echoed = echo(tokens, g, echoes, logprobs, offsets)
            if scoring:
                shown = echoed
            else:
                shown = None if echoed is None else joined(echoed, choice_logprobs(tokens, chat, c.logprobs, offsets))
                text += c.text or ""
            choices.append({"index": g.index, "text": text, "logprobs": shown, "finish_reason": reason})
        else:
            choices.append({"index": g.index, "text": c.text or "", "logprobs": shown, "finish_reason": reason})
    return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": name, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def joined(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two runs of completions' logprobs (each list field) one after the other."""
    return {key: list(values) + list((then or {}).get(key, [])) for key, values in first.items()}
