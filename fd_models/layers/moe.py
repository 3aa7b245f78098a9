"""ERNIE-4.5-VL's mixture-of-experts block: modality-isolated routed experts plus shared experts.

Text tokens go to the text router and text experts, image tokens (placeholders and the image start
and end tokens) to the vision router and vision experts; every token also goes through the shared
experts. Routing is the reference's: softmax probabilities over the experts in float32, the top k
chosen on probability + score-correction bias, their probabilities renormalised.

Tensor parallel: each expert's intermediate dimension is split across ranks (gate/up by rows, down
by columns), as the dense MLP is, so every rank holds a slice of every expert and the block ends
in one all-reduce of the summed partial outputs. Checkpoint names are one tensor per expert
(`mlp.experts.{i}.gate_proj.weight`, text experts first); here each kind is stacked into one
tensor per projection, which the Backend's `moe_experts` op takes with each token's chosen experts and
their weights (fd_core.kernels). Its native implementation gathers a decode step's k experts a token
with fixed shapes (capturable), and runs each expert on the tokens routed to it in a prefill
(data-dependent shapes; never captured). Routing stays here.
"""

from __future__ import annotations

from typing import Any

import paddle
import paddle.nn.functional as F
from paddle import nn

from fd_core import WeightSpec
from fd_models.layers.params import new_param, new_stacked_param
from fd_models.layers.products import ExpertProducts, Product


class _Experts:
    """One modality's routed experts, stacked: gate/up [E, I/tp, H], down [E, H, I/tp] (parameters of the MoE block)."""

    def __init__(
        self, first: int, count: int, hidden: int, intermediate: int, tp: int, dtype: str, parent: nn.Layer, kind: str,
        ctx: Any,
    ) -> None:
        names = [f"experts.{first + i}" for i in range(count)]
        # Registered on the MoE block itself so the stacked parts resolve to `mlp.experts.{i}....`.
        self.gate = new_stacked_param(parent, [(f"{n}.gate_proj.weight", WeightSpec((intermediate, hidden), 0,
                                                                                    dtype)) for n in names], tp,
                                                                                    attr=f"{kind}_gate")
        self.up = new_stacked_param(parent, [(f"{n}.up_proj.weight", WeightSpec((intermediate, hidden), 0,
                                                                                dtype)) for n in names], tp,
                                                                                attr=f"{kind}_up")
        self.down = new_stacked_param(parent, [(f"{n}.down_proj.weight", WeightSpec((hidden, intermediate), 1,
                                                                                    dtype)) for n in names], tp,
                                                                                    attr=f"{kind}_down")
        # Through the moe_experts op, its three weights prepared together at load when the kernel in use asks.
        self.product = ExpertProducts(parent, (f"{kind}_gate", f"{kind}_up", f"{kind}_down"), ctx)


