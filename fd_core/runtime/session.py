"""The Python API: a model loaded on its ranks, generating text for lists of prompts, streaming, and
reporting its platform, graph decision and timings."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator, Iterator, Sequence

from fd_core.backend import Backend
from fd_core.config import ParallelConfig
from fd_core.errors import ConfigError
from fd_core.graphs import CastVote, GraphDecision
from fd_core.paddle_logs import quiet_paddle_logs
from fd_core.plugins import load_plugins
from fd_core.runtime.distributed import DEFAULT_STALL_S
from fd_core.runtime.engine import Completion
from fd_core.runtime.images import load_image
from fd_core.runtime.memory import DEFAULT_MEMORY_FRACTION
from fd_core.runtime.plan import RunConfig, plan_run, plugin_env
from fd_core.runtime.ranks import RankPool
from fd_core.runtime.request import Request, build_request
from fd_core.runtime.sampling import SamplingParams
from fd_core.runtime.worker import RankWorker

if TYPE_CHECKING:
    from fd_core.runtime.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    """A checkpoint (or an architecture's tiny preset) loaded on `tp` ranks and ready to generate.

    With tp > 1 the ranks are processes started here and kept until `close()` (use it as a context
    manager); a rank that fails stops the others and the call raises RankError naming it, as `fd run`
    does. Everything is checked before a process starts.
    """

    def __init__(
        self, checkpoint: str | Path | None = None, *, model: str | None = None, tp: int = 1, platform: str | None = None,
        dtype: str | None = None, graph: str = "auto", seed: int = 0, max_batch: int = 8, progress: bool = False,
        rank_timeout: float = 30.0, memory_fraction: float = DEFAULT_MEMORY_FRACTION, stall_timeout: float = DEFAULT_STALL_S,
        threads: int | None = None,
    ) -> None:
        quiet_paddle_logs()  # before paddle is imported: its C++ logs stay off the caller's terminal
        if graph not in ("auto", "off", "on"):
            raise ConfigError(f"graph must be 'auto', 'off' or 'on', got {graph!r}")
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        run = RunConfig(model=model or "", tp=tp, checkpoint=self.checkpoint, dtype=dtype, graph=graph, seed=seed,
                        max_batch=max_batch, progress=progress, platform=platform, memory_fraction=memory_fraction,
                        threads=threads)
        self._plugins = load_plugins(plugin_env(platform))
        # The plan's request is a placeholder: the plugins' fd_check_request is asked about each real one (_request).
        self._plan = plan_run(run, self._plugins, gate=False)
        self._backend = Backend(self._plugins)
        self.tokenizer: Tokenizer | None = self._plan.checkpoint.tokenizer_if_any() if self._plan.checkpoint is not None else None
        self._worker: Any = None
        self._pool: Any = None
        if tp == 1:
            self._worker = RankWorker.start(self._plan, plugins=self._plugins)
            self._info = self._worker.describe()
        else:
            if progress:
                import sys

                print(f"fd: starting {tp} ranks on {self._plan.platform} ({self._plan.dist_backend})", file=sys.stderr, flush=True)
            self._pool = RankPool(self._plan, tp, rank_timeout, stall_timeout)
            self._info = self._pool.ready[0][1]

    # -- what it is ----------------------------------------------------------------------
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
        return GraphDecision(data["allowed"], data["mode"], tuple(CastVote(**v) for v in data["votes"]), data["requested"])

    @property
    def threads(self) -> int:
        """Compute threads each rank runs (LLM(threads=), else OMP_NUM_THREADS, else the host's usable cores shared among its ranks)."""
        return int(self._info["threads"]["per_rank"])

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent so far in each phase on rank 0 (build, load, cleanup, capture, prefill, decode)."""
        return dict(self._info["timings_s"])

    # -- generating ----------------------------------------------------------------------
    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | None = None, *, chat: bool = False,
        images: Sequence[Any] = (),
    ) -> list[Completion]:
        """A completion for each prompt (text, or token ids), decoded together in batches."""
        stream = self._stream(self._request(prompts, sampling, chat, images, stream=False))
        while True:
            try:
                next(stream)
            except StopIteration as done:
                return list(done.value)

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, *, chat: bool = False, images: Sequence[Any] = ()) -> Iterator[str]:
        """The text of one prompt's completion, piece by piece as it is produced; the request is checked when this is called."""
        if not isinstance(prompt, str) and prompt and not isinstance(prompt[0], int):
            raise ConfigError("stream() takes one prompt; use generate() for several")
        request = self._request(prompt, sampling, chat, images, stream=True)

        def pieces() -> Iterator[str]:
            for _, text in self._stream(request):
                yield text

        return pieces()

    def _stream(self, request: Request) -> Generator[tuple[int, str], None, list[Completion]]:
        if self._worker is None and self._pool is None:
            raise ConfigError("this LLM is closed; create a new one")
        try:
            if self._worker is not None:
                outputs = yield from self._worker.engine.stream(request)
                self._info = self._worker.describe()
            else:
                outputs = yield from self._pool.generate(request)
                self._info = self._pool.info
        except BaseException:
            if self._pool is not None:
                self._pool.abort()
                self._pool = None
            raise
        return outputs

    def _request(
        self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | None, chat: bool, images: Sequence[Any], stream: bool = False,
    ) -> Request:
        """Prompts as checked token ids with the sampling settings and end-of-sequence ids: all before any rank sees them."""
        plan = self._plan
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        items: list[Any] = [prompts] if single else list(prompts)
        if not items:
            raise ConfigError("no prompt given; pass a string, a list of token ids, or a list of either")
        pictures = tuple(load_image(str(p)) if isinstance(p, (str, Path)) else p for p in images)
        texts = [p for p in items if isinstance(p, str)]
        if texts and len(texts) != len(items):
            raise ConfigError("pass text prompts or token-id prompts in one call, not both")
        if not texts and chat:
            raise ConfigError("chat=True applies the chat template to text; pass the message as a string")
        if sampling is not None and sampling.stop and self.tokenizer is None:
            raise ConfigError("stop strings are matched in the text, and without a tokenizer there is none")
        # Settings passed in are taken whole; without them, the checkpoint's generation_config.json decides.
        given = () if sampling is None else ("temperature", "top_p", "top_k")
        return build_request(items, sampling or SamplingParams(), arch=plan.architecture(self._plugins), config=plan.config, checkpoint=plan.checkpoint,
                             chat=chat, images=pictures, given=given, memory=plan.memory, backend=self._backend,
                             parallel=ParallelConfig(tp_size=plan.run.tp), stream=stream)

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the ranks (tp > 1) and release the model; idempotent."""
        pool, self._pool, self._worker = self._pool, None, None
        if pool is not None:
            pool.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if error is not None and self._pool is not None:
            self._pool.abort()  # the ranks may be mid-request: stop them rather than wait
            self._pool = None
        self.close()

