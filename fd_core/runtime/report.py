"""The reports of `fd run`: the human-readable lines and the JSON, from the ranks' results."""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from fd_core.graphs import CastVote
from fd_core.quantization import head_bits
from fd_core.runtime.memory import MemoryPlan


def kernel_line(providers: Mapping[str, str]) -> str:
    """Each op with the plugin whose kernel serves it: "rms_norm: kprobe, silu_and_mul: native, ..."."""
    return ", ".join(f"{op}: {provider}" for op, provider in providers.items())


NATIVE_KV_LAYOUT = "[kv_heads, num_blocks, block_size, head_dim] (native)"


def kv_cache_report(memory: MemoryPlan, providers: Mapping[str, str], prefix_caching: bool, max_prefill_tokens: int
                    ) -> dict[str, Any]:
    """The paged KV cache as `fd explain --json` shows it: blocks, their size, bytes and tokens per rank, the layout
    (the provider of allocate_kv_cache), prefix caching and the prefill chunk."""
    provider = providers.get("allocate_kv_cache", "native")
    layout = NATIVE_KV_LAYOUT if provider == "native" else f"plugin {provider!r}'s (its allocate_kv_cache)"
    return {**memory.kv_cache(), "layout": layout, "prefix_caching": prefix_caching,
            "max_prefill_tokens": max_prefill_tokens}


def kv_cache_line(kv: Mapping[str, Any]) -> str:
    """ "kv cache: 2048 blocks of 16 (32768 tokens, 16.00 MiB) per rank, layout ...; prefix caching on; ..." """
    size = f"{kv['bytes'] / 2**20:.2f} MiB" if kv["bytes"] < 2**30 else f"{kv['bytes'] / 2**30:.2f} GiB"
    return (f"kv cache: {kv['blocks']} blocks of {kv['block_size']} ({kv['tokens']} tokens, {size}) per rank, "
            f"layout {kv['layout']}; prefix caching {'on' if kv['prefix_caching'] else 'off'}; prompts prefilled "
            f"{kv['max_prefill_tokens']} tokens a step at most")


def threads_line(threads: Mapping[str, Any]) -> str:
    """ "threads: 2 per rank (2 usable core(s) (the platform's report), shared by 1 rank(s) on this host)"; how a
    platform applies them in each phase is its own (fd_rank_start, fd_before_step)."""
    return f"threads: {threads['per_rank']} per rank ({threads['reason']})"


def capture_report(declared: Sequence[int], max_batch: int, eager_steps: int | None = None) -> dict[str, Any]:
    """The decode batch sizes graphs capture (the platform's Detection.capture_sizes, else fd's powers of two up to
    the max batch) and where they came from; a run adds how many decode steps ran eagerly above the largest."""
    from fd_core.runtime.engine.loop import capture_sizes_for

    sizes = capture_sizes_for(declared, max_batch)
    report: dict[str, Any] = {"sizes": sizes, "from": "platform" if declared else "fd"}
    if eager_steps is not None:
        report["eager_steps"] = eager_steps
    return report


def capture_line(capture: Mapping[str, Any]) -> str:
    """ "capture sizes: 1, 2, 4, 8 (the platform's); a larger batch decodes eagerly; 3 steps did" """
    where = "the platform's" if capture["from"] == "platform" else "fd's: powers of two up to the max batch"
    line = (f"capture sizes: {', '.join(str(n) for n in capture['sizes'])} ({where}); a batch between two is padded "
            f"up to the next, one above the largest decodes eagerly")
    if capture.get("eager_steps"):
        line += f" ({capture['eager_steps']} decode step(s) did)"
    return line


def scheme_groups(group: int) -> str:
    """How a run's weights are grouped, as fd explain and fd run say it."""
    return f"in groups of {group}" if group else "per output channel"


def quantized_line(scheme: str, group: int, float_embeddings: bool) -> str:
    """What a run quantizes and how, as fd explain and fd run say it."""
    grouped = scheme_groups(group)
    if float_embeddings:
        return f"linear layers {scheme} {grouped}"
    head = f"wint{head_bits(scheme)}"
    if head == scheme:
        return f"linear layers and LM head {scheme} {grouped}"
    return f"linear layers {scheme}, LM head {head}, {grouped}"


def speculation_line(spec: Mapping[str, Any]) -> str:
    """How speculative decoding went, as fd run reports it."""
    proposed, accepted = spec["proposed"], spec["accepted"]
    rate = f" ({accepted / proposed:.0%})" if proposed else ""
    return (f"speculative: {spec['proposer']}, k={spec['k']}: {proposed} token(s) proposed, {accepted} accepted{rate}, "
            f"in {spec['verify_steps']} verify step(s)")


