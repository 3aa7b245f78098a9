"""The Python API: a model loaded on its ranks (a Session), generating text for lists of prompts, streaming, and
reporting its platform, graph decision and timings."""

from __future__ import annotations

import dataclasses
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from fd_core.config import DEFAULT_GRAMMAR_TIMEOUT_S, ParallelConfig
from fd_core.errors import ConfigError, RankError
from fd_core.graphs import CastVote, GraphDecision
from fd_core.host.backend import Backend
from fd_core.host.loading import load_plugins
from fd_core.host.paddle_logs import quiet_paddle_logs
from fd_core.runtime.engine.loop import Completion, KVHandoff, jobs_of
from fd_core.runtime.engine.sampling import SamplingParams
from fd_core.runtime.engine.scheduler import Submission
from fd_core.runtime.handoff import Handoff
from fd_core.runtime.images import load_image
from fd_core.runtime.memory import DEFAULT_MEMORY_FRACTION
from fd_core.runtime.plan import RunConfig, plan_run, plugin_env
from fd_core.runtime.ranks.spawn import DEFAULT_STALL_S
from fd_core.runtime.request import Request, build_request, messages_prompt
from fd_core.runtime.session import Session

if TYPE_CHECKING:
    from fd_core.runtime.text.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    """A checkpoint (or an architecture's tiny preset) loaded on `tp` ranks and ready to generate.

    With tp > 1 the ranks are processes started here and kept until `close()` (use it as a context
    manager); a rank that fails stops the others and the call raises RankError naming it, as `fd run`
    does. Everything is checked before a process starts.
    """

    def __init__(
        self, checkpoint: str | Path | None = None, *, model: str | None = None, tp: int = 1,
        platform: str | None = None, dtype: str | None = None, graph: str = "auto", seed: int = 0,
        max_batch: int | None = None,
        progress: bool = False, rank_timeout: float = 30.0, memory_fraction: float = DEFAULT_MEMORY_FRACTION,
        stall_timeout: float = DEFAULT_STALL_S, threads: int | None = None, kv_block_size: int | None = None,
        kv_cache_blocks: int | None = None, prefix_caching: bool = True,
        max_prefill_tokens: int | None = None, max_prefill_prompts: int | None = None,
        quantization: str | None = None, quantization_group: int | None = None, float_embeddings: bool = False,
        grammar_timeout: float = DEFAULT_GRAMMAR_TIMEOUT_S,
        kernel_canary: bool = True, speculative: str | None = None, num_speculative_tokens: int | None = None,
        draft_checkpoint: str | Path | None = None, kv_transport: str | None = None, kv_listen: str | None = None,
        kv_timeout: float = 30.0,
    ) -> None:
        quiet_paddle_logs()  # before paddle is imported: its C++ logs stay off the caller's terminal
        if graph not in ("auto", "off", "on"):
            raise ConfigError(f"graph must be 'auto', 'off' or 'on', got {graph!r}")
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        run = RunConfig(model=model or "", tp=tp, checkpoint=self.checkpoint, dtype=dtype, graph=graph, seed=seed,
                        max_batch=max_batch, progress=progress, platform=platform, memory_fraction=memory_fraction,
                        threads=threads, kv_block_size=kv_block_size, kv_cache_blocks=kv_cache_blocks,
                        prefix_caching=bool(prefix_caching), max_prefill_tokens=max_prefill_tokens,
                        max_prefill_prompts=max_prefill_prompts, quantization=quantization,
                        quantization_group=quantization_group, float_embeddings=bool(float_embeddings),
                        grammar_timeout=grammar_timeout, kernel_canary=bool(kernel_canary), speculative=speculative,
                        num_speculative_tokens=num_speculative_tokens,
                        draft_checkpoint=None if draft_checkpoint is None else str(draft_checkpoint),
                        kv_transport=kv_transport, kv_listen=kv_listen, kv_timeout=kv_timeout)
        self._plugins = load_plugins(plugin_env(platform))
        self._backend = Backend(self._plugins)
        # The plan's request is a placeholder: the plugins' fd_check_request is asked about each real one (_request).
        self._plan = plan_run(run, self._plugins, backend=self._backend, gate=False)
        self.tokenizer: Tokenizer | None = (
            self._plan.checkpoint.tokenizer_if_any() if self._plan.checkpoint is not None else None
        )
        self._session = Session(
            self._plan, self._plugins, backend=self._backend, rank_timeout=rank_timeout, stall_timeout=stall_timeout
        )
        self._closed = False
        # A script that forgets close() still stops its ranks at exit (and an LLM dropped early, when collected).
        self._finalizer = weakref.finalize(self, self._session.close)

    # -- what it is ----------------------------------------------------------------------
    @property
    def multimodal(self) -> bool:
        """Whether the model takes pictures (a vision-language architecture)."""
        return self._plan.architecture(self._plugins).multimodal

    @property
    def platform(self) -> str:
        """The platform the ranks run on."""
        return str(self._info["platform"])

    @property
    def model(self) -> str:
        """The architecture's registered name."""
        return str(self._info["model"])

    @property
    def graph(self) -> GraphDecision:
        """Whether decode steps replay a captured graph, and every plugin's vote."""
        data = self._info["graph"]
        return GraphDecision(
            data["allowed"], data["mode"], tuple(CastVote(**v) for v in data["votes"]), data["requested"]
        )

    @property
    def _info(self) -> dict[str, Any]:
        """Rank 0's description (platform, model, graph decision, timings), as of the last sequence that ended."""
        return self._session.info

    @property
    def error(self) -> BaseException | None:
        """The failure that stopped this LLM's ranks (every later call raises RankError); None while it can generate."""
        # The scheduler's when a step failed; the ranks' own when one died between requests (no step ran to see it).
        return self._session.error

    @property
    def kv_cache(self) -> dict[str, int]:
        """The paged KV cache's counts on rank 0, as of the last sequence that ended: blocks_total, blocks_used,
        block_size, prefix_cache_queried_tokens, prefix_cache_hit_tokens, preemptions, spec_proposed_tokens,
        spec_accepted_tokens."""
        return dict(self._info.get("kv_cache") or {})

    @property
    def settings(self) -> dict[str, Any]:
        """The run's max batch, prefill budgets, KV-cache block size and dtype, each with where it came from (the
        argument, the platform's default or fd's): {"max_batch": {"value": 8, "from": "fd's default"}, ...}."""
        settings = self._plan.settings
        return settings.to_dict() if settings is not None else {}

    @property
    def threads(self) -> int:
        """Compute threads each rank runs (LLM(threads=), else the platform's threads variable if the user set it
        (Detection.threads_env), else the host's usable cores shared among its ranks)."""
        return int(self._info["threads"]["per_rank"])

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent so far in each phase on rank 0 (build, load, cleanup, capture, prefill, decode)."""
        return dict(self._info["timings_s"])

    # -- generating ----------------------------------------------------------------------
    def submit(
        self, prompt: Prompt | Sequence[Mapping[str, Any]], sampling: SamplingParams | None = None, *,
        chat: bool = False, images: Sequence[Any] = (), tools: Sequence[Mapping[str, Any]] | None = None,
        share: int | None = None,
    ) -> Submission:
        """Queue one prompt (text, token ids, or chat messages: a list of {"role", "content"} mappings rendered through
        the checkpoint's chat template, offered `tools`: OpenAI's function definitions, as the template takes them)
        and return at once; it joins the running batch at the next step boundary.

        Thread-safe. The request is checked first: a bad one raises ConfigError (or RequestRefused) here, before it
        queues. Submissions given the same `share` (new_share()) count as one request for the batch's fair shares:
        while others wait, one request holds at most half the batch's slots and half a step's prefill tokens.
        """
        if sampling is not None and sampling.n > 1:
            raise ConfigError(f"submit() returns one Submission, and n={sampling.n} asks for several; use "
                              "submit_choices()")
        return self.submit_choices(prompt, sampling, chat=chat, images=images, tools=tools, share=share)[0]

    def new_share(self) -> int:
        """A share for submit() and submit_choices() calls that make one request together (a fair share of the batch,
        as one call's choices have)."""
        return self._session.new_share()

    def submit_choices(
        self, prompt: Prompt | Sequence[Mapping[str, Any]], sampling: SamplingParams | None = None, *,
        chat: bool = False, images: Sequence[Any] = (), tools: Sequence[Mapping[str, Any]] | None = None,
        share: int | None = None, handoff: KVHandoff | None = None,
    ) -> list[Submission]:
        """As submit(), one Submission for each of the prompt's sampling.n choices (which share its cached blocks).
        `handoff` (one choice only): prefill it here and send its keys and values (KVHandoff.send_to), or decode it
        here from a prefill instance's (prefill() and resume() are the plain forms; docs/disaggregation.md)."""
        if handoff is not None:
            self._need_transport("a hand-over")
        if not isinstance(prompt, str) and prompt and isinstance(prompt[0], Mapping):
            pictures = self._pictures(images)
            messages: Sequence[Mapping[str, Any]] = prompt  # type: ignore[assignment]  # narrowed by the check above
            ids = self._chat_ids(messages, pictures, tools)
            return self._submit(self._request(ids, sampling, False, pictures, stream=True), share, handoff)
        if tools:
            raise ConfigError("tools are offered through the chat template: pass chat messages (a list of {\"role\", "
                              "\"content\"} mappings) with them")
        if not isinstance(prompt, str) and prompt and not isinstance(prompt[0], int):
            raise ConfigError("submit() takes one prompt; call it once per prompt")
        text_or_ids: Prompt = prompt  # type: ignore[assignment]  # not messages: checked above
        return self._submit(self._request(text_or_ids, sampling, chat, images, stream=True), share, handoff)

    def _pictures(self, images: Sequence[Any]) -> tuple[Any, ...]:
        """Pictures as arrays [C, H, W]: paths read and checked, arrays as given."""
        return tuple(load_image(str(p)) if isinstance(p, (str, Path)) else p for p in images)

    def _chat_ids(
        self, messages: Sequence[Mapping[str, Any]], pictures: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Chat messages as prompt ids through the checkpoint's chat template (request.messages_prompt)."""
        return messages_prompt(
            messages, self._plan.checkpoint, self._plan.architecture(self._plugins), self._plan.config, pictures, tools
        )

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template (None: none, or no checkpoint)."""
        checkpoint = self._plan.checkpoint
        return checkpoint.chat_template() if checkpoint is not None else None

    def queued(self) -> int:
        """Sequences waiting or running (every caller's)."""
        return self._session.scheduler.queued()

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | None = None, *, chat: bool = False,
        images: Sequence[Any] = (),
    ) -> list[Completion]:
        """A completion for each prompt (text, or token ids), decoded in the running batch with every other caller's;
        with sampling.n > 1, n for each prompt, prompt by prompt."""
        submissions = self._submit(self._request(prompts, sampling, chat, images, stream=False))
        try:
            return [s.result() for s in submissions]
        except BaseException:
            for submission in submissions:  # Ctrl-C while waiting: the sequences stop, the LLM goes on
                submission.cancel()
            raise

    def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, chat: bool = False, images: Sequence[Any] = ()
    ) -> Iterator[str]:
        """The text of one prompt's completion, piece by piece as it is produced; the request is checked when this is
        called.

        Leaving the loop early (break, an exception) cancels the rest of the sequence; the LLM goes on.
        """
        if not isinstance(prompt, str) and prompt and not isinstance(prompt[0], int):
            raise ConfigError("stream() takes one prompt; use generate() for several")
        if sampling is not None and sampling.n > 1:
            raise ConfigError(f"stream() gives one text, and n={sampling.n} asks for several; use "
                              "submit_choices() (one Submission per choice) or generate()")
        # Queued now, so that a closed or failed LLM raises here rather than at the first next().
        submission = self._submit(self._request(prompt, sampling, chat, images, stream=True))[0]

        def pieces() -> Iterator[str]:
            try:
                yield from submission
            finally:
                submission.cancel()  # a no-op once it ended

        return pieces()

    # -- disaggregation: prefill here, decode there -----------------------------------------
    @property
    def kv_address(self) -> str | None:
        """This instance's transfer address, which a prefill instance's prefill(to=...) sends to (None: no
        kv_transport)."""
        return self._plan.run.kv_listen

    def prefill(
        self, prompt: Prompt, sampling: SamplingParams | None = None, *, to: str, chat: bool = False,
    ) -> Handoff:
        """Prefill one prompt here and choose its first token, then send its keys and values to the instance whose
        kv_address is `to` (each rank to the same rank; both instances need the same kv_transport, model, dtype and
        tp). Returns once they are there: pass the Handoff to that instance's resume() with the same sampling. A
        request that ended at its first token sends nothing (Handoff.finished)."""
        self._need_transport("prefill(to=...)")
        key = f"r{uuid.uuid4().hex}"
        [submission] = self.submit_choices(prompt, sampling, chat=chat, handoff=KVHandoff(key, send_to=to))
        completion = submission.result()
        logprobs = None if completion.logprobs is None else tuple(completion.logprobs)
        return Handoff(key, tuple(completion.prompt_ids), tuple(completion.token_ids), logprobs, completion)

    def resume(self, handoff: Handoff, sampling: SamplingParams | None = None) -> Submission:
        """Decode a request a prefill instance handed to this one (its prefill(to=this.kv_address)), from its keys and
        values and the tokens it chose; pass the sampling it was prefilled with (a seeded draw goes on where it
        stopped). The Submission streams the tokens chosen here; its completion holds every token."""
        self._need_transport("resume()")
        if handoff.finished:
            reason = handoff.completion.finish_reason
            raise ConfigError(f"request {handoff.key!r} ended on the prefill instance ({reason}): its completion is "
                              f"the whole answer, and nothing was sent to resume")
        return self.submit_choices(list(handoff.prompt_ids), sampling, handoff=KVHandoff(
            handoff.key, tokens=handoff.token_ids, logprobs=handoff.logprobs))[0]

    def _need_transport(self, what: str) -> None:
        if self._plan.run.kv_transport is None:
            raise ConfigError(f"{what} moves keys and values through a KV transport, and this LLM has none: pass "
                              f"LLM(kv_transport=...) (`fd plugins` lists them)")

    def _submit(self, request: Request, share: int | None = None, handoff: KVHandoff | None = None) -> list[Submission]:
        jobs = jobs_of(request)
        if handoff is not None:
            if request.sampling.prompt_logprobs is not None:
                raise ConfigError("prompt_logprobs are not handed over yet: score the prompt on an instance that "
                                  "prefills and decodes")
            if len(jobs) != 1:
                raise ConfigError(f"a hand-over is of one prompt with n=1, and this request makes {len(jobs)} "
                                  f"sequences; hand each over alone")
            jobs = [dataclasses.replace(jobs[0], handoff=handoff)]
        return self._jobs(jobs, share)

    def _jobs(self, jobs: list[Any], share: int | None = None) -> list[Submission]:
        if self._closed:
            raise ConfigError("this LLM is closed; create a new one")
        if self.error is not None:
            raise RankError(f"this LLM's ranks failed earlier ({self.error}); create a new one")
        return self._session.submit(jobs, share)

    def _request(
        self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | None, chat: bool, images: Sequence[Any],
        stream: bool = False,
    ) -> Request:
        """Prompts as checked token ids with the sampling settings and end-of-sequence ids: all before any rank sees
        them."""
        plan = self._plan
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        items: list[Any] = [prompts] if single else list(prompts)
        if not items:
            raise ConfigError("no prompt given; pass a string, a list of token ids, or a list of either")
        pictures = self._pictures(images)
        texts = [p for p in items if isinstance(p, str)]
        if texts and len(texts) != len(items):
            raise ConfigError("pass text prompts or token-id prompts in one call, not both")
        if not texts and chat:
            raise ConfigError("chat=True applies the chat template to text; pass the message as a string")
        if sampling is not None and sampling.stop and self.tokenizer is None:
            raise ConfigError("stop strings are matched in the text, and without a tokenizer there is none")
        # Settings passed in are taken whole; without them, the checkpoint's generation_config.json decides.
        given = () if sampling is None else ("temperature", "top_p", "top_k")
        return build_request(items, sampling or SamplingParams(), arch=plan.architecture(self._plugins),
                             config=plan.config, checkpoint=plan.checkpoint, chat=chat, images=pictures, given=given,
                             memory=plan.memory, backend=self._backend, parallel=ParallelConfig(tp_size=plan.run.tp),
                             stream=stream, grammar_timeout=plan.run.grammar_timeout)

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop generating (what is still running fails with SchedulerClosed), stop the ranks (tp > 1); idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if error is not None:
            self._closed = True
            self._finalizer.detach()
            self._session.abort(error)  # the ranks may be mid-step: stop them rather than wait (the step then fails)
            return
        self.close()
