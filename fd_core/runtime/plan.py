"""A run planned once, in the parent, as plain data the ranks receive: what was asked (RunConfig), checked
against the installed plugins, the model's config and the checkpoint, with the request built (Plan)."""

from __future__ import annotations

import dataclasses
import numbers
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fd_core.config import DEFAULT_GRAMMAR_TIMEOUT_S, ModelConfig, ParallelConfig
from fd_core.detection import Detection, affinity_cores
from fd_core.errors import CheckpointError, ConfigError, FdError, setting
from fd_core.host.backend import Backend
from fd_core.host.loading import PluginSet, load_plugins
from fd_core.models import Architecture
from fd_core.quantization import DEFAULT_GROUPS
from fd_core.runtime.checkpoint import Checkpoint
from fd_core.runtime.engine.sampling import SamplingParams
from fd_core.runtime.engine.speculation import Speculation, speculation_of
from fd_core.runtime.images import load_image
from fd_core.runtime.memory import (
    DEFAULT_MEMORY_FRACTION,
    MemoryPlan,
    local_ranks,
    plan_memory,
)
from fd_core.runtime.request import Request, build_request
from fd_core.runtime.settings import Settings, resolve_settings
from fd_core.runtime.threads import Threads, decide_threads

DEFAULT_MODEL = "ernie4_5"


