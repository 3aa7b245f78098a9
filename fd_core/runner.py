"""Model lifecycle on one rank: build, load, clean, decide, capture, generate, and weight reload."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from fd_core.backend import Backend, load_backend
from fd_core.config import ModelConfig, ParallelConfig, read_config_json
from fd_core import progress
from fd_core.errors import CheckpointError, ConfigError, FdError, NumericsError
from fd_core.graphs import CastVote, GraphDecision
from fd_core.models import Architecture, CausalModel
from fd_core.plugins import PluginSet, load_plugins
from fd_core.weights import (
    CheckpointShards,
    check_checkpoint_dir,
    check_new_directory,
    load_checkpoint,
    random_state_dict,
    save_checkpoint,
)

BATCH_SIZE = 1
PREPROCESSOR_CONFIG = "preprocessor_config.json"
# Pictures above this many pixels are refused before decoding (the processors downscale to far fewer anyway).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


@dataclass(frozen=True)
class RunConfig:
    """What `fd run` was asked to do; plain data, so it crosses into spawned ranks."""

    model: str
    tp: int = 1
    steps: int = 16
    prompt_ids: tuple[int, ...] = (1, 2, 3, 4)
    # Pictures for a VL prompt, in the order of its placeholder runs: PNG, JPEG or .npy [C, H, W] in [0, 1].
    images: tuple[str, ...] = ()
    checkpoint: str | None = None
    # Compute dtype; None means the platform's preferred one (the first of its Detection.dtypes).
    dtype: str | None = None
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
    max_batch: int = 8
    # Rank 0 writes text to stdout as it is produced (an interactive terminal).
    stream: bool = False
    # A platform to use instead of the selected one (as FD_PLATFORM does).
    platform: str | None = None
    # Wall-clock time (time.time()) when `fd run` started; phases before a rank's own work and the
    # time to first token are measured from it.
    started_at: float | None = None
    # When the ranks were started (spawned or forked), if they were.
    spawned_at: float | None = None


@dataclass
class Plan:
    """A RunConfig checked against the installed plugins, before any rank starts."""

    run: RunConfig
    arch: Architecture
    config: ModelConfig
    platform: str
    dist_backend: str
    # What to generate: prompts as ids, sampling, stops (fd_core.runtime.engine.Request), and the tokenizer if any.
    request: Any = None
    tokenizer: Any = None


def process_start_time() -> float:
    """When this process started, as time.time() (from /proc where there is one; else now)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Its age from the uptime, both in 10 ms steps (the boot time /proc/stat gives is whole seconds).
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def peak_resident_bytes() -> int:
    """This process's peak resident set size so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes() -> int:
    """This process's resident set size now (not its peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _read_checkpoint_config(checkpoint: str) -> dict[str, Any]:
    path = Path(checkpoint) / "config.json"
    try:
        return read_config_json(path)
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {exc}") from None


def _architecture_of(data: Mapping[str, Any]) -> str | None:
    """The architecture a config.json names: `architectures[0]` as transformers writes it."""
    archs = data.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    name = data.get("architecture")
    return name if isinstance(name, str) and name else None


def init_std(config: ModelConfig) -> float | None:
    """The config's `initializer_range` (Hugging Face's name for the init std), if it sets one."""
    value = config.extra.get("initializer_range")
    return None if value is None else float(value)


def model_config_for(arch: Architecture, checkpoint: str | None, dtype: str = "float32") -> ModelConfig:
    """The checkpoint's config.json (or the tiny preset) parsed and checked for `arch`, computing in `dtype`.

    A VL checkpoint's `preprocessor_config.json` (the image processor's settings) joins `extra` as
    "preprocessor_config"; the tiny preset brings its own.
    """
    if checkpoint is None:
        config = arch.preset_config()
        preprocessor = arch.preset_files.get(PREPROCESSOR_CONFIG)
    else:
        config = arch.config_from(_read_checkpoint_config(checkpoint), source=str(Path(checkpoint) / "config.json"))
        path = Path(checkpoint) / PREPROCESSOR_CONFIG
        preprocessor = read_config_json(path) if path.exists() else None
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
            f"pass --dtype {offered[0]}"
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


