"""Options several `fd` commands take, each added by one function so that its name, type and help are the same
wherever it appears."""

from __future__ import annotations

import argparse
from typing import Any

from fd_core.cli.common import non_negative, positive
from fd_core.config import COMPUTE_DTYPES
from fd_core.quantization import DEFAULT_GROUPS, SCHEMES

GRAPH_HELP = ("auto: capture unless a plugin vetoes or reports no gain; on: capture unless a plugin vetoes; "
              "off: eager, no plugin asked (default: auto)")
THREADS_HELP = ("compute threads per rank (default: the platform's threads variable if the user set it "
                "(fd explain names it), else the cores this process may use (affinity mask, cgroup quota) "
                "shared among the ranks on this host)")


def graph_option(p: argparse.ArgumentParser) -> None:
    """--graph auto|on|off."""
    p.add_argument("--graph", choices=("auto", "on", "off"), default="auto", help=GRAPH_HELP)


def dtype_option(p: argparse.ArgumentParser, help: str) -> None:
    """--dtype, one of the compute dtypes."""
    p.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES, help=help)


def quantization_options(p: argparse.ArgumentParser) -> None:
    """--quantization, --quantization-group and --float-embeddings."""
    p.add_argument("--quantization", default=None, choices=tuple(SCHEMES),
                   help="weight-only quantization of the linear layers and the LM head at load: wint8 (int8 "
                        "weights) or wint4 (4-bit), a scale per group of inputs (--quantization-group); a tied "
                        "embedding looks tokens up in the head's quantized table; norms, routers and vision towers "
                        "stay in the compute dtype (default: none)")
    p.add_argument("--quantization-group", type=int, default=None, metavar="N",
                   help=f"inputs one scale of --quantization covers, or 0 for one scale per output channel (default: "
                        f"{', '.join(f'{g} for {s}' for s, g in DEFAULT_GROUPS.items())}; a weight whose inputs are "
                        f"no multiple of it is quantized per output channel)")
    p.add_argument("--float-embeddings", action="store_true",
                   help="under --quantization, keep the embedding table and the LM head in the compute dtype")


def resource_options(p: argparse.ArgumentParser) -> None:
    """--memory-fraction and --threads."""
    from fd_core.config import DEFAULT_MEMORY_FRACTION

    p.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION, metavar="F",
                   help=f"the share of each device's free memory for weights and KV cache, in (0, 1]; the cache's "
                        f"capacity (batch x context) is what the weights leave (default: {DEFAULT_MEMORY_FRACTION})")
    p.add_argument("--threads", type=positive, default=None, metavar="N", help=THREADS_HELP)


def seed_option(p: argparse.ArgumentParser, help: str) -> None:
    """--seed N."""
    p.add_argument("--seed", type=non_negative, default=0, metavar="N", help=help)


def cache_options(p: argparse.ArgumentParser) -> None:
    """The batch, the paged KV cache and speculative decoding, as fd run, fd serve and fd explain take them."""
    from fd_core.detection import DEFAULT_KV_BLOCK_SIZE
    from fd_core.runtime.engine.speculation import DEFAULT_TOKENS, METHODS
    from fd_core.runtime.memory import DEFAULT_MAX_PREFILL_TOKENS
    from fd_core.runtime.settings import DEFAULT_MAX_BATCH

    p.add_argument("--kv-block-size", type=positive, default=None, metavar="N",
                   help=f"positions a KV-cache block holds (default: the platform's, else {DEFAULT_KV_BLOCK_SIZE})")
    p.add_argument("--kv-cache-blocks", type=positive, default=None, metavar="N",
                   help="KV-cache blocks a rank allocates, at most what the memory plan leaves (default: that, capped "
                        "by the platform's KV budget, by what --max-batch sequences of the whole context could use "
                        "and, for fd run, by what its prompts and new tokens use)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share full KV-cache blocks between sequences with the same prefix (default: share)")
    p.add_argument("--max-batch", type=positive, default=None, metavar="N",
                   help=f"most sequences decoded together (default: the platform's, else {DEFAULT_MAX_BATCH})")
    p.add_argument("--max-prefill-tokens", type=positive, default=None, metavar="N",
                   help=f"most prompt tokens one step prefills, beside the running decodes; a longer prompt is "
                        f"prefilled in chunks (default: the platform's, else {DEFAULT_MAX_PREFILL_TOKENS})")
    p.add_argument("--max-prefill-prompts", type=positive, default=None, metavar="N",
                   help="most prompts one step prefills (default: the platform's, else as many as the token budget "
                        "allows)")
    p.add_argument("--speculative", choices=METHODS, default=None,
                   help="speculative decoding: each step a proposer guesses a sequence's next tokens and one step of "
                        "the model checks them all, giving the same tokens (ngram: what followed the sequence's last "
                        "few tokens earlier in its prompt or output; draft: a draft model's greedy tokens, "
                        "--draft-checkpoint; docs/speculative.md; default: off)")
    p.add_argument("--num-speculative-tokens", type=positive, default=None, metavar="K",
                   help=f"most tokens the proposer guesses a step (default: {DEFAULT_TOKENS})")
    p.add_argument("--draft-checkpoint", default=None, metavar="DIR",
                   help="the draft model of --speculative draft: a checkpoint directory of any registered "
                        "architecture with the model's vocabulary, run on the same platform and tp (default: none)")


def canary_option(p: argparse.ArgumentParser) -> None:
    """--no-kernel-canary, as fd run and fd serve take it."""
    p.add_argument("--no-kernel-canary", dest="kernel_canary", action="store_false",
                   help="do not check, on each rank before the first request, the plugins' kernels the run calls "
                        "against fd's native ops (for a platform certified with fd check; default: check, well under "
                        "a second)")


# What quantization_options, resource_options and cache_options set, by the names RunConfig, LLM and fd serve take.
SHARED_SETTINGS = ("quantization", "quantization_group", "float_embeddings", "memory_fraction", "threads",
                   "kv_block_size", "kv_cache_blocks", "prefix_caching", "max_batch", "max_prefill_tokens",
                   "max_prefill_prompts", "speculative", "num_speculative_tokens", "draft_checkpoint")


def shared_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The values of the options several commands take, as keyword arguments."""
    return {name: getattr(args, name) for name in SHARED_SETTINGS}
