"""moe_experts as a fused-MoE kernel is usually built: the experts' weights in the kernel's own layout, prepared once
at load (gate and up fused); dispatch (the (token, choice) pairs sorted by expert), one contiguous run of rows per
expert through its gated FFN, then combine (each row's output weighted and added back to its token). fd's native op
loops over experts on the tokens routed to each instead.

The dispatch reads each expert's row count on the host, which a captured graph cannot replay: inside a capture
(`fd_core.graphs.capturing()`) or a static program it takes fixed shapes instead, every pair's expert gathered.

FD_EXAMPLE_KERNELS_BREAK=moe_experts makes the combine forget the router's weights (every chosen expert added at
weight 1): `fd check` then fails, naming moe_experts. FD_EXAMPLE_KERNELS_BREAK=prepare_moe makes the preparation
remember its result by the gate tensor's id(), as a cache a vendor might write: right at load, stale once the same
tensors are refilled (a reload), and `fd check` fails naming moe_experts.
"""

from __future__ import annotations

import os
from typing import Any

_by_id: dict[int, Any] = {}  # FD_EXAMPLE_KERNELS_BREAK=prepare_moe only


def prepare_moe(gate: Any, up: Any, down: Any) -> tuple[Any, None, Any]:
    """The experts' weights in this kernel's layout, once when they load (contract 1.4): gate and up fused and
    transposed into one [E, H, 2I] (one product a run of rows gives both), down transposed to [E, I, H]; `up` is then
    carried inside the first, so the kernel receives None in its place."""
    import paddle

    broken = os.environ.get("FD_EXAMPLE_KERNELS_BREAK") == "prepare_moe"
    if broken and id(gate) in _by_id:
        return _by_id[id(gate)]
    prepared = (paddle.concat([gate, up], axis=1).transpose([0, 2, 1]).contiguous(), None,
                down.transpose([0, 2, 1]).contiguous())
    if broken:
        _by_id[id(gate)] = prepared
    return prepared


def moe_experts(x: Any, gate: Any, up: Any, down: Any, chosen: Any, weights: Any) -> Any:
    """sum_j weights[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]), e = chosen[t, j], for x [T, H] -> [T, H], on the
    weights prepare_moe made (the op's argument names, its layout): gate [E, H, 2I] (gate's I columns, then up's), up
    None, down [E, I, H]."""
    import paddle
    import paddle.nn.functional as F

    from fd_core.graphs import capturing

    gate_up = gate
    inner = gate_up.shape[2] // 2

    def ffn(rows: Any, expert: Any) -> Any:
        both = paddle.matmul(rows, gate_up[expert] if isinstance(expert, int) else expert[0])
        gated = F.silu(both[..., :inner]) * both[..., inner:]
        return paddle.matmul(gated, down[expert] if isinstance(expert, int) else expert[1])

    tokens, top_k = chosen.shape[0], chosen.shape[1]
    pair_token = paddle.arange(tokens, dtype="int64").unsqueeze(1).expand([tokens, top_k]).reshape([-1])
    pair_expert, pair_weight = chosen.reshape([-1]), weights.reshape([-1])
    if os.environ.get("FD_EXAMPLE_KERNELS_BREAK") == "moe_experts":
        pair_weight = paddle.ones_like(pair_weight)
    if capturing() or not paddle.in_dynamic_mode():
        rows = paddle.gather(x, pair_token).unsqueeze(1)  # [T*k, 1, H]
        out = ffn(rows, (paddle.gather(gate_up, pair_expert), paddle.gather(down, pair_expert))).squeeze(1)
        return paddle.zeros_like(x).index_add(pair_token, 0, out * pair_weight.unsqueeze(-1))
    # Dispatch: the pairs sorted by expert, so each expert's rows are one contiguous run.
    order = paddle.argsort(pair_expert, stable=True)
    sorted_token = paddle.gather(pair_token, order)
    counts = paddle.bincount(pair_expert, minlength=gate_up.shape[0]).numpy().tolist()
    runs = paddle.split(paddle.gather(x, sorted_token), [int(c) for c in counts], axis=0)
    outs = [ffn(r, e) for e, r in enumerate(runs) if r.shape[0] > 0]
    # Combine: each row's output at its pair's weight, added to its token.
    done = paddle.concat(outs, axis=0) * paddle.gather(pair_weight, order).unsqueeze(-1)
    return paddle.zeros_like(x).index_add(sorted_token, 0, done)