@dataclass(frozen=True)
class RunConfig:
    """What `fd run` was asked to do; plain data, so it crosses into spawned ranks."""

    # The architecture's name or alias; None: the checkpoint's, else fd's default.
    model: str | None = None
    tp: int = 1
    steps: int = 16
    prompt_ids: tuple[int, ...] = (1, 2, 3, 4)
    # Pictures for a VL prompt, in the order of its placeholder runs: PNG, JPEG or .npy [3, H, W] in [0, 1].
    images: tuple[str, ...] = ()
    checkpoint: str | None = None
    # Compute dtype; None means the platform's preferred one (the first of its Detection.dtypes).
    dtype: str | None = None
    # Weight-only quantization of the linear layers at load: "wint8", "wint4" or None (fd_core.quantization).
    quantization: str | None = None
    # Its group size (inputs a scale covers; 0 per output channel); None: the scheme's default
    # (fd_core.quantization.DEFAULT_GROUPS).
    quantization_group: int | None = None
    # Keep the embedding and the LM head in the compute dtype under --quantization.
    float_embeddings: bool = False
    graph: str = "auto"
    reload_cycles: int = 0
    # Seeds a preset's random weights and the sampler.
    seed: int = 0
    progress: bool = True
    # Load weights holding NaN or Inf (for experiments); by default they are refused, naming the tensor.
    allow_non_finite: bool = False
    # Text in, text out (fd_core.runtime): text prompts, several id prompts, chat template, sampling, stops.
    prompts: tuple[str, ...] = ()
    id_prompts: tuple[tuple[int, ...], ...] = ()
    chat: bool = False
    stop: tuple[str, ...] = ()
    # None: generation_config.json's setting when it samples, else greedy.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # Penalties, bias and the other logits processing (SamplingParams); the defaults change nothing.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    # The most sequences decoded together; None: the platform's default, else fd's (fd_core.runtime.settings).
    max_batch: int | None = None
    # Rank 0 writes text to stdout as it is produced (an interactive terminal).
    stream: bool = False
    # A platform to use instead of the selected one (as FD_PLATFORM does).
    platform: str | None = None
    # Wall-clock time (time.time()) when `fd run` started; phases before a rank's own work and the
    # time to first token are measured from it.
    started_at: float | None = None
    # When the ranks were started (spawned or forked), if they were.
    spawned_at: float | None = None
    # The share of each device's free memory fd plans weights and KV cache in (--memory-fraction).
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    # Compute threads per rank (--threads); None: the cores this process may use, shared among the
    # host's ranks, unless the platform's threads variable says otherwise (see decide_threads).
    threads: int | None = None
    # The paged KV cache: positions a block holds (None: the platform's, else fd's default), the most blocks a rank
    # allocates (None: what the memory plan gives), whether full blocks are shared by prefix, and the most prompt
    # tokens one step prefills (a longer prompt is prefilled in chunks beside the running decodes).
    kv_block_size: int | None = None
    kv_cache_blocks: int | None = None
    prefix_caching: bool = True
    # Allocate no more KV-cache blocks than this run's own prompts and tokens use (fd run, which knows its whole job;
    # the Python API and fd serve take requests later).
    cache_for_job: bool = False
    # None: the platform's, else fd's (512 tokens; no limit of prompts).
    max_prefill_tokens: int | None = None
    max_prefill_prompts: int | None = None
    # Seconds a request's grammar may take to compile for the model's tokens before it is refused.
    grammar_timeout: float = DEFAULT_GRAMMAR_TIMEOUT_S
    # Speculative decoding's proposer ("ngram"; None: off) and the most tokens it proposes a step (None: its default).
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    # The draft model's checkpoint directory (speculative "draft"): an architecture with the target's vocabulary.
    draft_checkpoint: str | None = None
    # Each rank checks the non-native kernels the run calls against fd's native ops before its first request
    # (fd_core.runtime.kernel_checks.kernel_canary); off for a platform certified with `fd check`.
    kernel_canary: bool = True
    # Disaggregation (contract 1.9): the KV transport each rank makes (a name plugins registered; None: none) and this
    # instance's transfer address, which prefill instances send to (the transport's own form; None: a fresh name).
    kv_transport: str | None = None
    kv_listen: str | None = None
    # Seconds a hand-over's keys and values may take to arrive before the request fails.
    kv_timeout: float = 30.0

    def __post_init__(self) -> None:
        # Checked here, where `fd run` and the Python API both pass, in the API's words (the CLI's own
        # parser refuses these first, naming its options).
        for name in ("seed", "max_batch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
                raise ConfigError(f"{name} must be an integer, got {value!r:.40}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1 (prompts decoded together), got {self.max_batch}")
        speculation_of(self.speculative, self.num_speculative_tokens, self.draft_checkpoint)
        for name in ("grammar_timeout", "kv_timeout"):
            timeout = getattr(self, name)
            number = isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
            if not number or not 0 < float(timeout) < float("inf"):
                raise ConfigError(f"{name} must be a number of seconds > 0, got {timeout!r:.40}")

    @property
    def speculation(self) -> Speculation | None:
        """How the run speculates (None: it does not)."""
        return speculation_of(self.speculative, self.num_speculative_tokens, self.draft_checkpoint)


def run_threads(run: RunConfig, detection: Detection | None = None) -> Threads:
    """decide_threads for `run` on this host: the ranks that start here (under a launcher, its local size) share its
    cores."""
    reported = detection.host_cores if detection is not None else None
    cores, source = (
        (reported, "the platform's report") if reported is not None else (affinity_cores(), "the affinity mask")
    )
    threads_env = detection.threads_env if detection is not None else None
    return decide_threads(run.threads, local_ranks(run.tp), cores, os.environ, threads_env, source)


@dataclass(frozen=True)
class Plan:
    """A RunConfig checked against the installed plugins before any rank starts; plain data (it pickles).

    `model` is the registered architecture's name: a rank looks it up in its own plugins.
    """

    run: RunConfig
    model: str
    config: ModelConfig
    platform: str
    dist_backend: str
    # What to generate: prompts as ids, sampling, stops, pictures decoded.
    request: Request
    checkpoint: Checkpoint | None = None
    # Weights per rank and the KV-cache capacity, from the platform's memory report (fd_core.runtime.memory).
    memory: MemoryPlan | None = None
    # Compute threads per rank (RankWorker hands them to the platform's fd_rank_start).
    threads: Threads | None = None
    # Max batch, prefill budgets, block size and dtype, each the user's, the platform's or fd's default.
    settings: Settings | None = None
    # The draft model of speculative decoding (RunConfig.draft_checkpoint), checked against the target.
    draft: "DraftPlan | None" = None

    def architecture(self, plugins: PluginSet) -> Architecture:
        """The planned architecture as `plugins` registers it."""
        return plugins.registry.get(self.model)


def plugin_env(platform: str | None) -> Mapping[str, str]:
    """The environment plugin selection reads, with `platform` forced when given."""
    return {**os.environ, "FD_PLATFORM": platform} if platform else os.environ


def model_config_for(arch: Architecture, checkpoint: Checkpoint | str | None, dtype: str = "float32") -> ModelConfig:
    """The checkpoint's config.json (or the tiny preset) parsed and checked for `arch`, computing in `dtype`.

    A VL checkpoint's `preprocessor_config.json` (the image processor's settings) joins `extra` as
    "preprocessor_config"; the tiny preset brings its own.
    """
    if isinstance(checkpoint, str):
        checkpoint = Checkpoint.open(checkpoint)
    if checkpoint is None:
        config = arch.preset_config()
        preprocessor = arch.preset_files.get("preprocessor_config.json")
    else:
        config = arch.config_from(checkpoint.config, source=str(Path(checkpoint.directory) / "config.json"))
        preprocessor = checkpoint.preprocessor
    if preprocessor is not None:
        config = config.with_overrides(extra={**config.extra, "preprocessor_config": dict(preprocessor)})
    return config.with_overrides(dtype=dtype)


def compute_dtype(requested: str | None, backend: Backend) -> str:
    """`requested`, or the platform's preferred dtype; an error if the platform cannot compute in it."""
    offered = backend.detection.dtypes
    if requested is None:
        return offered[0]
    if requested not in offered:
        raise ConfigError(
            f"platform {backend.platform} cannot compute in {requested} (it offers {', '.join(offered)}); "
            f"pass {setting('dtype', offered[0])}"
        )
    return requested


def check_tp(tp: int, config: ModelConfig, arch: Architecture, backend: Backend) -> None:
    """The model's divisibility and the platform's rank limit, both in one line when both fail:
    fixing one at a time would cost the user a second failed start."""
    problems: list[FdError] = []
    more = arch.sharded_sizes(config) if arch.sharded_sizes is not None else None
    for check in (lambda: config.check_tensor_parallel(tp, more), lambda: backend.check_ranks(tp)):
        try:
            check()
        except FdError as exc:
            problems.append(exc)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigError("; also ".join(str(p) for p in problems))


def _run_request(
    run: RunConfig, arch: Architecture, config: ModelConfig, checkpoint: Checkpoint | None, pictures: list[Any],
    memory: MemoryPlan, backend: Backend | None,
) -> Request:
    """What `fd run` asked for as a checked Request; its flags' own errors first, in their words."""
    if run.prompts and run.id_prompts:
        raise ConfigError("pass text prompts (--prompt, --prompts) or token ids (--prompt-ids), not both")
    if not run.prompts:
        if run.chat:
            raise ConfigError("--chat applies the chat template to text; pass the message with --prompt")
        if run.stop and (checkpoint is None or not checkpoint.has_tokenizer()):
            raise ConfigError(
                "--stop strings are matched in the text, and without a tokenizer there is none; drop --stop"
            )
    given: dict[str, Any] = {"temperature": run.temperature, "top_p": run.top_p, "top_k": run.top_k}
    # Token ids in, token ids out: exactly --max-new-tokens, as before text came in (a benchmark's and the
    # reference tests' mode); text prompts end at an end-of-sequence id.
    sampling = SamplingParams(max_new_tokens=run.steps, seed=run.seed, stop=run.stop, ignore_eos=not run.prompts,
                              presence_penalty=run.presence_penalty, frequency_penalty=run.frequency_penalty,
                              repetition_penalty=run.repetition_penalty, logit_bias=run.logit_bias, min_p=run.min_p,
                              min_tokens=run.min_tokens, **{k: v for k, v in given.items() if v is not None})
    prompts = run.prompts or run.id_prompts or (run.prompt_ids,)
    return build_request(prompts, sampling, arch=arch, config=config, checkpoint=checkpoint, chat=run.chat,
                         images=pictures, given=[k for k, v in given.items() if v is not None], memory=memory,
                         backend=backend, parallel=ParallelConfig(tp_size=run.tp), stream=run.stream)


def model_and_checkpoint(
    model: str | None, directory: str | None, plugins: PluginSet, weights: bool = True
) -> tuple[Architecture, Checkpoint | None]:
    """The architecture to run (the checkpoint's, which `model` may only name again; else `model`, else the default) and
    the opened checkpoint (None without one; without `weights`, config.json alone will do)."""
    if directory is None:
        return plugins.registry.get(model or DEFAULT_MODEL), None
    checkpoint = Checkpoint.open(directory, weights)
    found = checkpoint.architecture
    if found is None:
        raise CheckpointError(
            f"checkpoint {directory}/config.json names no architecture; add \"architectures\": [\"<name>\"]"
        )
    if found not in plugins.registry:
        raise CheckpointError(
            f"checkpoint {directory}: architecture {found!r} is not registered; {plugins.registry.listing()}"
        )
    if model and plugins.registry.get(model).name != plugins.registry.get(found).name:
        raise ConfigError(
            f"{setting('model', model)} does not match the checkpoint's architecture {found}; "
            f"drop {setting('model')} or pick the right checkpoint"
        )
    return plugins.registry.get(found), checkpoint


@dataclass(frozen=True)
class DraftPlan:
    """Speculative decoding's draft model: its architecture's name, config (the target's dtype) and checkpoint; its
    weights and cache are in the target's memory plan."""

    model: str
    config: ModelConfig
    checkpoint: Checkpoint | None


@dataclass(frozen=True)
class ModelPlan:
    """The model part of a plan (what `fd explain` shows): the architecture, its config in the compute dtype, the
    checkpoint, the memory plan and the threads, all checked against the platform and the tensor-parallel layout."""

    arch: Architecture
    config: ModelConfig
    checkpoint: Checkpoint | None
    memory: MemoryPlan
    threads: Threads
    settings: Settings
    draft: DraftPlan | None = None


def plan_draft(run: RunConfig, config: ModelConfig, plugins: PluginSet, backend: Backend,
               weights: bool = True) -> DraftPlan | None:
    """The draft model of `run` (None without one), checked against the target's `config`: its architecture and
    checkpoint, the same vocabulary, and the run's tp."""
    speculation = run.speculation
    if speculation is None or speculation.draft is None:
        return None
    try:
        arch, checkpoint = model_and_checkpoint(None, speculation.draft, plugins, weights)
        config_ = model_config_for(arch, checkpoint, config.dtype)
    except (CheckpointError, ConfigError) as exc:  # the checkpoint's own error, said to be the draft's
        raise type(exc)(f"{setting('draft_checkpoint')}: {exc}") from exc
    if config_.vocab_size != config.vocab_size:
        raise ConfigError(
            f"the draft model in {speculation.draft} has a vocabulary of {config_.vocab_size} tokens and the model "
            f"{config.vocab_size}: a draft proposes the model's token ids; give "
            f"{setting('draft_checkpoint')} a model of the same tokenizer"
        )
    check_tp(run.tp, config_, arch, backend)
    return DraftPlan(arch.name, config_, checkpoint)


def plan_model(run: RunConfig, plugins: PluginSet, backend: Backend, weights: bool = True) -> ModelPlan:
    """The checks of the model against the platform: architecture and checkpoint, dtype, tp, memory, threads. Without
    `weights` (fd explain, which reads none) a checkpoint directory may hold config.json alone."""
    threads = run_threads(run, backend.detection)
    arch, checkpoint = model_and_checkpoint(run.model, run.checkpoint, plugins, weights)
    config = model_config_for(arch, checkpoint, compute_dtype(run.dtype, backend))
    settings = run_settings(run, backend, config.dtype)
    if run.quantization_group is not None and run.quantization is None:
        raise ConfigError(f"{setting('quantization-group')} sizes the groups of a quantization: give "
                          f"{setting('quantization')} too, or drop it")
    if run.float_embeddings and run.quantization is None:
        raise ConfigError(f"{setting('float-embeddings')} keeps the embeddings out of a quantization: give "
                          f"{setting('quantization')} too, or drop it")
    if run.quantization is not None:
        group = DEFAULT_GROUPS.get(run.quantization, 0) if run.quantization_group is None else run.quantization_group
        config = config.with_overrides(quantization=run.quantization, quantization_group=group,
                                       float_embeddings=bool(run.float_embeddings))
        config.check()
        if not arch.quantizable:
            raise ConfigError(
                f"{arch.name} (from plugin {arch.package!r}) does not quantize its weights (its Architecture is not "
                f"quantizable=True); run it without {setting('quantization')}"
            )
    check_tp(run.tp, config, arch, backend)
    draft = plan_draft(run, config, plugins, backend, weights)
    # Weights per rank against the device, and the KV-cache capacity: before the request, which must fit it. A draft's
    # weights count with the model's, and its cache holds as many blocks as the model's.
    memory = plan_memory(config, run.tp, backend.detection, run.memory_fraction, backend.platform, arch.name,
                         block_size=settings.kv_block_size, kv_cache_blocks=run.kv_cache_blocks,
                         max_batch=settings.max_batch, max_prefill_tokens=settings.max_prefill_tokens,
                         positions=1 + (run.speculation.tokens if run.speculation else 0),
                         beside=draft.config if draft is not None else None)
    return ModelPlan(arch, config, checkpoint, memory, threads, settings, draft)


def run_settings(run: RunConfig, backend: Backend, dtype: str) -> Settings:
    """The run's settings: the user's, else the platform's defaults, else fd's (fd_core.runtime.settings)."""
    requested = {"max_batch": run.max_batch, "max_prefill_tokens": run.max_prefill_tokens,
                 "max_prefill_prompts": run.max_prefill_prompts, "kv_block_size": run.kv_block_size}
    return resolve_settings(requested, backend.detection, backend.platform, dtype, run.dtype is not None)


def plan_run(
    run: RunConfig, plugins: PluginSet | None = None, *, backend: Backend | None = None, gate: bool = True
) -> Plan:
    """Every check that can fail before a process starts: platform, model, tp, memory, prompt, checkpoint, the
    plugins' gates.

    `backend` is the caller's Backend over `plugins` (one is built if not given). `gate=False` leaves the
    request out of fd_check_request: the Python API plans its model with a placeholder request and asks the
    plugins about each request it is given instead.
    """
    plugins = plugins or load_plugins(plugin_env(run.platform))
    backend = backend or Backend(plugins)
    backend.require_hardware()
    backend.check_graph_request(run.graph)
    if run.steps < 1:
        raise ConfigError(f"{setting('max_new_tokens')} must be >= 1, got {run.steps}")
    if run.kv_transport is not None and run.kv_transport not in plugins.transports:
        known = ", ".join(sorted(plugins.transports)) or "none"
        raise ConfigError(f"{setting('kv_transport', run.kv_transport)} is not a KV transport any plugin registered "
                          f"(registered: {known}); see `fd plugins`")
    if run.kv_transport is not None and run.kv_listen is None:
        run = dataclasses.replace(run, kv_listen=f"fd{os.getpid()}-{uuid.uuid4().hex[:8]}")
    model = plan_model(run, plugins, backend)
    if run.images and not model.arch.multimodal:
        raise ConfigError(f"{model.arch.name} takes no image; drop {setting('images')} or choose a VL model")
    # Tokenizing, the chat template, a missing or malformed picture, a prompt too long for the context
    # or whose placeholders do not fit the pictures, a cache beyond the capacity, a plugin's
    # fd_check_request refusal: all fail here, before any rank starts.
    pictures = [load_image(path) for path in run.images]
    request = _run_request(
        run, model.arch, model.config, model.checkpoint, pictures, model.memory, backend if gate else None
    )
    memory = model.memory
    if run.cache_for_job:
        memory = memory.for_job(request.prompts * request.sampling.n, run.steps)
    return Plan(run, model.arch.name, model.config, backend.platform, backend.detection.dist_backend, request,
                model.checkpoint, memory, model.threads, model.settings, model.draft)