def summary_lines(results: Sequence[Mapping[str, Any]], verbose: bool = False) -> list[str]:
    """The human-readable report: rank 0's result, and every reporting rank's peak memory; `verbose` (fd -v) adds the
    decode step's parts."""
    result = results[0]
    graph = result["graph"]
    lines = [
        f"platform: {result['platform']}   model: {result['model']}   tp: {result['tp']}"
        + (f"   dtype: {result['dtype']}" if "dtype" in result else "")
        + (", " + quantized_line(result["quantization"], result.get("quantization_group") or 0,
                                 bool(result.get("float_embeddings"))) if result.get("quantization") else ""),
        f"kernels: {kernel_line(result['kernels'])}",
        *([threads_line(result["threads"])] if result.get("threads") else []),
        f"graph: {graph['summary']}",
    ]
    lines += [f"  {CastVote(**v).line()}" for v in graph["votes"]]
    if graph.get("allowed") and result.get("capture") and (verbose or result["capture"].get("eager_steps")):
        lines.append(capture_line(result["capture"]))
    outputs = result.get("outputs") or [{"ids": result["tokens"]}]
    for index, output in enumerate(outputs):
        label = "tokens" if len(outputs) == 1 else f"tokens [{index + 1}]"
        lines.append(f"{label}: {' '.join(str(t) for t in output['ids'])}")
    lines.append(f"speed: {result['tokens_per_s']} tokens/s (decode)")
    if result.get("speculative"):
        lines.append(speculation_line(result["speculative"]))
    if verbose and result.get("decode_step_ms"):
        step = result["decode_step_ms"]
        lines.append(f"decode step: {step['step']:.2f} ms (model and loop {step['model_and_loop']:.2f} ms, "
                     f"non-finite check and sampling {step['choose']:.2f} ms); per op: fd bench --rows step")
    lines.append(f"time to first token: {result['time_to_first_token_s']:.2f}s after fd run started")
    cycles = len(result["reload_cycles"])
    # After reload cycles a phase's time is its sum over the first run and every cycle; the label says so.
    label = (
        f"phases (totals over the first run and {cycles} reload cycle{'s' if cycles != 1 else ''})"
        if cycles
        else "phases"
    )
    lines.append(f"{label}: " + ", ".join(f"{k} {v:.3f}s" for k, v in result["timings_s"].items()))
    if "wall_s" in result:
        named = sum(result["timings_s"].values())
        lines.append(f"wall: {result['wall_s']:.2f}s, {named / result['wall_s']:.0%} of it in the phases above")
    lines.append(
        "peak memory: " + ", ".join(f"rank {r['rank']} {r['peak_rss_bytes'] / 2**30:.2f} GiB" for r in results)
    )
    if result.get("memory") is not None:
        lines.append(f"memory plan: {MemoryPlan(**result['memory']).summary()}")
    if result["reload_cycles"]:
        same = all(c["tokens_match"] for c in result["reload_cycles"])
        lines.append(f"reload cycles: {len(result['reload_cycles'])}, output unchanged: {same}")
    return lines


def as_json(results: Sequence[Mapping[str, Any]]) -> str:
    """Rank 0's result as JSON, with every reporting rank's peak RSS."""
    keys = ("platform", "model", "tp", "graph", "all_reduce", "kernels", "tokens", "outputs", "tokens_per_s",
            "time_to_first_token_s", "timings_s", "reload_cycles", "rss_bytes", "peak_rss_bytes")
    data = {k: results[0][k] for k in keys}
    # The compute dtype, and the memory plan: weights per rank, KV-cache capacity (tokens), the fraction.
    data.update({k: results[0][k] for k in ("dtype", "quantization", "quantization_group", "float_embeddings",
                                            "memory", "threads", "decode_step_ms", "speculative")
                 if k in results[0]})
    if "wall_s" in results[0]:
        data["wall_s"] = results[0]["wall_s"]
    data["weight_bytes_by_rank"] = [r["weight_bytes"] for r in results]
    data["kv_cache_bytes_by_rank"] = [r["kv_cache_bytes"] for r in results]
    data["entry_rss_bytes_by_rank"] = [r["entry_rss_bytes"] for r in results]
    data["decode_core_share_by_rank"] = [r["decode_core_share"] for r in results]
    data["peak_rss_bytes_by_rank"] = [r["peak_rss_bytes"] for r in results]
    return json.dumps(data, indent=2)


