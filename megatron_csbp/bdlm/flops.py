"""Exact FLOPs and attention bytes of one BDLM training step, from Megatron's hyper-parameters.

Megatron's logger assumes causal attention over every row. A BDLM sees `2L` rows `[x_t ; x_0]`
under the block mask of docs/algorithm.md §3, and its LM head runs over the `L` noisy rows only;
counting Megatron's way overstates the work, so the training logger counts here.

Counting rules (a multiply-add is 2 FLOPs; backward is twice the forward: `rules.BACKWARD_FLOPS_PER_FORWARD`):
* every linear layer runs over all `2L` rows: QKV (GQA), output projection, MLP (SwiGLU: 3 matrices);
* attention costs `4 · heads · head_dim` per allowed (query, key) pair: `Q·Kᵀ` and `P·V`;
* a Gemma 4 global layer (`shape.gemma4_attention`, a layer the window pattern leaves global) has its own head size
  and K/V heads, and its key projection doubles as the value (no value rows): `layer_attention_shape`;
* the LM head runs over the `L` noisy rows (all `2L` rows with an autoregressive co-loss on the clean rows);
* full recomputation adds one more forward of the transformer layers (not of the head);
* a Gated DeltaNet layer: its projections, convolution and MLP per row (`gated_delta_linear_flops_per_row`), the
  chunked delta rule as `core.gated_delta` runs it (`gated_delta_core_flops`), no attention pairs; it sends no
  K/V but clean states, chunk maps and convolution histories (`gated_delta_bytes`).
Norms, softmax, RoPE and the embedding lookup are not counted (the usual convention).

Plain Python integers throughout, so every count is exact. No torch, no Megatron.
"""

from megatron_csbp.core import modes, rules, transports
from megatron_csbp.core.clean_attention import BLOCK_CAUSAL
from megatron_csbp.core.windows import GLOBAL
from megatron_csbp.core.model_shape import ModelShape, MoEShape  # noqa: F401  (the shapes these counts take)


def _check_blocks(seq_length: int, block_size: int) -> int:
    rules.refuse(rules.whole_blocks_problem(seq_length, block_size))
    return seq_length // block_size


def bdlm_attention_pair_parts(seq_length: int, block_size: int, clean_attention=BLOCK_CAUSAL, window=GLOBAL) -> dict:
    """Allowed (query, key) pairs per head per layer, split by the three parts of the BDLM mask.

    With `NB = L / B` blocks of `B` tokens:
    * noisy → noisy: each noisy block sees itself: `NB · B² = L · B`;
    * noisy → clean: noisy block `b` sees clean blocks `< b`: `Σ_b b · B² = B² · NB(NB-1)/2`;
    * clean → clean: the clean-attention rule's (`clean_attention.clean_pairs`); BD3-LM's clean block `b`
      sees clean blocks `<= b`: `Σ_b (b+1) · B² = B² · NB(NB+1)/2`, with the noisy → clean pairs `L²`.
    Clean queries never see noisy keys. In a sliding layer (`window`, `core.windows`) each row's clean keys start at
    its window's start: counted run by run (`modes.key_ranges`).
    """
    num_blocks = _check_blocks(seq_length, block_size)
    block_pairs = block_size * block_size
    if window.sliding:
        every = [(0, seq_length)]
        return {"noisy_noisy": num_blocks * block_pairs,
                **{part: sum(rows * (limit - start) for start, limit, rows in modes.key_ranges(
                    *spans, block_size, clean_attention, window) if limit > start)
                   for part, spans in (("noisy_clean", (every, [])), ("clean_clean", ([], every)))}}
    return {
        "noisy_noisy": num_blocks * block_pairs,
        "noisy_clean": block_pairs * num_blocks * (num_blocks - 1) // 2,
        "clean_clean": clean_attention.clean_pairs(seq_length, block_size),
    }


def bdlm_attention_pairs(seq_length: int, block_size: int, clean_attention=BLOCK_CAUSAL, window=GLOBAL) -> int:
    """All allowed pairs per head per layer: `L·B + L²` under BD3-LM's rule (a quarter of the `2L × 2L` grid) in a
    global layer."""
    return sum(bdlm_attention_pair_parts(seq_length, block_size, clean_attention, window).values())


