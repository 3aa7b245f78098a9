"""A request handed between instances over HTTP (disaggregation): the headers a router sends a prefill instance and a
decode instance, and the prefill instance's answer when it handed the request over.

The router sends both instances the client's request as it came. To the prefill instance it adds `X-FD-KV-Send-To`
(the decode instance's transfer address): the request is prefilled, its first token chosen, its keys and values sent
there, and the answer is `{"fd_handoff": {...}}` with the header `X-FD-Handoff` (or, when the request ended at its
first token, the ordinary answer, streamed or whole as asked). To the decode instance it adds `X-FD-KV-Resume`, that
JSON: the request is decoded from the keys and values received, and the answer is the ordinary one, every token
included."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, Mapping

from fd_core.serve.protocol import ApiError

if TYPE_CHECKING:
    from fd_core.runtime.engine.loop import Completion, KVHandoff

SEND_TO = "x-fd-kv-send-to"
RESUME = "x-fd-kv-resume"
HANDED = "x-fd-handoff"


def handoff_of(headers: Mapping[str, str], transport: str | None) -> "KVHandoff | None":
    """The hand-over a request's headers ask for (None: an ordinary request), checked."""
    from fd_core.runtime.engine.loop import KVHandoff
    from fd_core.runtime.engine.sampling import TokenLogprob

    send_to, resume = headers.get(SEND_TO), headers.get(RESUME)
    if send_to is None and resume is None:
        return None
    if transport is None:
        raise ApiError(400, "this server has no KV transport, so it hands no request over: start it with "
                            "--kv-transport (and --role prefill or decode)", param=SEND_TO if send_to else RESUME)
    if send_to is not None and resume is not None:
        raise ApiError(400, f"a request is handed over ({SEND_TO}) or resumed ({RESUME}), not both", param=RESUME)
    if send_to is not None:
        return KVHandoff(f"h{uuid.uuid4().hex}", send_to=send_to)
    try:
        data = json.loads(resume or "")
        key, tokens = str(data["key"]), tuple(int(t) for t in data["token_ids"])
        logprobs = data.get("logprobs")
        if not tokens:
            raise ValueError("no token_ids")
        shown = None if logprobs is None else tuple(
            TokenLogprob(int(p["token"]), float(p["logprob"]), tuple((int(t), float(v)) for t, v in p.get("top", ())))
            for p in logprobs)
    except (ValueError, KeyError, TypeError) as exc:
        raise ApiError(400, f"{RESUME} is not a hand-over as a prefill instance answers it ({exc}); send its "
                            f"fd_handoff object as JSON", param=RESUME) from None
    return KVHandoff(key, tokens=tokens, logprobs=shown)


def handed_answer(key: str, completion: "Completion") -> dict[str, Any]:
    """The prefill instance's answer for a request it handed over: what the decode instance's X-FD-KV-Resume carries."""
    logprobs = None if completion.logprobs is None else [
        {"token": p.token, "logprob": p.logprob, "top": [list(t) for t in p.top]} for p in completion.logprobs]
    return {"fd_handoff": {"key": key, "token_ids": list(completion.token_ids), "logprobs": logprobs,
                           "prompt_tokens": len(completion.prompt_ids)}}
