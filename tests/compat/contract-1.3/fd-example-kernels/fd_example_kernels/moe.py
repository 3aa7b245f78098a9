"""moe_experts as a fused-MoE kernel is usually built: dispatch (the (token, choice) pairs sorted by expert), one
contiguous run of rows per expert through its gated FFN, then combine (each row's output weighted and added back to
its token). fd's native op loops over experts on the tokens routed to each instead.

The dispatch reads each expert's row count on the host, which a captured graph cannot replay: inside a capture
(`fd_core.graphs.capturing()`) or a static program it takes fixed shapes instead, every pair's expert gathered.

FD_EXAMPLE_KERNELS_BREAK=moe_experts makes the combine forget the router's weights (every chosen expert added at
weight 1): `fd check` then fails, naming moe_experts.
"""

from __future__ import annotations

import os
from typing import Any


def moe_experts(x: Any, gate: Any, up: Any, down: Any, chosen: Any, weights: Any) -> Any:
    """sum_j weights[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]), e = chosen[t, j], for x [T, H] -> [T, H]."""
    import paddle
    import paddle.nn.functional as F

    from fd_core.graphs import capturing

    tokens, top_k = chosen.shape[0], chosen.shape[1]
    pair_token = paddle.arange(tokens, dtype="int64").unsqueeze(1).expand([tokens, top_k]).reshape([-1])
    pair_expert, pair_weight = chosen.reshape([-1]), weights.reshape([-1])
    if os.environ.get("FD_EXAMPLE_KERNELS_BREAK") == "moe_experts":
        pair_weight = paddle.ones_like(pair_weight)
    if capturing() or not paddle.in_dynamic_mode():
        rows = paddle.gather(x, pair_token).unsqueeze(1)  # [T*k, 1, H]
        inner = F.silu(paddle.matmul(rows, paddle.gather(gate, pair_expert), transpose_y=True)) * paddle.matmul(
            rows, paddle.gather(up, pair_expert), transpose_y=True)
        out = paddle.matmul(inner, paddle.gather(down, pair_expert), transpose_y=True).squeeze(1)
        return paddle.zeros_like(x).index_add(pair_token, 0, out * pair_weight.unsqueeze(-1))
    # Dispatch: the pairs sorted by expert, so each expert's rows are one contiguous run.
    order = paddle.argsort(pair_expert, stable=True)
    sorted_token = paddle.gather(pair_token, order)
    counts = paddle.bincount(pair_expert, minlength=gate.shape[0]).numpy().tolist()
    runs = paddle.split(paddle.gather(x, sorted_token), [int(c) for c in counts], axis=0)
    outs = [paddle.matmul(F.silu(paddle.matmul(r, gate[e], transpose_y=True))
                          * paddle.matmul(r, up[e], transpose_y=True), down[e], transpose_y=True)
            for e, r in enumerate(runs) if r.shape[0] > 0]
    # Combine: each row's output at its pair's weight, added to its token.
    done = paddle.concat(outs, axis=0) * paddle.gather(pair_weight, order).unsqueeze(-1)
    return paddle.zeros_like(x).index_add(sorted_token, 0, done)
