"""The named ops the model layers call, and the kernels plugins register for them.

Each op has a signature, semantics, the dtypes it is defined for, a tolerance per dtype, and a
native implementation (`fd_core.native_ops`, Paddle) that is both the default and the reference a
plugin's kernel is checked against. The Backend resolves every op once, when it is built (an
extension's kernel over the active platform's over the native one), so a layer's call is a direct
call of the chosen function.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Mapping

NATIVE = "native"  # the provider name of the native implementations
FLOATS = ("float32", "bfloat16", "float16")
# The widest block of x's columns a quant_matmul kernel may round to int8 with one scale (contract 1.6).
QUANT_X_BLOCK = 256


@dataclass(frozen=True)
class Op:
    """One named op: its arguments in order, what it computes, and how close a kernel must come to the native op."""

    name: str
    args: tuple[str, ...]
    semantics: str
    dtypes: tuple[str, ...] = FLOATS
    # Whether the op runs inside the decode step a graph captures (sampling runs on the host, after it).
    traced: bool = True
    # dtype -> (rtol, atol) a kernel's result must be within, elementwise, of the native op's.
    tolerances: Mapping[str, tuple[float, float]] = field(
        default_factory=lambda: {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}
    )
    # The arguments a kernel's preparation function may transform once, when a weight loads (contract 1.1): it takes
    # every argument after the first (or `prepare_args`) and returns new values for these (one value, or a tuple when
    # several).
    prepared: tuple[str, ...] = ()
    # What a preparation function takes when not every argument after the first is known at load (contract 1.4:
    # moe_experts' routing is per call); empty: every argument after the first.
    prepare_args: tuple[str, ...] = ()


OPS: dict[str, Op] = {op.name: op for op in (
    Op("rms_norm", ("x", "weight", "eps"),
       "x [..., H], weight [H]: (x / sqrt(mean(x^2 over H) + eps)) computed in float32, cast back to x's dtype, then "
       "times weight; the result has x's dtype and shape"),
    Op("silu_and_mul", ("gate", "up"),
       "SwiGLU's inner product: silu(gate) * up, elementwise, gate and up of one shape and dtype"),
    Op("rotary_embedding", ("x", "cos", "sin", "layout"),
       "x [B, heads, S, d] rotated in float32 by the tables cos, sin [S, d/2] or [B, 1, S, d/2] (each row's own; "
       "float32; multimodal positions are already folded into them); layout 'half' pairs dimension i with i + d/2, "
       "'interleaved' pairs 2i with 2i + 1; the result has x's dtype and shape"),
    Op("attention", ("q", "k", "v", "mask"),
       "softmax(q k^T / sqrt(d) + mask) v for q [B, h, S, d], k and v [B, kv_h, T, d] with h a multiple of kv_h "
       "(grouped-query: query head j reads kv head j // (h / kv_h)), mask float32 added to the scores, [S, T] or "
       "[B, 1, 1, S, T] (each row's own: what the decoder passes), 0 where a position is attended and -inf or a large "
       "negative number where not (None: no mask); scores and softmax in float32; the result [B, h, S, d] in v's "
       "dtype. Prefill passes the causal mask over the new positions; a decode step passes the positions of the KV "
       "cache in use"),
    Op("sample", ("logits", "temperature", "top_k", "top_p", "uniform"),
       "one token id per row of logits [B, V]: the argmax when temperature is 0 (ties: the lowest id); else the "
       "inverse-CDF draw at uniform[b] (in [0, 1)), over the tokens in id order, from softmax(logits / temperature) "
       "restricted to the top_k highest (0: all; every token tied with the k-th highest is kept) and then to the "
       "smallest prefix of the probabilities sorted high to low (ties in id order) whose mass reaches top_p; the "
       "engine draws `uniform` from each sequence's seeded generator, so every rank chooses the same token. Returns "
       "a list of B ints",
       dtypes=("float32",), traced=False, tolerances={"float32": (0.0, 0.0)}),
    Op("accept_draft", ("logits", "proposals", "temperature", "top_k", "top_p", "uniform", "draft_probs"),
       "speculative decoding's acceptance (contract 1.7): logits [B, S, V] float32, row b's position i scoring the "
       "token after its i-th input (position 0 follows the sequence's last token, position i + 1 its proposal i); "
       "proposals: B lists of token ids, row b's k_b <= S - 1 proposals; uniform: B lists of k_b + 1 numbers in "
       "[0, 1) from the sequence's seeded generator; draft_probs [B, S - 1, V] float32, the distribution proposal i "
       "was drawn from, or None (the proposer is certain: all its mass on the proposal). Let p_i be the distribution "
       "`sample` draws from at position i (softmax(logits / temperature), top_k, then top_p; temperature 0: all mass "
       "on the argmax, the lowest id on ties) and q_i the draft's. For i = 0, 1, ..., proposal d is accepted when "
       "uniform[b][i] < p_i(d) / q_i(d) (0 when q_i(d) is 0); the first rejected one is replaced by the inverse-CDF "
       "draw (as `sample`'s: the first token, in id order, whose cumulative mass exceeds u times the total) from "
       "max(p_i - q_i, 0) at u = (uniform[b][i] - r) / (1 - r), r the ratio (from p_i itself when that is all "
       "zero), and the row ends there; when all k_b are accepted, the row ends with `sample`'s draw from p_k at "
       "uniform[b][k_b]. Returns B lists: the accepted proposals, then that one token. The draws keep p exactly "
       "(Leviathan et al. 2023, Chen et al. 2023); greedy rows accept the proposals equal to the argmax",
       dtypes=("float32",), traced=False, tolerances={"float32": (0.0, 0.0)}),
    Op("apply_penalties", ("logits", "prompt_mask", "output_counts", "presence", "frequency", "repetition"),
       "the penalties of the sequences that ask for them, before the sample op (contract 1.3): logits [B, V] float32, "
       "prompt_mask [B, V] bool (the token is in row b's prompt), output_counts [B, V] int32 (how often row b's output "
       "holds it), presence, frequency and repetition [B] float32; in float32, for every token the prompt or the "
       "output holds, a logit > 0 is divided by repetition[b] and one <= 0 multiplied by it; then frequency[b] * "
       "output_counts and presence[b] * (output_counts > 0) are subtracted (the prompt does not count for them). "
       "Returns the new logits [B, V] float32",
       dtypes=("float32",), traced=False, tolerances={"float32": (1e-6, 1e-6)}),
    # The paged KV cache. Its layout is the platform's: allocate_kv_cache makes one layer's key and value caches,
    # and only write_kv_cache, read_kv_cache and the paged attention ops read or write them (fd never indexes them
    # itself), so a platform that changes the layout registers them all. Positions: position p of a sequence lives in
    # block block_tables[b, p // block_size] at offset p % block_size; a slot is block * block_size + offset.
    Op("allocate_kv_cache", ("num_blocks", "block_size", "kv_heads", "head_dim", "dtype"),
       "one layer's key and value caches, a pair of zeroed tensors of `dtype` holding num_blocks blocks of block_size "
       "positions of kv_heads x head_dim values each, in the platform's layout (native: [kv_heads, num_blocks, "
       "block_size, head_dim] each); the runtime allocates them once per run and passes them back to the cache ops "
       "below, never reading them itself",
       traced=False, tolerances={"float32": (0.0, 0.0), "float16": (0.0, 0.0), "bfloat16": (0.0, 0.0)}),
    Op("write_kv_cache", ("key", "value", "k_cache", "v_cache", "slot_mapping"),
       "store key[t] and value[t] ([T, kv_heads, head_dim], the cache's dtype) at slot slot_mapping[t] ([T] int64, "
       "slot = block * block_size + offset) of k_cache and v_cache, in place; returns None. A slot may repeat only "
       "for padding, whose values are never read (the runtime points padding at its null block)"),
    Op("read_kv_cache", ("k_cache", "v_cache", "slot_mapping"),
       "the inverse of write_kv_cache (contract 1.9): the keys and values at slots slot_mapping ([T] int64) of k_cache "
       "and v_cache, a pair of [T, kv_heads, head_dim] tensors in the cache's dtype, exactly as written; the cache is "
       "left unchanged. A prompt handed from a prefill instance to a decode instance (disaggregation) is read with it "
       "there and written with write_kv_cache here, so the two instances' layouts and block sizes may differ",
       traced=False, tolerances={"float32": (0.0, 0.0), "float16": (0.0, 0.0), "bfloat16": (0.0, 0.0)}),
    Op("paged_attention", ("q", "k_cache", "v_cache", "block_tables", "context_lens"),
       "one decode query per sequence: q [B, h, d], row b attending positions [0, context_lens[b]) of its blocks "
       "(block_tables [B, W] int64, context_lens [B] int64; its new key and value already written): softmax(q k^T / "
       "sqrt(d)) v with grouped-query heads (query head j reads kv head j // (h / kv_h)), scores and softmax in "
       "float32; the result [B, h, d] in q's dtype. Table entries past a row's blocks name a block whose values are "
       "finite (the runtime's null block)"),
    Op("paged_prefill_attention", ("q", "k_cache", "v_cache", "block_tables", "prefix_lens"),
       "new tokens attending causally to themselves and to their sequence's cached prefix: q [B, S, h, d], row b's "
       "query i at position prefix_lens[b] + i attending positions [0, prefix_lens[b] + i] of its blocks "
       "(block_tables [B, W] int64, prefix_lens [B] int64; the new keys and values already written): "
       "softmax(q k^T / sqrt(d)) v as paged_attention; the result [B, S, h, d] in q's dtype. Queries past a row's "
       "new tokens (padding) may give any finite value"),
    Op("paged_packed_attention", ("q", "k_cache", "v_cache", "block_tables", "query_starts", "context_lens"),
       "one step's new tokens of every row packed end to end (contract 1.8): q [T, h, d], row b's queries "
       "q[query_starts[b] : query_starts[b + 1]] (query_starts [B + 1] int64, 0 to T), its n_b new tokens at positions "
       "context_lens[b] - n_b to context_lens[b] - 1, each attending positions [0, its own] of its blocks "
       "(block_tables [B, W] int64, context_lens [B] int64; the new keys and values already written): softmax(q k^T / "
       "sqrt(d)) v as paged_attention; the result [T, h, d] in q's dtype. A row of one token is a decode step's row; "
       "rows of any lengths come in one call (a mixed prefill and decode step). Where the cache's layout is a plugin's "
       "without a kernel for it, each row goes through the paged_prefill_attention in use",
       traced=False),
    Op("matmul", ("x", "weight", "transpose_weight"),
       "x [..., K] times weight [K, N], or times the transpose of weight [N, K] when transpose_weight is True: "
       "[..., N] in x's dtype, summed in float32 or wider (a kernel that splits the sum adds its parts in float32); "
       "the product of every linear layer and of the LM head: x is [B, S, K] (B cache rows; S = 1 in a decode step), "
       "[B, K] (the LM head) or [rows, K] (experts, picture patches); one row in all (one sequence decoding) is the "
       "case a split across compute threads serves",
       # Looser than the elementwise ops' in float32: a kernel that orders the K-term sum differently rounds
       # differently.
       tolerances={"float32": (1e-4, 1e-4), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)},
       prepared=("weight",)),
    Op("quant_matmul", ("x", "weight", "scales", "bits"),
       "x [..., K] times the transpose of the weight-only quantized matrix [N, K] (fd_core.quantization): row n of "
       "the matrix is the int8 values of weight's row n (bits 8: weight [N, K], values in [-127, 127]; bits 4: "
       "weight [N, ceil(K / 2)], two values in [-7, 7] a byte, column 2j in the low four bits of byte j and 2j + 1 in "
       "the high four, two's complement) times their scale: scales float32 [N] (one a row), or [N, G'] (contract "
       "1.6: G' groups of K / G' consecutive columns, group g of row n scaled by scales[n, g]); [..., N] in x's "
       "dtype, summed in float32 or wider; the linear layers' product under --quantization wint8 or wint4. A kernel "
       "may round x to int8 first (as llama.cpp's q8_0 products do), symmetrically per block of b consecutive "
       "columns starting at a multiple of b (b a power of two of at most QUANT_X_BLOCK that divides the group size "
       "when the scales are grouped), at scale max|x_block| / 127: its result "
       "may then differ from the exact product by up to sum_k |w[n, k]| max|x_block(k)| / 254 (half a step of each "
       "rounded x) beyond the tolerance",
       # Looser than matmul's: a kernel may apply the scales after the sum, or dequantize in the compute dtype.
       tolerances={"float32": (1e-4, 1e-4), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)},
       prepared=("weight", "scales")),
    Op("add_rms_norm", ("x", "residual", "weight", "eps"),
       "a pre-norm decoder layer's residual add and its next norm: x and residual [..., H] of one dtype, weight [H]; "
       "summed = x + residual, in x's dtype (rounded to it, as an unfused add is), and normed = the rms_norm op's "
       "result on summed, weight and eps (summed / sqrt(mean(summed^2 over H) + eps) in float32, cast back to x's "
       "dtype, then times weight); returns the pair (normed, summed), each with x's dtype and shape"),
    Op("gelu", ("x", "approximate"),
       "GELU elementwise, computed in float32 and cast back to x's dtype (the result has x's dtype and shape): "
       "approximate 'none': 0.5 x (1 + erf(x / sqrt(2))); 'tanh': 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 "
       "x^3))); 'sigmoid': x sigmoid(1.702 x) (quick GELU); another value of approximate is an error"),
    Op("moe_experts", ("x", "gate", "up", "down", "chosen", "weights"),
       "a mixture of experts' routed experts, each a SwiGLU MLP: x [T, H]; the experts' stacked weights gate and up "
       "[E, I, H], down [E, H, I] (expert e's checkpoint gate_proj, up_proj and down_proj, [out, in]; under tensor "
       "parallelism this rank's slice of I); chosen [T, k] int64, row t's k distinct experts in [0, E); weights "
       "[T, k] in x's dtype. Returns [T, H] in x's dtype: out[t] = sum over j of weights[t, j] * (down[e] @ "
       "(silu(gate[e] @ x[t]) * (up[e] @ x[t]))) with e = chosen[t, j], each product summed in float32 or wider and "
       "rounded to x's dtype, silu(.) * up in x's dtype as silu_and_mul, the k weighted terms added in x's dtype or "
       "wider; a term whose weight is exactly 0 "
       "contributes nothing and may be skipped (its expert not run for that token: a modality's experts get the "
       "other modality's tokens at weight 0). This rank's partial sum: the caller all-reduces it. A decode step's "
       "T is its batch size (captured); a prefill's, its tokens (eager)",
       # Looser than the elementwise ops' in float32, as matmul's: a kernel orders the H- and I-term sums and the
       # k-term sum its own way. The stacked weights may be prepared at load (1.4): prepare(gate, up, down), the
       # routing being per call.
       tolerances={"float32": (1e-4, 1e-4), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)},
       prepared=("gate", "up", "down"), prepare_args=("gate", "up", "down")),
)}


_threads = threading.local()


def compute_threads() -> int:
    """The threads the calling thread's rank may compute on in the current phase (1 outside a run): a kernel that
    splits its own work across threads (a one-row product split by rows of its weight) reads it."""
    return int(getattr(_threads, "count", 1))


def set_compute_threads(count: int) -> None:
    """Set compute_threads() for the calling thread (the runtime does, before each prefill and decode step)."""
    if count < 1:
        raise ValueError(f"compute threads must be >= 1, got {count}")
    _threads.count = count