def attention_flops_per_pair(num_attention_heads: int, kv_channels: int) -> int:
    """Forward FLOPs of one (query, key) pair over all heads: `Q·Kᵀ` and `P·V`, 2 FLOPs per MAC."""
    return 4 * num_attention_heads * kv_channels


def layer_attention_shape(shape: ModelShape, window=GLOBAL) -> tuple[int, int, int]:
    """(head size, K/V heads, projected K/V tensors) of one attention layer of `window` (`core.windows`): a Gemma 4
    global layer's own (`shape.gemma4_attention`: its head size and K/V heads, the key projection doubling as the value,
    so one projected tensor), else the model's (key and value: two)."""
    gemma4 = shape.gemma4_attention
    if gemma4 is not None and not window.sliding:
        return gemma4.global_kv_channels, gemma4.global_query_groups, 1
    return shape.kv_channels, shape.num_query_groups, 2


def linear_flops_per_row(shape: ModelShape, window=GLOBAL) -> int:
    """Forward FLOPs of one dense transformer layer's linear layers for one row (token), in a layer of `window`
    (its attention's shape: `layer_attention_shape`)."""
    head, groups, projected = layer_attention_shape(shape, window)
    query_size = shape.num_attention_heads * head
    kv_size = groups * head
    gate = query_size if shape.attention_output_gate else 0  # the output gate's rows of the QKV projection
    qkv = shape.hidden_size * (query_size + gate + projected * kv_size)
    projection = query_size * shape.hidden_size
    return 2 * (qkv + projection) + mlp_flops_per_row(shape.hidden_size, shape.ffn_hidden_size, shape.swiglu)


def gated_delta_linear_flops_per_row(shape: ModelShape) -> int:
    """Forward FLOPs of one Gated DeltaNet layer's linear parts for one row (token), megatron-core's layer: the
    in-projection to q, k (`Hk x dk` each), v and the output gate z (`Hv x dv` each), β and the decay's α (one
    per value head); the depthwise causal convolution over q, k, v (`W` multiply-adds per channel); the
    out-projection; the MLP. (The recurrence is `gated_delta_rule_flops`.)"""
    linear, h = shape.linear, shape.hidden_size
    qk, v = linear.num_key_heads * linear.key_head_dim, linear.num_value_heads * linear.value_head_dim
    in_projection = h * (2 * qk + 2 * v + 2 * linear.num_value_heads)
    convolution = (2 * qk + v) * linear.conv_kernel_dim
    return 2 * (in_projection + convolution + v * h) + mlp_flops_per_row(h, shape.ffn_hidden_size, shape.swiglu)


def gated_delta_rule_flops(rows: int, heads: int, key_dim: int, value_dim: int, chunk: int) -> int:
    """Forward FLOPs of the chunked gated delta rule (`core.kernels.gated_delta`, fla's chunked form) over `rows`
    rows, in runs of whole chunks of `chunk` rows, for `heads` value heads with keys of `key_dim` and values of
    `value_dim`. Per chunk and head, in multiply-adds: `β K Kᵀ` (`c² dk`), the unit lower-triangular inverse
    (`c³ / 6`), `W = T βK` (`c² dk`) and `U = T βV` (`c² dv`), `U - W S`, `Q S` and the state update `Kᵀ U`
    (`c dk dv` each), the intra-chunk `Q Kᵀ` (`c² dk`) and its product with the writes (`c² dv`). Gates,
    decays and norms are not counted (the usual convention)."""
    c, dk, dv = chunk, key_dim, value_dim
    per_chunk = 3 * c * c * dk + 2 * c * c * dv + c * c * c // 6 + 3 * c * dk * dv
    return 2 * heads * rows // c * per_chunk


def gated_delta_core_flops(noisy_rows: int, clean_rows: int, block_size: int, heads: int, key_dim: int,
                           value_dim: int) -> int:
    """Forward FLOPs of one Gated DeltaNet layer's core on a rank holding `noisy_rows` and `clean_rows` (whole
    blocks) for `heads` value heads, as `core.gated_delta` computes it: every noisy block from its clean state
    (values `dv` wide); every clean block from a zero state with its value widened by the identity (`dv + dk`
    wide: the block's outputs, read-outs and its map `[U | M]`); per clean block, the map composed onto the
    chunk's prefix (`dk² (dk + dv)`) and the entry and end states applied (`2 dk² dv`); per clean row, its
    read-out of the entry state (`dk dv`). The scan over the ring's chunk maps (a few per ring member) is not
    counted."""
    chunk = min(rules.GATED_DELTA_CHUNK, block_size)
    dk, dv = key_dim, value_dim
    blocks = clean_rows // block_size
    composition = blocks * (dk * dk * (dk + dv) + 2 * dk * dk * dv) + clean_rows * dk * dv
    return (gated_delta_rule_flops(noisy_rows, heads, dk, dv, chunk)
            + gated_delta_rule_flops(clean_rows, heads, dk, dv + dk, chunk) + 2 * heads * composition)


