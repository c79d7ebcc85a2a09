"""Exact FLOPs and attention bytes of one BDLM training step, from Megatron's hyper-parameters.

Megatron's logger assumes causal attention over every row. A BDLM sees `2L` rows `[x_t ; x_0]`
under the block mask of docs/algorithm.md §3, and its LM head runs over the `L` noisy rows only;
counting Megatron's way overstates the work, so the training logger counts here.

Counting rules (a multiply-add is 2 FLOPs; backward is twice the forward: `rules.BACKWARD_FLOPS_PER_FORWARD`):
* every linear layer runs over all `2L` rows: QKV (GQA), output projection, MLP (SwiGLU: 3 matrices);
* attention costs `4 · heads · head_dim` per allowed (query, key) pair: `Q·Kᵀ` and `P·V`;
* the LM head runs over the `L` noisy rows;
* full recomputation adds one more forward of the transformer layers (not of the head).
Norms, softmax, RoPE and the embedding lookup are not counted (the usual convention).

Plain Python integers throughout, so every count is exact. No torch, no Megatron.
"""

import dataclasses

from megatron_csbp.core import modes, rules, transports


def _check_blocks(seq_length: int, block_size: int) -> int:
    rules.refuse(rules.whole_blocks_problem(seq_length, block_size))
    return seq_length // block_size


def bdlm_attention_pair_parts(seq_length: int, block_size: int) -> dict:
    """Allowed (query, key) pairs per head per layer, split by the three parts of the BDLM mask.

    With `NB = L / B` blocks of `B` tokens:
    * noisy → noisy: each noisy block sees itself: `NB · B² = L · B`;
    * noisy → clean: noisy block `b` sees clean blocks `< b`: `Σ_b b · B² = B² · NB(NB-1)/2`;
    * clean → clean: clean block `b` sees clean blocks `<= b`: `Σ_b (b+1) · B² = B² · NB(NB+1)/2`.
    The last two add up to `B² · NB² = L²`; clean queries never see noisy keys.
    """
    num_blocks = _check_blocks(seq_length, block_size)
    block_pairs = block_size * block_size
    return {
        "noisy_noisy": num_blocks * block_pairs,
        "noisy_clean": block_pairs * num_blocks * (num_blocks - 1) // 2,
        "clean_clean": block_pairs * num_blocks * (num_blocks + 1) // 2,
    }


def bdlm_attention_pairs(seq_length: int, block_size: int) -> int:
    """All allowed pairs per head per layer: `L·B + L²` (about a quarter of the `2L × 2L` grid)."""
    return sum(bdlm_attention_pair_parts(seq_length, block_size).values())


def attention_flops_per_pair(num_attention_heads: int, kv_channels: int) -> int:
    """Forward FLOPs of one (query, key) pair over all heads: `Q·Kᵀ` and `P·V`, 2 FLOPs per MAC."""
    return 4 * num_attention_heads * kv_channels