def plan_run(run: RunConfig, plugins: PluginSet | None = None) -> Plan:
    """Every check that can fail before a process starts: platform, model, tp, prompt, checkpoint."""
    plugins = plugins or load_plugins(plugin_env(run.platform))
    backend = Backend(plugins)
    backend.require_hardware()
    if run.steps < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {run.steps}")
    model = run.model
    if run.checkpoint is not None:
        check_checkpoint_dir(Path(run.checkpoint))
        found = _architecture_of(_read_checkpoint_config(run.checkpoint))
        if found is None:
            raise CheckpointError(f"checkpoint {run.checkpoint}/config.json names no architecture; add \"architectures\": [\"<name>\"]")
        if found not in plugins.registry:
            raise CheckpointError(f"checkpoint {run.checkpoint}: architecture {found!r} is not registered; {plugins.registry.listing()}")
        if model and plugins.registry.get(model).name != plugins.registry.get(found).name:
            raise ConfigError(f"--model {model} does not match the checkpoint's architecture {found}; drop --model or pick the right checkpoint")
        model = found
    arch = plugins.registry.get(model or "ernie4_5")
    config = model_config_for(arch, run.checkpoint, compute_dtype(run.dtype, backend))
    check_tp(run.tp, config, arch, backend)
    if run.images and not arch.multimodal:
        raise ConfigError(f"{arch.name} takes no image; drop --image or choose a VL model")
    from fd_core.runtime.prompts import plan_request

    # Tokenizing, the chat template, a missing or malformed picture, a prompt too long for the context
    # or whose placeholders do not fit the pictures: all fail here, before any rank starts.
    shapes = [load_image(path).shape for path in run.images]
    request, tokenizer = plan_request(run, arch, config, shapes)
    memory = backend.detection.memory_bytes
    longest = max(len(p) for p in request.prompts) + run.steps
    needed = config.estimated_bytes(min(len(request.prompts), run.max_batch), longest)
    if memory is not None and needed > memory:
        raise ConfigError(
            f"{arch.name} needs at least {needed / 2**30:.1f} GiB for its weights and cache, and platform "
            f"{backend.platform!r} has {memory / 2**30:.1f} GiB available here; use a smaller model, a shorter run or more memory"
        )
    return Plan(run, arch, config, backend.platform, backend.detection.dist_backend, request, tokenizer)


@dataclass
class GenerationResult:
    tokens: list[int]
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        decoded = len(self.tokens) - 1
        return decoded / self.decode_s if self.decode_s > 0 and decoded else 0.0


