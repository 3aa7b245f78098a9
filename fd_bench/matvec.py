"""The matrix-vector ceiling of a decode step: one float32 product per weight matrix of a model (every layer's
projections and the LM head, the shapes of its config.json), nothing else, in Paddle or torch.

    python -m fd_bench.matvec CONFIG LIBRARY PROCESSES THREADS [REPEATS]

LIBRARY is paddle, torch, or fd-split (Paddle's product through the cpu platform's kernel, which splits a
one-row product across THREADS threads of one process, MKL on one); PROCESSES > 1 runs that many processes
at once, each over its 1/PROCESSES share of every matrix's columns (as tensor-parallel ranks hold them).
Prints one JSON line: passes per second of the slowest process (a step waits for every rank) and GB/s
over all of them.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any


def shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """(in, out) of every weight matrix a decode step reads: per layer q, k, v, o, gate, up, down; then the LM head."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    layer = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]
    return layer * layers + [(hidden, config["vocab_size"])]


def one(config: dict[str, Any], library: str, share: int, threads: int, repeats: int) -> float:
    """Seconds of one pass (median of `repeats`) over this process's 1/share of each matrix's columns."""
    mats = [(k, max(1, n // share)) for k, n in shapes(config)]
    if library == "torch":
        import torch

        torch.set_num_threads(threads)
        weights = [torch.randn(n, k) for k, n in mats]  # torch's own layout: [out, in], x @ W^T
        inputs = {k: torch.randn(1, k) for k, _ in mats}

        def run() -> None:
            with torch.inference_mode():
                for (k, _), w in zip(mats, weights, strict=True):
                    torch.nn.functional.linear(inputs[k], w)
    else:
        import paddle
        from paddle.base import core

        from fd_core.kernels import set_compute_threads
        from fd_plugins.cpu.products import matmul

        paddle.set_device("cpu")
        split = library == "fd-split"
        core.set_num_threads(1 if split else threads)
        set_compute_threads(threads if split else 1)
        # [in, out], x @ W: the layout Paddle's CPU product reads fastest
        weights_p = [paddle.randn([k, n]) for k, n in mats]
        inputs_p = {k: paddle.randn([1, k]) for k, _ in mats}

        def run() -> None:
            out = None
            for (k, _), w in zip(mats, weights_p, strict=True):
                out = matmul(inputs_p[k], w, False) if split else paddle.matmul(inputs_p[k], w)
            assert out is not None
            out.numpy()

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        config = json.loads(open(argv[1]).read())
        print(json.dumps(one(config, argv[2], int(argv[3]), int(argv[4]), int(argv[5]))))
        return 0
    path, library, procs, threads = argv[0], argv[1], int(argv[2]), int(argv[3])
    repeats = int(argv[4]) if len(argv) > 4 else 8
    config = json.loads(open(path).read())
    children = [subprocess.Popen([sys.executable, "-m", "fd_bench.matvec", "--one", path, library, str(procs),
                                  str(threads), str(repeats)],
                                 stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    each = [json.loads(child.communicate(timeout=900)[0].strip().splitlines()[-1]) for child in children]
    nbytes = sum(k * n * 4 for k, n in shapes(config))
    print(json.dumps({"library": library, "processes": procs, "threads": threads, "pass_s": each,
                      "passes_per_s": 1 / max(each), "gb_s": nbytes / max(each) / 1e9}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
