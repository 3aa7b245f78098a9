"""`fd explain`: the chosen platform, the graph decision with every vote, and the plan fd run would make."""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from fd_core.cli.common import fit, positive, print_json, stdout
from fd_core.cli.options import (
    cache_options,
    dtype_option,
    graph_option,
    quantization_options,
    resource_options,
    shared_settings,
)
from fd_core.runtime.report import quantized_line


def add_parser(sub: Any, models: Mapping[str, Any]) -> None:
    """The command and its options."""
    p = sub.add_parser("explain", help="show the chosen platform and the graph decision with every vote", **models)
    p.add_argument("--model", default=None, metavar="ARCH",
                   help="architecture name or alias (default: the checkpoint's, else ernie4_5)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a model directory, as fd run takes it: its config.json sizes the plan, no weight is read "
                        "(default: the --model preset)")
    p.add_argument("--tp", type=positive, default=2, metavar="N",
                   help="tensor-parallel ranks, as fd run takes them (default: 2)")
    graph_option(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    dtype_option(p, "compute dtype, as fd run takes it (default: the platform's preferred one)")
    quantization_options(p)
    resource_options(p)
    cache_options(p)
    p.set_defaults(func=cmd_explain)


def cmd_explain(args: argparse.Namespace) -> int:
    from fd_core.config import ModelConfig, ParallelConfig
    from fd_core.host.backend import load_backend
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.engine.speculation import speculation_dict
    from fd_core.runtime.memory import plan_memory
    from fd_core.runtime.plan import DEFAULT_MODEL, RunConfig, compute_dtype, plan_model, run_settings, run_threads
    from fd_core.runtime.report import (
        capture_line,
        capture_report,
        kernel_line,
        kv_cache_line,
        kv_cache_report,
        threads_line,
    )

    plugins = load_plugins()
    backend = load_backend(ParallelConfig(tp_size=args.tp), plugins=plugins)
    run = RunConfig(model=args.model, tp=args.tp, checkpoint=args.checkpoint, dtype=args.dtype, graph=args.graph,
                    **shared_settings(args))
    if len(plugins.registry):
        # What fd run plans, by the same function: the checkpoint's architecture and config.json, the layout fd run
        # would refuse refused here in the same words (no decision is shown for it), memory, threads and settings.
        model = plan_model(run, plugins, backend, weights=False)
        config, memory, threads, settings = model.config, model.memory, model.threads, model.settings
        model_line = f"{model.arch.name} (registered by {model.arch.package})"
    else:
        name = args.model or DEFAULT_MODEL
        config = ModelConfig(architecture=name, dtype=compute_dtype(args.dtype, backend))
        model_line = f"{name} (no model package registers it)"
        settings = run_settings(run, backend, config.dtype)
        memory = plan_memory(
            config, args.tp, backend.detection, args.memory_fraction, backend.platform, config.architecture,
            block_size=settings.kv_block_size, kv_cache_blocks=args.kv_cache_blocks, max_batch=settings.max_batch,
            max_prefill_tokens=settings.max_prefill_tokens,
            positions=1 + (run.speculation.tokens if run.speculation else 0),
        )
        threads = run_threads(run, backend.detection)
    decision = backend.graph_decision(config, requested=args.graph)
    kv = kv_cache_report(memory, backend.kernels.providers(), args.prefix_caching, settings.max_prefill_tokens)
    capture = capture_report(backend.detection.capture_sizes, settings.max_batch)
    if args.json:
        print_json({**backend.describe(), "model": config.architecture, "graph": decision.to_dict(),
                     "capture": capture, "dtype": config.dtype, "quantization": config.quantization,
                     "memory": memory.to_dict(), "threads": threads.to_dict(), "kv_cache": kv,
                     "settings": settings.to_dict(), "speculative": speculation_dict(run.speculation)})
        return 0
    det = backend.detection
    lines = [
        f"platform: {backend.platform} ({plugins.selection})",
        f"  {'detected' if det.detected else 'not detected'}: {det.reason or '-'}",
    ]
    lines += [f"  {r.name}: {r.status}" for r in plugins.records if r.kind == "platform" and not r.active]
    lines += [f"model: {model_line}, tp={args.tp}", f"all-reduce: {backend.all_reduce_binding}",
              f"kernels: {kernel_line(backend.kernels.providers())}", f"graph: {decision.summary()}"]
    lines += [f"  {vote.line()}" for vote in decision.votes]
    if decision.allowed:
        lines.append(capture_line(capture))
    quantized = (f"; {quantized_line(config.quantization, config.quantization_group, config.float_embeddings)} "
                 f"(quant_matmul, weights quantized at load)" if config.quantization else "")
    lines += [f"dtype: {config.dtype}{quantized}", threads_line(threads.to_dict()), f"memory: {memory.summary()}",
              kv_cache_line(kv), "settings (each the option's, the platform's or fd's default):"]
    lines += [f"  {line}" for line in settings.lines()]
    lines.append(f"speculative decoding: {run.speculation.describe() if run.speculation else 'off'}")
    print(fit(lines), file=stdout())
    return 0
