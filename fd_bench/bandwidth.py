"""The machine's read bandwidth as a decode step sees it: a float32 matrix-vector product over a matrix far
larger than the caches, in one process or several at once.

    python -m fd_bench.bandwidth PROCESSES [MIB]

Prints one JSON line: each process's GB/s (median of its repeats) and their sum.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time


def one(mib: int, repeats: int = 12) -> float:
    """GB/s of x @ W in this process, W [rows, 1024] float32 of `mib` MiB (median over repeats)."""
    import paddle

    paddle.set_device("cpu")
    rows = (mib << 20) // (4 * 1024)
    weight = paddle.rand([rows, 1024], dtype="float32")
    x = paddle.rand([1, rows], dtype="float32")
    paddle.matmul(x, weight)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        paddle.matmul(x, weight).numpy()
        times.append(time.perf_counter() - start)
    return rows * 1024 * 4 / statistics.median(times) / 1e9


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        print(json.dumps(one(int(argv[1]))))
        return 0
    procs, mib = int(argv[0]), int(argv[1]) if len(argv) > 1 else 512
    children = [subprocess.Popen([sys.executable, "-m", "fd_bench.bandwidth", "--one", str(mib)],
                                 stdout=subprocess.PIPE, text=True)
                for _ in range(procs)]
    each = [json.loads(child.communicate(timeout=600)[0].strip().splitlines()[-1]) for child in children]
    print(json.dumps({"per_process_gb_s": each, "total_gb_s": sum(each)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