class MoEBlock(nn.Layer):
    """Routed text and vision experts and shared experts; output all-reduced once through the Backend."""

    takes_vision_mask = True  # the decoder layer passes which tokens are image tokens

    def __init__(
        self, hidden: int, intermediate: tuple[int, int], experts: int, top_k: int, shared: int, norm_min: float,
        ctx: Any, dtype: str = "float32", shared_bias: bool = False,
    ) -> None:
        super().__init__()
        self.ctx, self.hidden, self.experts, self.top_k, self.norm_min = ctx, hidden, experts, top_k, norm_min
        self.silu_and_mul = ctx.ops.silu_and_mul
        tp = ctx.parallel.tp_size
        # The routers are [hidden, experts] in the checkpoint (input-major) and run in float32, as the reference's.
        self.gate = nn.Layer()
        new_param(self.gate, WeightSpec((hidden, experts), None, "float32"), 1)
        new_param(self.gate, WeightSpec((hidden, experts), None, "float32"), 1, attr="weight_1")
        # The routers' products, never quantized (a router's small errors change which experts run).
        self.routers = (Product(self.gate, "weight", False, ctx, quantizable=False),
                        Product(self.gate, "weight_1", False, ctx, quantizable=False))
        self.moe_statics = nn.Layer()
        new_param(self.moe_statics, WeightSpec((2, experts), None, "float32", init="zeros"), 1,
                  attr="e_score_correction_bias")
        self.text = _Experts(0, experts, hidden, intermediate[0], tp, dtype, self, "text", ctx)
        self.vision = _Experts(experts, experts, hidden, intermediate[1], tp, dtype, self, "vision", ctx)
        self.shared = shared > 0
        if self.shared:
            # Like the dense MLP, but its partial output joins the experts' before the block's one all-reduce.
            width = intermediate[0] * shared
            self.shared_experts = nn.Layer()
            for name, spec, bias_axis in (("gate_proj", WeightSpec((width, hidden), 0, dtype), 0),
                                          ("up_proj", WeightSpec((width, hidden), 0, dtype), 0),
                                          ("down_proj", WeightSpec((hidden, width), 1, dtype), None)):
                projection = nn.Layer()
                new_param(projection, spec, tp)
                projection.bias = None
                if shared_bias:  # `use_bias` configs: the down bias is whole and added once, after the sum
                    new_param(projection, WeightSpec((spec.shape[0],), bias_axis, dtype, init="zeros"), tp, attr="bias")
                projection.product = Product(projection, "weight", True, ctx)
                self.shared_experts.add_sublayer(name, projection)

    def _route(
        self, x: paddle.Tensor, router: Product, bias: paddle.Tensor,
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(chosen experts [T, k] int64, their weights [T, k]) for tokens x [T, H]."""
        probs = F.softmax(router(x.astype("float32")), axis=-1)
        _, chosen = paddle.topk(probs + bias, self.top_k, axis=-1)
        weights = paddle.take_along_axis(probs, chosen, axis=-1)
        weights = weights / paddle.clip(paddle.sum(weights, axis=-1, keepdim=True), min=self.norm_min)
        return chosen, weights.astype(x.dtype)

    def _experts(
        self, x: paddle.Tensor, experts: _Experts, router: Product, bias: paddle.Tensor,
        only: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """This rank's partial output of one modality's routed experts for tokens x [T, H] (the moe_experts op);
        with `only` [T] bool, the other tokens are routed at weight 0, so their rows of the result are 0 and cost
        nothing where the op runs each expert on its routed tokens."""
        chosen, weights = self._route(x, router, bias)
        if only is not None:
            weights = weights * only.astype(weights.dtype).unsqueeze(-1)
        return experts.product(x, chosen, weights)

    def forward(self, x: paddle.Tensor, vision_mask: paddle.Tensor | None = None) -> paddle.Tensor:
        """x [B, S, H]; `vision_mask` [B, S] (True for image tokens) or None (all text, as in decode) -> [B, S, H]."""
        batch, length, hidden = x.shape
        flat = x.reshape([-1, hidden])
        bias = self.moe_statics.e_score_correction_bias
        if vision_mask is None:
            out = self._experts(flat, self.text, self.routers[0], bias[0])
        else:
            # Each set of experts computes only its own tokens (the other set's rows are taken from it below).
            is_vision = vision_mask.reshape([-1])
            out = self._experts(flat, self.text, self.routers[0], bias[0], ~is_vision)
            vision = self._experts(flat, self.vision, self.routers[1], bias[1], is_vision)
            out = paddle.where(is_vision.reshape([-1, 1]), vision, out)
        if self.shared:
            s = self.shared_experts
            inner = self.silu_and_mul(self._project(flat, s.gate_proj), self._project(flat, s.up_proj))
            out = out + s.down_proj.product(inner)
        out = self.ctx.all_reduce(out)
        if self.shared and self.shared_experts.down_proj.bias is not None:
            out = out + self.shared_experts.down_proj.bias
        return out.reshape([batch, length, hidden])

    def _project(self, x: paddle.Tensor, layer: nn.Layer) -> paddle.Tensor:
        out = layer.product(x)
        return out if layer.bias is None else out + layer.bias