def linear_flops_per_row(hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                         num_query_groups: int, kv_channels: int, swiglu: bool) -> int:
    """Forward FLOPs of one transformer layer's linear layers for one row (token)."""
    query_size = num_attention_heads * kv_channels
    kv_size = num_query_groups * kv_channels
    qkv = hidden_size * (query_size + 2 * kv_size)
    projection = query_size * hidden_size
    mlp = hidden_size * ffn_hidden_size * (3 if swiglu else 2)
    return 2 * (qkv + projection + mlp)


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The mixture of experts of a model (Megatron's flags): `num_moe_layers` of the layers route each row to
    `topk` of `num_experts` experts of FFN size `ffn_hidden_size`, plus a shared expert of
    `shared_expert_ffn_hidden_size` (0: none)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    num_moe_layers: int
    shared_expert_ffn_hidden_size: int = 0

    @staticmethod
    def from_args(args) -> "MoEShape | None":
        """The MoE of validated arguments (None for a dense model)."""
        if not getattr(args, "num_experts", None):
            return None
        moe_layers = sum(rules.moe_layer_pattern(args.moe_layer_freq, args.num_layers))
        return MoEShape(args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size or args.ffn_hidden_size,
                        moe_layers, args.moe_shared_expert_intermediate_size or 0)


def mlp_flops_per_row(hidden_size: int, ffn_hidden_size: int, swiglu: bool) -> int:
    """Forward FLOPs of one MLP (fc1, fc2; SwiGLU's fc1 is twice as wide) for one row."""
    return 2 * hidden_size * ffn_hidden_size * (3 if swiglu else 2)


def moe_mlp_flops_per_row(hidden_size: int, moe: MoEShape, swiglu: bool) -> int:
    """Forward FLOPs of one MoE layer's MLP part for one row: the router's logits (`h x E`), the `topk` experts the
    row is routed to, and the shared expert. (Model FLOPs: the permutation and the weighting are not counted.)"""
    shared = mlp_flops_per_row(hidden_size, moe.shared_expert_ffn_hidden_size, swiglu)
    return (2 * hidden_size * moe.num_experts + moe.topk * mlp_flops_per_row(hidden_size, moe.ffn_hidden_size, swiglu)
            + shared)


def moe_layer_linear_flops_per_row(hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                                   num_query_groups: int, kv_channels: int, swiglu: bool, moe: MoEShape) -> int:
    """Forward FLOPs of one MoE layer's linear layers for one row: a dense layer's (`linear_flops_per_row`) with its
    MLP replaced by the router, the `topk` experts and the shared expert (`moe_mlp_flops_per_row`)."""
    return (linear_flops_per_row(hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, kv_channels,
                                 swiglu)
            - mlp_flops_per_row(hidden_size, ffn_hidden_size, swiglu) + moe_mlp_flops_per_row(hidden_size, moe, swiglu))


def moe_all_to_all_bytes(routed_rows: int, moe: MoEShape, expert_parallel: int, hidden_size: int,
                         bytes_per_elem: int, probs_bytes: int, forward_runs: int = 1) -> float:
    """Bytes one rank sends through megatron-core's alltoall token dispatcher in one MoE layer, forward and backward,
    when its `routed_rows` rows (every row it holds, noisy and clean, `/ TP` under sequence parallelism) are routed
    uniformly: of its `routed_rows x topk` (row, expert) pairs, `(EP-1)/EP` go to experts on other ranks, and as
    many come in from the other ranks to its own experts.

    Per pair leaving the rank: the dispatch sends the row (`hidden x bytes`) and its routing probability
    (`probs_bytes`), the combine sends the expert's output row back; the backward runs both exchanges in reverse
    (the probability's gradient too). A rank sends for its own pairs (dispatch forward, combine backward) and for
    the pairs it received (combine forward, dispatch backward), so per layer
    `pairs_out x (2h·e + p) + pairs_in x (2h·e + p)` with `pairs_out = pairs_in = rows x topk x (EP-1)/EP`;
    `forward_runs = 2` (full recompute) sends the forward's part twice."""
    pairs = routed_rows * moe.topk * (expert_parallel - 1) / expert_parallel
    forward = pairs * (hidden_size * bytes_per_elem + probs_bytes) + pairs * hidden_size * bytes_per_elem
    backward = forward
    return forward_runs * forward + backward


def lm_head_flops_per_row(hidden_size: int, padded_vocab_size: int) -> int:
    return 2 * hidden_size * padded_vocab_size


def _shape(hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, kv_channels, swiglu):
    if ffn_hidden_size is None:
        ffn_hidden_size = rules.default_ffn_hidden_size(hidden_size, swiglu)
    num_query_groups = num_attention_heads if num_query_groups is None else num_query_groups
    if kv_channels is None:
        rules.refuse(rules.kv_channels_problem(hidden_size, num_attention_heads))
        kv_channels = hidden_size // num_attention_heads
    rules.refuse(rules.query_groups_problem(num_attention_heads, num_query_groups))
    return ffn_hidden_size, num_query_groups, kv_channels


def bdlm_step_flops(*, num_layers: int, hidden_size: int, num_attention_heads: int,
                    padded_vocab_size: int, seq_length: int, block_size: int, batch_size: int = 1,
                    ffn_hidden_size: int = None, num_query_groups: int = None, kv_channels: int = None,
                    swiglu: bool = False, recompute: bool = False, moe: MoEShape | None = None) -> int:
    """Exact FLOPs of one BDLM training step (forward + backward) over `batch_size` samples.

    All arguments are plain numbers with Megatron's meanings: `seq_length` is the clean length `L`
    (the model sees `2L` rows), `block_size` the diffusion block `B`, `batch_size` the samples in the
    step (e.g. the global batch size), `padded_vocab_size` Megatron's padded vocabulary. Defaults as
    Megatron-LM: `ffn_hidden_size = 4h` (`8h/3` with SwiGLU), `num_query_groups = heads`,
    `kv_channels = h / heads`.
    `recompute=False` gives model FLOPs (what MFU and the logger's TFLOP/s count); `recompute=True`
    adds the transformer layers' second forward of full activation recomputation (hardware FLOPs).
    `moe`: the model's experts (`MoEShape`); its MoE layers' MLP FLOPs per row are `moe_mlp_flops_per_row`'s, and
    every row, noisy and clean, is routed (`2L` per sample).
    """
    ffn_hidden_size, num_query_groups, kv_channels = _shape(
        hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, kv_channels, swiglu)
    shape = (hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, kv_channels, swiglu)
    layer_forward = (2 * seq_length * linear_flops_per_row(*shape)
                     + bdlm_attention_pairs(seq_length, block_size)
                     * attention_flops_per_pair(num_attention_heads, kv_channels))
    layers_forward = num_layers * layer_forward
    if moe is not None:  # the MoE layers' MLP replaced by the router, the top-k experts and the shared expert
        layers_forward += moe.num_moe_layers * 2 * seq_length * (
            moe_layer_linear_flops_per_row(*shape, moe) - linear_flops_per_row(*shape))
    head_forward = seq_length * lm_head_flops_per_row(hidden_size, padded_vocab_size)
    return batch_size * (rules.step_passes(recompute) * layers_forward + rules.step_passes() * head_forward)


def megatron_causal_flops(*, num_layers: int, hidden_size: int, num_attention_heads: int,
                          padded_vocab_size: int, seq_length: int, batch_size: int = 1,
                          ffn_hidden_size: int = None, num_query_groups: int = None,
                          kv_channels: int = None, swiglu: bool = False) -> int:
    """What Megatron-LM's formula logs for the same step: causal attention over all `2L` rows.

    Megatron counts half of the `rows × rows` grid for causal attention (`rows² / 2` pairs per head)
    and runs the LM head over every row; with `rows = 2L` this is what its TFLOP/s would assume.
    For comparison only: the BDLM mask allows `L² + L·B` pairs, about half of `(2L)² / 2`.
    """
    ffn_hidden_size, num_query_groups, kv_channels = _shape(
        hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, kv_channels, swiglu)
    rows = 2 * seq_length
    layer_forward = (rows * linear_flops_per_row(hidden_size, ffn_hidden_size, num_attention_heads,
                                                 num_query_groups, kv_channels, swiglu)
                     + rows * rows // 2 * attention_flops_per_pair(num_attention_heads, kv_channels))
    head_forward = rows * lm_head_flops_per_row(hidden_size, padded_vocab_size)
    return batch_size * rules.step_passes() * (num_layers * layer_forward + head_forward)


def kv_bytes_per_token(kv_heads_per_tp: int, head_dim: int, bytes_per_elem: int = 2) -> int:
    """`beta` of docs/algorithm.md §1: bytes of K plus V of one token in one layer on one rank."""
    return 2 * kv_heads_per_tp * head_dim * bytes_per_elem


def attention_traffic_bytes(mode: str, seq_length: int, clean_shards: int, kv_heads_per_tp: int,
                            head_dim: int, bytes_per_elem: int = 2, transport: str = "collective",
                            recompute: bool = False) -> int:
    """Bytes one rank sends for one attention layer, forward + backward (docs/algorithm.md §9).

    The forward moves the gathered tokens' K/V once around the ring: each rank sends the
    `(C-1)/C` of them it did not own (`2L` tokens for CP, the `L` clean tokens for CSBP, none for
    pure BP). The collective backward reduce-scatters the same amount of dK/dV; the streaming
    backward circulates K/V and dK/dV, twice the amount. With full recomputation the forward runs
    again before the backward, so its bytes count twice:
      CP collective `4L(C-1)/C·beta` (`6L(C-1)/C·beta` recomputed), CSBP collective `2L(C-1)/C·beta`
      (`3L(C-1)/C·beta`), streaming `6L`/`3L` (`8L`/`4L`), BP 0.
    """
    forward = attention_forward_bytes(mode, seq_length, clean_shards, kv_heads_per_tp, head_dim, bytes_per_elem)
    rules.refuse(rules.choice_problem("--csbp-transport", transport, rules.TRANSPORTS))
    backward = forward * transports.transport(transport).backward_bytes_per_forward
    return forward * (2 if recompute else 1) + backward


def attention_forward_bytes(mode: str, seq_length: int, clean_shards: int, kv_heads_per_tp: int,
                            head_dim: int, bytes_per_elem: int = 2) -> int:
    """Bytes one rank sends in one layer's forward: the `(C-1)/C` share of the gathered K/V it owns."""
    rules.refuse(rules.choice_problem("--bdlm-parallel-mode", mode, rules.PARALLEL_MODES))
    if clean_shards < 1 or seq_length % clean_shards:
        raise ValueError(f"clean_shards ({clean_shards}) must be a positive divisor of seq_length ({seq_length})")
    gathered_tokens = modes.parallel_mode(mode).gathered_tokens(seq_length, clean_shards)
    return gathered_tokens // clean_shards * (clean_shards - 1) * kv_bytes_per_token(
        kv_heads_per_tp, head_dim, bytes_per_elem)


def parameter_count(*, num_layers: int, hidden_size: int, num_attention_heads: int, padded_vocab_size: int,
                    ffn_hidden_size: int = None, num_query_groups: int = None, kv_channels: int = None,
                    swiglu: bool = False, add_bias_linear: bool = True, layernorm_bias: bool = True,
                    untied_output: bool = False, moe: MoEShape | None = None) -> int:
    """Parameters of the GPT-style BDLM (what a checkpoint stores per weight copy or optimizer moment); with `moe`,
    its MoE layers hold the router, every expert and the shared expert instead of the dense MLP."""
    layer = layer_parameter_count(hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                                  ffn_hidden_size=ffn_hidden_size, num_query_groups=num_query_groups,
                                  kv_channels=kv_channels, swiglu=swiglu, add_bias_linear=add_bias_linear,
                                  layernorm_bias=layernorm_bias)
    final_norm = hidden_size * (2 if layernorm_bias else 1)
    total = num_layers * layer + final_norm + padded_vocab_size * hidden_size * (2 if untied_output else 1)
    if moe is not None:
        ffn = _shape(hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, kv_channels, swiglu)[0]
        parts = moe_mlp_parameters(hidden_size, moe, swiglu, add_bias_linear)
        total += moe.num_moe_layers * (sum(parts.values()) - mlp_parameters(hidden_size, ffn, swiglu, add_bias_linear))
    return total


def moe_mlp_parameters(hidden_size: int, moe: MoEShape, swiglu: bool, add_bias_linear: bool) -> dict:
    """Parameters of one MoE layer's MLP part, by what holds them: `router` (`h x E`, on every rank), `experts` (all
    `E` routed experts, split over EP), `shared` (the shared expert, a dense MLP)."""
    mlp = lambda size: mlp_parameters(hidden_size, size, swiglu, add_bias_linear)  # noqa: E731
    return dict(router=hidden_size * moe.num_experts + (moe.num_experts if add_bias_linear else 0),
                experts=moe.num_experts * mlp(moe.ffn_hidden_size),
                shared=mlp(moe.shared_expert_ffn_hidden_size) if moe.shared_expert_ffn_hidden_size else 0)


def mlp_parameters(hidden_size: int, ffn_hidden_size: int, swiglu: bool, add_bias_linear: bool) -> int:
    """Parameters of one MLP (fc1, fc2; SwiGLU's fc1 twice as wide) and their biases when the flags give them."""
    fc1 = ffn_hidden_size * (2 if swiglu else 1)
    return hidden_size * fc1 + ffn_hidden_size * hidden_size + (fc1 + hidden_size if add_bias_linear else 0)


def layer_parameter_count(*, hidden_size: int, num_attention_heads: int, ffn_hidden_size: int = None,
                          num_query_groups: int = None, kv_channels: int = None, swiglu: bool = False,
                          add_bias_linear: bool = True, layernorm_bias: bool = True) -> int:
    """Parameters of one transformer layer: QKV, projection, MLP, two norms, and the biases the flags give."""
    ffn, groups, kv = _shape(hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, kv_channels,
                             swiglu)
    h, qkv, fc1 = hidden_size, (num_attention_heads + 2 * groups) * kv, ffn * (2 if swiglu else 1)
    norm = 2 * h if layernorm_bias else h
    layer = h * qkv + num_attention_heads * kv * h + h * fc1 + ffn * h + 2 * norm
    return layer + (qkv + h + fc1 + h if add_bias_linear else 0)