def gated_delta_bytes(mode, seq_length: int, block_size: int, parallel_size: int, clean_shards: int, rank: int,
                      heads: int, key_dim: int, value_dim: int, conv_channels: int, conv_width: int,
                      bytes_per_elem: int = 2, state_bytes: int = 4) -> tuple[int, int]:
    """(forward, backward) bytes rank `rank` sends in one Gated DeltaNet layer for one sample (docs/algorithm.md,
    "Gated DeltaNet layers"), with `heads` value heads and `conv_channels` convolution channels on the rank
    (`/ TP`), counted from the ring's rows (`ParallelMode.row_spans`): noisy block `b > 0` needs the clean state
    entering it and the `W - 1` pre-convolution rows before it, and every clean chunk starting past 0 the rows
    before it, from the member holding clean block `b - 1`; every member sends its chunks' maps
    (`dk x (dk + dv)` per head, `state_bytes` each) to the `C - 1` others. The forward sends what others ask of
    this rank; the backward returns the gradients of what this rank received. K and V never travel."""
    L, B, C = seq_length, block_size, clean_shards
    if C == 1:
        return 0, 0
    mode = modes.parallel_mode(mode)
    spans = [mode.row_spans(L, B, parallel_size, C, rank // C * C + j) for j in range(C)]
    holder = {block: j for j, (_, clean) in enumerate(spans) for start, stop in clean
              for block in range(start // B, stop // B)}

    def asked(member: int, with_chunks: bool) -> list:
        """The clean blocks whose tail (`with_chunks`) or final state ring member `member` needs."""
        noisy, clean = spans[member]
        blocks = {b for start, stop in noisy for b in range(start // B, stop // B) if b > 0}
        if with_chunks:
            blocks |= {start // B for start, _ in clean if start > 0}
        return [b - 1 for b in blocks]

    me = rank % C
    counts = {}
    for with_chunks in (True, False):
        sent = sum(holder[b] == me for j in range(C) if j != me for b in asked(j, with_chunks))
        received = sum(holder[b] != me for b in asked(me, with_chunks))
        counts[with_chunks] = sent, received
    tail = (conv_width - 1) * conv_channels * bytes_per_elem
    state = heads * key_dim * value_dim * state_bytes
    maps = (C - 1) * len(spans[me][1]) * heads * key_dim * (key_dim + value_dim) * state_bytes
    return tuple(counts[True][i] * tail + maps + counts[False][i] * state for i in (0, 1))


def mlp_flops_per_row(hidden_size: int, ffn_hidden_size: int, swiglu: bool) -> int:
    """Forward FLOPs of one MLP (fc1, fc2; SwiGLU's fc1 is twice as wide) for one row."""
    return 2 * hidden_size * ffn_hidden_size * (3 if swiglu else 2)


def moe_mlp_flops_per_row(hidden_size: int, moe: MoEShape, swiglu: bool) -> int:
    """Forward FLOPs of one MoE layer's MLP part for one row: the router's logits (`h x E`), the `topk` experts the
    row is routed to, and the shared expert. (Model FLOPs: the permutation and the weighting are not counted.)"""
    shared = mlp_flops_per_row(hidden_size, moe.shared_expert_ffn_hidden_size, swiglu)
    return (2 * hidden_size * moe.num_experts + moe.topk * mlp_flops_per_row(hidden_size, moe.ffn_hidden_size, swiglu)
            + shared)


def moe_layer_linear_flops_per_row(shape: ModelShape) -> int:
    """Forward FLOPs of one MoE layer's linear layers for one row: a dense layer's (`linear_flops_per_row`) with its
    MLP replaced by the router, the `topk` experts and the shared expert (`moe_mlp_flops_per_row`)."""
    h, swiglu = shape.hidden_size, shape.swiglu
    return (linear_flops_per_row(shape) - mlp_flops_per_row(h, shape.ffn_hidden_size, swiglu)
            + moe_mlp_flops_per_row(h, shape.moe, swiglu))


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


def bdlm_step_flops(shape: ModelShape, *, padded_vocab_size: int, seq_length: int, block_size: int,
                    batch_size: int = 1, recompute: bool = False, clean_attention=BLOCK_CAUSAL,
                    clean_logits: bool = False, layer_windows: tuple = (),
                    self_conditioning: float | None = None) -> int:
    """Exact FLOPs of one BDLM training step (forward + backward) over `batch_size` samples of model `shape`.

    `seq_length` is the clean length `L` (the model sees `2L` rows), `block_size` the diffusion block `B`,
    `batch_size` the samples in the step (e.g. the global batch size, times the objective's views),
    `padded_vocab_size` Megatron's padded vocabulary. `recompute=False` gives model FLOPs (what MFU and the
    logger's TFLOP/s count); `recompute=True` adds the transformer layers' second forward of full activation
    recomputation (hardware FLOPs). With `shape.moe`, its MoE layers' MLP FLOPs per row are
    `moe_mlp_flops_per_row`'s, and every row, noisy and clean, is routed (`2L` per sample). `clean_logits`: the
    LM head runs over the clean rows too (an autoregressive co-loss), `2L` rows instead of `L`. `layer_windows`: each
    layer's window (`core.windows`; empty: every layer global), which sets its pairs and, with Gemma 4's attention, its
    head size and projections (`layer_attention_shape`). A Gated DeltaNet layer (`shape.linear_layers`) has no
    pairs: its linear parts over the `2L` rows and the delta rule over the `L` noisy and `L` clean rows, as
    `core.gated_delta` computes it on one rank. `self_conditioning`: the chance a sample is
    self-conditioned (None: no self-conditioning block): the block's MLP on the canvas rows in the trained pass, and
    for that share of the samples a first, forward-only pass (the layers, the block, the head over the canvas rows
    and its signal's product with the embedding): the step's expected FLOPs.
    """
    pairs = {window: bdlm_attention_pairs(seq_length, block_size, clean_attention, window)
             * attention_flops_per_pair(shape.num_attention_heads, layer_attention_shape(shape, window)[0])
             for window in set(layer_windows or (GLOBAL,))}
    linear = shape.linear
    gated_delta_layer = 0 if linear is None else (
        2 * seq_length * gated_delta_linear_flops_per_row(shape)
        + gated_delta_core_flops(seq_length, seq_length, block_size, linear.num_value_heads, linear.key_head_dim,
                                 linear.value_head_dim))
    layers_forward = sum(
        gated_delta_layer if gated_delta else (2 * seq_length * linear_flops_per_row(shape, window) + pairs[window])
        for window, gated_delta in zip(layer_windows or (GLOBAL,) * shape.num_layers, shape.linear_layers))
    if shape.moe is not None:  # the MoE layers' MLP replaced by the router, the top-k experts and the shared expert
        layers_forward += shape.num_moe_layers * 2 * seq_length * (
            moe_layer_linear_flops_per_row(shape) - linear_flops_per_row(shape))
    head_rows = 2 * seq_length if clean_logits else seq_length
    head_forward = head_rows * lm_head_flops_per_row(shape.hidden_size, padded_vocab_size)
    total = batch_size * (rules.step_passes(recompute) * layers_forward + rules.step_passes() * head_forward)
    if self_conditioning is None:
        return total
    block = seq_length * 3 * 2 * shape.hidden_size * shape.ffn_hidden_size  # gate, up, down on the canvas rows
    first_pass = layers_forward + block + 2 * seq_length * lm_head_flops_per_row(shape.hidden_size, padded_vocab_size)
    return total + batch_size * rules.step_passes() * block + round(batch_size * self_conditioning * first_pass)


def run_step_flops(settings, padded_vocab_size: int, recompute: bool = False) -> int:
    """FLOPs of one training step of a run (`core.run_config.RunConfig`): its global batch, each sample's views."""
    return bdlm_step_flops(settings.shape, padded_vocab_size=padded_vocab_size, seq_length=settings.seq_length,
                           block_size=settings.block_size, recompute=recompute,
                           batch_size=settings.global_batch_size * settings.objective.views_per_sample,
                           clean_attention=settings.clean_attention, clean_logits=settings.clean_logits,
                           layer_windows=settings.layer_windows,
                           self_conditioning=settings.self_conditioning_probability if settings.self_conditioning
                           else None)


def megatron_causal_flops(shape: ModelShape, *, padded_vocab_size: int, seq_length: int, batch_size: int = 1) -> int:
    """What Megatron-LM's formula logs for the same step: causal attention over all `2L` rows.

    Megatron counts half of the `rows × rows` grid for causal attention (`rows² / 2` pairs per head)
    and runs the LM head over every row; with `rows = 2L` this is what its TFLOP/s would assume.
    For comparison only: the BDLM mask allows `L² + L·B` pairs, about half of `(2L)² / 2`.
    """
    rows = 2 * seq_length
    layer_forward = (rows * linear_flops_per_row(shape)
                     + rows * rows // 2 * attention_flops_per_pair(shape.num_attention_heads, shape.kv_channels))
    head_forward = rows * lm_head_flops_per_row(shape.hidden_size, padded_vocab_size)
    return batch_size * rules.step_passes() * (shape.num_layers * layer_forward + head_forward)


def kv_bytes_per_token(kv_heads_per_tp: int, head_dim: int, bytes_per_elem: int = 2) -> int:
    """`beta` of docs/algorithm.md §1: bytes of K plus V of one token in one layer on one rank."""
    return 2 * kv_heads_per_tp * head_dim * bytes_per_elem


def attention_traffic_bytes(mode, seq_length: int, clean_shards: int, kv_heads_per_tp: int,
                            head_dim: int, bytes_per_elem: int = 2, transport=transports.COLLECTIVE,
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
    backward = forward * transports.transport(transport).backward_bytes_per_forward
    return forward * (2 if recompute else 1) + backward


def rank_traffic_bytes(mode, seq_length: int, block_size: int, parallel_size: int, clean_shards: int, rank: int,
                       kv_heads_per_tp: int, head_dim: int, bytes_per_elem: int = 2, transport=transports.COLLECTIVE,
                       recompute: bool = False, clean_attention=BLOCK_CAUSAL, window=GLOBAL) -> int:
    """Bytes rank `rank` sends for one attention layer of `window`, forward + backward: the rows it sends its ring
    (`ParallelMode.exchanged_rows`) in the forward (twice with full recomputation), and in the backward the
    gradients of the rows it received (collective), or its rows again and those gradients (streaming). In a global
    layer this is `attention_traffic_bytes`; in a sliding layer under CSBP it depends on the rank."""
    sent, received = modes.parallel_mode(mode).exchanged_rows(seq_length, block_size, parallel_size, clean_shards,
                                                              rank, clean_attention, window)
    beta = kv_bytes_per_token(kv_heads_per_tp, head_dim, bytes_per_elem)
    again = sent if transports.transport(transport).backward_bytes_per_forward > 1 else 0
    return (sent * (2 if recompute else 1) + again + received) * beta


def attention_forward_bytes(mode, seq_length: int, clean_shards: int, kv_heads_per_tp: int,
                            head_dim: int, bytes_per_elem: int = 2) -> int:
    """Bytes one rank sends in one layer's forward: the `(C-1)/C` share of the gathered K/V it owns."""
    if clean_shards < 1 or seq_length % clean_shards:
        raise ValueError(f"clean_shards ({clean_shards}) must be a positive divisor of seq_length ({seq_length})")
    gathered_tokens = modes.parallel_mode(mode).gathered_tokens(seq_length, clean_shards)
    return gathered_tokens // clean_shards * (clean_shards - 1) * kv_bytes_per_token(
        kv_heads_per_tp, head_dim, bytes_per_elem)


def parameter_count(shape: ModelShape, padded_vocab_size: int, layer_windows: tuple = ()) -> int:
    """Parameters of the GPT-style BDLM (what a checkpoint stores per weight copy or optimizer moment); with
    `shape.moe`, its MoE layers hold the router, every expert and the shared expert instead of the dense MLP.
    `layer_windows`: each layer's window (empty: every layer global), which sets a Gemma 4 layer's attention shape."""
    h = shape.hidden_size
    final_norm = h * (2 if shape.layernorm_bias else 1)
    total = (sum(gated_delta_layer_parameter_count(shape) if gated_delta else layer_parameter_count(shape, window)
                 for window, gated_delta in zip(layer_windows or (GLOBAL,) * shape.num_layers, shape.linear_layers))
             + final_norm + padded_vocab_size * h * (2 if shape.untied_output else 1))
    if shape.moe is not None:
        parts = moe_mlp_parameters(h, shape.moe, shape.swiglu, shape.add_bias_linear)
        dense = mlp_parameters(h, shape.ffn_hidden_size, shape.swiglu, shape.add_bias_linear)
        total += shape.num_moe_layers * (sum(parts.values()) - dense)
    return total


def moe_mlp_parameters(hidden_size: int, moe: MoEShape, swiglu: bool, add_bias_linear: bool) -> dict:
    """Parameters of one MoE layer's MLP part, by what holds them: `router` (`h x E`, on every rank), `experts` (all
    `E` routed experts, split over EP), `shared` (the shared expert, a dense MLP). Gemma 4's block (`moe.gemma4`)
    adds to the router its scale (`h`) and per-expert scale (`E`), and the block's norms beyond the layer's pre-MLP
    norm (`4h`: five, the pre-MLP one an identity), on every rank alike."""
    mlp = lambda size: mlp_parameters(hidden_size, size, swiglu, add_bias_linear)  # noqa: E731
    gemma4 = 5 * hidden_size + moe.num_experts if moe.gemma4 else 0
    return dict(router=hidden_size * moe.num_experts + (moe.num_experts if add_bias_linear else 0) + gemma4,
                experts=moe.num_experts * mlp(moe.ffn_hidden_size),
                shared=mlp(moe.shared_expert_ffn_hidden_size) if moe.shared_expert_ffn_hidden_size else 0)


def mlp_parameters(hidden_size: int, ffn_hidden_size: int, swiglu: bool, add_bias_linear: bool) -> int:
    """Parameters of one MLP (fc1, fc2; SwiGLU's fc1 twice as wide) and their biases when the flags give them."""
    fc1 = ffn_hidden_size * (2 if swiglu else 1)
    return hidden_size * fc1 + ffn_hidden_size * hidden_size + (fc1 + hidden_size if add_bias_linear else 0)


def layer_parameter_count(shape: ModelShape, window=GLOBAL) -> int:
    """Parameters of one dense transformer layer of `window`: QKV (a Gemma 4 global layer's own shape,
    `layer_attention_shape`), projection, MLP, two norms, and the biases the flags give."""
    h, heads, ffn = shape.hidden_size, shape.num_attention_heads, shape.ffn_hidden_size
    kv, groups, projected = layer_attention_shape(shape, window)
    gate = heads if shape.attention_output_gate else 0  # the output gate's rows of the QKV projection
    qkv, fc1 = (heads + gate + projected * groups) * kv, ffn * (2 if shape.swiglu else 1)
    norm = 2 * h if shape.layernorm_bias else h
    layer = h * qkv + heads * kv * h + h * fc1 + ffn * h + 2 * norm
    return layer + (qkv + h + fc1 + h if shape.add_bias_linear else 0)


def gated_delta_layer_parameter_count(shape: ModelShape) -> int:
    """Parameters of one Gated DeltaNet layer (megatron-core's `GatedDeltaNet`, no linear or convolution bias): the
    in-projection (q, k, v, z, β, α), the convolution's `W` weights per q/k/v channel, `A_log` and `dt_bias` per
    value head, the output norm's `dv` weights, the out-projection; the MLP and two norms as a dense layer's."""
    linear, h = shape.linear, shape.hidden_size
    qk, v, heads = linear.num_key_heads * linear.key_head_dim, linear.num_value_heads * linear.value_head_dim, \
        linear.num_value_heads
    mixer = (h * (2 * qk + 2 * v + 2 * heads) + (2 * qk + v) * linear.conv_kernel_dim + 2 * heads
             + linear.value_head_dim + v * h)
    norm = 2 * h if shape.layernorm_bias else h
    return mixer + mlp_parameters(h, shape.ffn_hidden_size, shape.swiglu, shape.add_bias_linear) + 2 * norm