@dataclass
class ModelRunner:
    """Drives one model through the lifecycle on this rank; the order of steps lives here, not in models."""

    backend: Backend
    arch: Architecture
    config: ModelConfig
    checkpoint: str | None = None
    seed: int = 0
    graph: str = "auto"
    log: Callable[[str], None] = lambda message: None
    allow_non_finite: bool = False
    model: CausalModel | None = None
    decision: GraphDecision | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # time.time() when the first generated token was known (after prefill), of the last generate().
    first_token_at: float | None = None
    decode_core_s: float = 0.0

    def _add_time(self, phase: str, seconds: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + seconds

    def _timed(self, phase: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        self._add_time(phase, time.perf_counter() - start)
        return result

    def read_weights(self) -> Mapping[str, Any]:
        """This rank's shards from the seed (in memory), or from the checkpoint (checked whole, read on access)."""
        assert self.model is not None
        specs = self.model.weight_specs()
        p = self.backend.parallel
        if self.checkpoint is None:
            return random_state_dict(specs, self.seed, p.tp_rank, p.tp_size, init_std(self.config))
        ignored: set[str] = getattr(self.model, "ignored_tensors", lambda: set())()
        return load_checkpoint(self.checkpoint, specs, p.tp_rank, p.tp_size, ignored, check_finite=not self.allow_non_finite)

    def load(self) -> None:
        """Build the model if needed, load weights, then clean memory fragments with what loading left behind."""
        if self.model is None:
            self.model = self._timed("build", lambda: self.arch.build(self.config, self.backend))
        model = self.model
        shards = self._timed("load", self.read_weights)
        self._timed("load", lambda: model.load_weights(shards))
        # Checkpoints and seeded weights both stream into the parameters a tensor (or a piece of
        # one) at a time and leave nothing staged; the cleanup hooks get the (lazy) mapping loaded from.
        left: Mapping[str, Any] = shards
        if isinstance(shards, CheckpointShards):
            shards.close()
            left = {}
        self._timed("cleanup", lambda: self.backend.clean_memory_fragments(left))

    def decide(self) -> GraphDecision:
        self.decision = self.backend.graph_decision(self.config, requested=self.graph)
        return self.decision

    def prepare(self, max_len: int) -> None:
        """Preallocate the KV cache; capture the decode step when the decision allows it."""
        model, decision = self.model, self.decision
        assert model is not None and decision is not None, "load() and decide() come before prepare()"
        model.allocate_cache(BATCH_SIZE, max_len)
        if decision.allowed:
            graphs = self.backend.graph_backend()
            self._timed("capture", lambda: model.capture(graphs, BATCH_SIZE))

    def generate(self, prompt_ids: list[int], steps: int, image: Any = None) -> GenerationResult:
        """Greedy decoding: prefill the prompt, then `steps - 1` decode steps."""
        import numpy as np

        assert self.model is not None
        ids = _as_ids(prompt_ids)
        start = time.perf_counter()
        progress.report("prefill")
        logits = self.model.prefill(ids, image)
        position = self.model.prefill_length(ids, image)
        token = _greedy(logits, 0)
        prefill_s = time.perf_counter() - start
        self.first_token_at = time.time()
        tokens = [token]
        start, core_start = time.perf_counter(), time.process_time()
        last_report = start
        for step in range(steps - 1):
            progress.report("decode")
            logits = self.model.decode_step(np.asarray([[token]], dtype="int64"), position + step)
            token = _greedy(logits, step + 1)
            tokens.append(token)
            now = time.perf_counter()
            if now - last_report > 2.0:
                self.log(f"decoded {step + 2}/{steps} tokens")
                last_report = now
        decode_s = time.perf_counter() - start
        # The core time this rank got while decoding: below decode_s, the machine was shared.
        self.decode_core_s = time.process_time() - core_start
        self._add_time("prefill", prefill_s)
        self._add_time("decode", decode_s)
        return GenerationResult(tokens, prefill_s, decode_s)

    def reload(self) -> None:
        """A weight update: clear graphs, release weights, clean, load, clean (capture is prepare's)."""
        assert self.model is not None
        # Graphs first: a captured graph still points at the weights (releasing first hung FastDeploy).
        self._timed("clear", lambda: self.backend.clear_graphs(self.model))
        self._timed("release", self.model.release_weights)
        self._timed("cleanup", lambda: self.backend.clean_memory_fragments(None))
        self.load()


def _greedy(logits: Any, step: int) -> int:
    """The argmax token of logits [1, vocab]; non-finite logits stop the run instead of becoming a plausible token."""
    import numpy as np

    row = logits.numpy().reshape(-1)
    if not np.isfinite(row).all():
        bad = int((~np.isfinite(row)).sum())
        raise NumericsError(
            f"step {step} produced {bad} non-finite logit(s) (NaN or Inf); the weights, the inputs or the platform's "
            f"kernels or all-reduce produce non-finite numbers (fd check tests the all-reduce)"
        )
    return int(row.argmax())


def _as_ids(prompt: list[int]) -> Any:
    import numpy as np

    return np.asarray([prompt], dtype="int64")


def load_image(path: str) -> Any:
    """A picture as float32 [C, H, W] with values in [0, 1]: a PNG or JPEG file (decoded to RGB), or a .npy array.

    Resizing and normalisation are the model's (its processor's settings); this only reads and checks.
    """
    import numpy as np

    file = Path(path)
    if not file.is_file():
        what = "no such file" if not file.exists() else "not a regular file"
        raise ConfigError(f"--image {path}: {what}; pass a PNG or JPEG picture or a .npy array [C, H, W]")
    if file.suffix.lower() == ".npy":
        try:
            array = np.load(path, allow_pickle=False, mmap_mode="r")
        except (OSError, ValueError, EOFError) as exc:
            raise ConfigError(f"--image {path}: not a numpy .npy array ({exc or 'empty file'}); save one with numpy.save") from None
        if array.ndim == 4 and array.shape[0] == 1:
            array = array[0]
        if array.ndim != 3 or 0 in array.shape or not np.issubdtype(array.dtype, np.number):
            raise ConfigError(f"--image {path}: expected a numeric array [C, H, W], got shape {list(array.shape)}")
        if array.shape[1] * array.shape[2] > MAX_IMAGE_PIXELS:
            raise ConfigError(f"--image {path}: {array.shape[1]}x{array.shape[2]} is above the {MAX_IMAGE_PIXELS} pixels fd reads; downscale it")
        picture = np.asarray(array, dtype=np.float32)
        if not np.isfinite(picture).all() or picture.min() < 0.0 or picture.max() > 1.0:
            raise ConfigError(f"--image {path}: pixel values must be finite and within [0, 1] (divide 8-bit pixels by 255)")
        return picture
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError(f"--image {path}: reading pictures needs Pillow (pip install pillow), or pass a .npy array [C, H, W]") from None
    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
    except Image.DecompressionBombError:
        raise ConfigError(f"--image {path}: above the {MAX_IMAGE_PIXELS} pixels fd reads; downscale it") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ConfigError(f"--image {path}: not a readable picture ({exc.__class__.__name__}: {exc}); pass a PNG or JPEG file") from None
    return pixels.transpose(2, 0, 1).astype(np.float32) / np.float32(255.0)


def plugin_env(platform: str | None) -> Mapping[str, str]:
    """The environment plugin selection reads, with `platform` forced when given."""
    return {**os.environ, "FD_PLATFORM": platform} if platform else os.environ


def run_rank(run: RunConfig, rank: int = 0, tp: int = 1, group: Any = None, before: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The whole job on one rank; rank 0's result carries the summary.

    `before` holds phases the caller timed before this (the rendezvous), and their start as "at".
    """
    from fd_core.runtime.worker import RankWorker, print_text

    entered = time.time()
    # What this rank holds before any work of its own: a forked rank shares its parent's imports
    # and holds less than a freshly started process that imported paddle.
    entry_rss = resident_bytes()
    before = dict(before or {})
    started = run.started_at if run.started_at is not None else entered
    worker = RankWorker.start(run, rank, tp, group, entered=entered)
    runner, engine = worker.runner, worker.engine
    # Start-up as phases: process start, imports and the plan up to starting the ranks; starting
    # them; the rendezvous; then plugin discovery and the plan checked again on this rank ("setup").
    rank_start = before.pop("at", entered)
    spawned = run.spawned_at if run.spawned_at is not None else rank_start
    # Before what the rank timed itself, in the order they happened.
    early = {"start": max(0.0, spawned - started)}
    if run.spawned_at is not None:
        early["spawn"] = max(0.0, rank_start - spawned)
    runner.timings = {**early, **before, **runner.timings}
    first = worker.generate(worker.plan.request, print_text if rank == 0 and run.stream else None)
    if rank == 0 and run.stream:
        print(flush=True)
    first_token_s = (engine.first_token_at or time.time()) - started
    worker.log(f"first token {first_token_s:.2f}s after start")
    cycles = []
    for cycle in range(run.reload_cycles):
        start = time.perf_counter()
        runner.reload()
        engine.forget_graphs()
        again = engine.generate(worker.plan.request)
        same = [c.token_ids for c in again] == [c.token_ids for c in first]
        cycles.append(
            {
                "cycle": cycle + 1,
                "seconds": round(time.perf_counter() - start, 4),
                "rss_bytes": resident_bytes(),
                "tokens_match": same,
            }
        )
        if not same:
            raise RuntimeError(f"reload cycle {cycle + 1} changed the output: {again[0].token_ids} != {first[0].token_ids}")
    model = runner.model
    return {
        **worker.describe(),
        # What the memory target compares the peak with: this rank's parameters and KV cache.
        "weight_bytes": sum(p.numel().item() * p.element_size() for p in model.parameters()),  # type: ignore[union-attr]
        "kv_cache_bytes": getattr(model, "cache_bytes", lambda: 0)(),
        "entry_rss_bytes": entry_rss,
        "tokens": first[0].token_ids,
        "outputs": [c.to_dict() for c in first],
        "tokens_per_s": round(engine.tokens_per_s, 2),
        "time_to_first_token_s": round(first_token_s, 4),
        "decode_core_share": round(engine.decode_core_s / engine.decode_s, 3) if engine.decode_s > 0 else None,
        "finished_at": time.time(),
        "reload_cycles": cycles,
        "rss_bytes": resident_bytes(),
        "peak_rss_bytes": peak_resident_bytes(),
    }


def spawned_rank(run: RunConfig) -> dict[str, Any]:
    """Entry point of a rank started by paddle.distributed.spawn or launch."""
    from fd_core.distributed import init_rank, quiet_paddle_logs

    quiet_paddle_logs()
    progress.report("rendezvous")
    at = time.time()
    rank, world = init_rank()
    return run_rank(run, rank, world, before={"at": at, "rendezvous": time.time() - at})


def save_random_checkpoint(
    model: str, directory: str, seed: int = 0, config_path: str | None = None, dtype: str = "float32"
) -> Path:
    """Write seeded random weights in the published layout (config.json + model.safetensors, tensors as `dtype`).

    The config is `model`'s tiny preset, or the config.json at `config_path` (a published model's
    own, say), which then names the architecture.
    """
    check_new_directory(Path(directory))  # before paddle is imported or a tensor drawn
    plugins = load_plugins()
    files: dict[str, Any] = {}
    if config_path is None:
        arch = plugins.registry.get(model)
        data = dict(arch.preset)
        files = dict(arch.preset_files)
    else:
        data = read_config_json(Path(config_path))
        found = _architecture_of(data)
        if found is None:
            raise ConfigError(f"{config_path} names no architecture; add \"architectures\": [\"<name>\"]")
        arch = plugins.registry.get(found)
    config = arch.config_from(data, source=config_path or f"preset of {arch.name}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype {dtype}: checkpoints are written as float32, bfloat16 or float16")
    backend = load_backend(ParallelConfig(), plugins=plugins)
    built = arch.build(config, backend)
    specs = built.weight_specs()
    built.release_weights()  # only the specs are needed: the zero parameters would double the peak
    tensors = random_state_dict(specs, seed, std=init_std(config))
    return save_checkpoint(directory, {**data, "architectures": data.get("architectures") or [arch.name]}, tensors, dtype, files)


def summary_lines(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """The human-readable report: rank 0's result, and every reporting rank's peak memory."""
    result = results[0]
    graph = result["graph"]
    lines = [
        f"platform: {result['platform']}   model: {result['model']}   tp: {result['tp']}",
        f"graph: {graph['summary']}",
    ]
    lines += [f"  {CastVote(**v).line()}" for v in graph["votes"]]
    outputs = result.get("outputs") or [{"ids": result["tokens"]}]
    for index, output in enumerate(outputs):
        label = "tokens" if len(outputs) == 1 else f"tokens [{index + 1}]"
        lines.append(f"{label}: {' '.join(str(t) for t in output['ids'])}")
    lines.append(f"speed: {result['tokens_per_s']} tokens/s (decode)")
    lines.append(f"time to first token: {result['time_to_first_token_s']:.2f}s after fd run started")
    cycles = len(result["reload_cycles"])
    # After reload cycles a phase's time is its sum over the first run and every cycle; the label says so.
    label = f"phases (totals over the first run and {cycles} reload cycle{'s' if cycles != 1 else ''})" if cycles else "phases"
    lines.append(f"{label}: " + ", ".join(f"{k} {v:.3f}s" for k, v in result["timings_s"].items()))
    if "wall_s" in result:
        named = sum(result["timings_s"].values())
        lines.append(f"wall: {result['wall_s']:.2f}s, {named / result['wall_s']:.0%} of it in the phases above")
    lines.append("peak memory: " + ", ".join(f"rank {r['rank']} {r['peak_rss_bytes'] / 2**30:.2f} GiB" for r in results))
    if result["reload_cycles"]:
        same = all(c["tokens_match"] for c in result["reload_cycles"])
        lines.append(f"reload cycles: {len(result['reload_cycles'])}, output unchanged: {same}")
    return lines


def as_json(results: Sequence[Mapping[str, Any]]) -> str:
    """Rank 0's result as JSON, with every reporting rank's peak RSS."""
    keys = ("platform", "model", "tp", "graph", "all_reduce", "tokens", "outputs", "tokens_per_s", "time_to_first_token_s", "timings_s",
            "reload_cycles", "rss_bytes", "peak_rss_bytes")
    data = {k: results[0][k] for k in keys}
    if "wall_s" in results[0]:
        data["wall_s"] = results[0]["wall_s"]
    data["weight_bytes_by_rank"] = [r["weight_bytes"] for r in results]
    data["kv_cache_bytes_by_rank"] = [r["kv_cache_bytes"] for r in results]
    data["entry_rss_bytes_by_rank"] = [r["entry_rss_bytes"] for r in results]
    data["decode_core_share_by_rank"] = [r["decode_core_share"] for r in results]
    data["peak_rss_bytes_by_rank"] = [r["peak_rss_bytes"] for r in results]
    return json.dumps(data, indent=2)


