"""Greedy decode with Hugging Face transformers on a checkpoint directory, timed as `fd run` times it.

    python -m fd_bench.hf_decode CHECKPOINT PROMPT_IDS STEPS [THREADS [DTYPE]]

Prints one JSON line: the tokens, decode tokens per second (the steps after the first token) and the
peak RSS. THREADS is torch's thread count (default: torch's own, one per core); DTYPE float32 (the
default, as fd computes on cpu) or bfloat16 (reported: Paddle's CPU build has no bfloat16 matmul).
"""

from __future__ import annotations

import json
import resource
import sys
import time


def main(argv: list[str]) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    directory, prompt, steps = argv[0], [int(t) for t in argv[1].split(",")], int(argv[2])
    if len(argv) > 3:
        torch.set_num_threads(int(argv[3]))
    dtype = getattr(torch, argv[4]) if len(argv) > 4 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        past, tokens = out.past_key_values, [token]
        start = time.perf_counter()
        for _ in range(steps - 1):
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
            tokens.append(token)
        decode_s = time.perf_counter() - start
    print(json.dumps({
        "tokens": tokens,
        "tokens_per_s": (steps - 1) / decode_s if decode_s > 0 else 0.0,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).replace("torch.", ""),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
