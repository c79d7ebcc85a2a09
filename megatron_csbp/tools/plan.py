"""Topology planner: an analytic model of one BDLM training step for CP, CSBP and pure BP.

`python -m megatron_csbp.plan --num-layers 40 --hidden-size 5120 ... --gpus 16 --gpu h200`
scores every valid (mode, TP, PP, block-parallel P, clean shards C, DP) layout of the cluster and
prints the best few with a reason each, the attention traffic per GPU per step of the requested
layout, and (`--json FILE`) the same as records. `--paper-check` compares with the paper's figures.

The model, in one place so it can be argued with:
* compute: exact per-rank FLOPs (`flops.py` rules; CP and CSBP work is balanced by their zigzag and
  dual-end layouts, BP replicates the clean rows), the linear layers and LM head at
  `peak × achievable_fraction`; attention as the kernels run it: each rank's kernel calls
  (`ParallelMode.kernel_calls`: computed pairs at the GPU's tile size, whole tiles wherever the mask touches
  one) priced at their kernel family's rate for the pass (`GPU.kernel_fractions`, cited at `SM90_KERNELS`),
  the slowest rank setting the step;
* attention traffic: docs/algorithm.md §9, on NVLink when a ring stays inside a node, else on the
  inter-node network (rank order tp-cp-dp-pp, as Megatron), each collective `link_latency_us` plus
  bytes / bandwidth; the gather hides behind the local noisy→noisy attention and the dK/dV
  reduce-scatter behind the local noisy backward, for CSBP and for our CP baseline alike (ops.py runs
  both through the same op; CP moves twice the bytes behind the same local work). Recompute of the
  core attention (full or selective) runs the gather and the attention a second time;
* TP (sequence parallel: 4 all-gather/reduce-scatter per layer per pass) and PP point-to-point are
  exposed; the distributed optimizer's gradient reduce-scatter and parameter all-gather over the
  DP×P group hide behind one micro-batch of compute; the 1F1B bubble is `(PP-1)` micro-batch times;
* memory: bf16 weights, fp32 main grads (sharded over DP×P with `sharded_gradients`, as ZeRO-2 / FSDP
  hold them), fp32 master weights and Adam moments sharded over DP×P (distributed optimizer); activations
  with sequence parallelism: every layer's saved tensors and gathered K/V (selective or no recompute; flash
  kernels keep no `L²` scores), or each layer's input plus the larger of one layer's backward working set
  (its recomputed saved tensors and their gradients) and the noisy rows' logits with their fp32 copy
  (full recompute; the loss's backward frees the logits before any layer's backward runs); with
  `logits_tile_rows` (`--cross-entropy-loss-fusion`) the loss runs over the noisy rows in tiles of that many rows
  (the trainer's tiled linear cross-entropy), so only one tile's logits live, and the head's forward runs again in
  the backward (each tile's logits are recomputed there);
* mixture of experts (`--num-experts` ...): every EP dividing the experts (ETP = TP, or 1 under TP), EP x ETP x
  expert-DP carved from each stage's TP x P x DP ranks as megatron-core does (the trainer's rules decide). Per
  rank: the MoE layers' linear FLOPs are the router's, the top-k experts' and the shared expert's
  (`flops.moe_layer_linear_flops_per_row`, the training TFLOP/s count), which uniform routing gives each rank
  for its own rows; the routed experts' parameters are `E / EP` experts per MoE layer (/ ETP), their gradients
  and Adam state sharded over the expert-data-parallel group (TP·P·DP / (EP·ETP)) as megatron-core's
  distributed optimizer shards them, the dense ones (routers whole on every rank) over DP×P; the alltoall
  dispatcher sends `flops.moe_all_to_all_bytes` per MoE layer (every row of the rank, noisy and clean, x top-k,
  the `(EP-1)/EP` leaving the rank under uniform routing; rows and probabilities out, outputs back, and the
  same in the backward), on NVLink or the inter-node link as the EP group lies (expert ranks ordered
  tp-ep-dp-pp), exposed (the experts wait for their rows). Not modelled: the ETP all-gather of routed rows,
  routing imbalance, the expert computation's lower efficiency on small GEMMs;
* Gated DeltaNet layers (`--experimental-attention-variant gated_delta_net`): their projections, convolution and
  MLP (`flops.gated_delta_linear_flops_per_row`) and the chunked delta rule over the rank's rows as
  `core.gated_delta` runs it (`flops.gated_delta_core_flops`) at the linear layers' rate; no K/V travels in them,
  but the clean states, chunk maps and convolution histories (`flops.gated_delta_bytes`, the ring's busiest rank),
  exposed (the layer waits for them); their working set (`_gated_delta_working_bytes`) beside the attention layers'.
* sliding windows and Gemma 4's attention (`--window-size`, `--window-attn-skip-freq`, `--gemma4-attention`): each
  attention layer priced with its window (its pairs, kernel calls and the rows its ring exchanges, the busiest rank's)
  and its head size and K/V heads (`flops.layer_attention_shape`: a global layer's own, K and V both sent);
* self-conditioning (`--bdlm-objective diffusion-gemma`): with its probability, a first, detached pass of the layers
  (their exchange and all-to-all too) and the head with the signal's product with the embedding over the canvas
  rows, and the block's MLP on the canvas rows; its memory (one layer at a time, no gradient) is not added.
Everything is per GPU per step; one micro-batch per DP replica unless `--global-batch-size` is set.
"""

import argparse
import dataclasses
import functools
import json
import sys


from megatron_csbp.bdlm import flops
from megatron_csbp.core import kernel_work, modes, objectives, rules, transports, windows
from megatron_csbp.core.clean_attention import BLOCK_CAUSAL, CLEAN_ATTENTIONS, CleanAttention
from megatron_csbp.core.model_shape import (GATED_DELTA_NET, Gemma4AttentionShape, LinearAttentionShape, ModelShape,
                                            MoEShape)
from megatron_csbp.core.run_config import LINEAR_SIZES, RunConfig
from megatron_csbp.training.flags import linear_attention_freq, moe_layer_freq, window_attn_skip_freq, window_size

GIB = 2 ** 30
MODES = tuple(sorted(modes.PARALLEL_MODES.values(), key=lambda mode: not mode.is_baseline))  # baseline first


PASSES = FORWARD, BACKWARD = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class GPU:
    """A GPU and its links; bandwidths are effective NCCL bus bandwidths per GPU, one direction."""
    name: str
    bf16_tflops: float
    achievable_fraction: float
    hbm_gb: float
    nvlink_gb_s: float
    internode_gb_s: float
    usable_memory_fraction: float = 0.9
    attention_fraction: float = None     # any attention kernel's fraction of peak (default: achievable_fraction)
    # ((kind, pass), fraction of peak) per kernel family (`kernel_work.KINDS`) and pass (`PASSES`); a family
    # not listed runs at `attention_fraction`.
    kernel_fractions: tuple = ()
    tile: int = 128                      # the attention kernels' tile (flex's default block size)
    link_latency_us: float = 0.0         # per collective

    @property
    def linear_rate(self) -> float:
        """FLOP/s of the linear layers and the LM head."""
        return self.bf16_tflops * 1e12 * self.achievable_fraction

    def kernel_rate(self, kind: str, pass_: str) -> float:
        """FLOP/s of a `kind` attention kernel in the `pass_` pass (on its computed pairs)."""
        fraction = dict(self.kernel_fractions).get((kind, pass_))
        return self.bf16_tflops * 1e12 * (fraction or self.attention_fraction or self.achievable_fraction)


# The kernels each family runs on Hopper (SM90) in the paper's implementation (turbo-dllm 0.1.6,
# dllm_parallel/core/attention/context_parallel_attention.py): the field's CP runs compiled flex attention
# with the BDLM block mask, forward and backward (`_CollectiveContextParallelAttentionBSHD`); CSBP runs its
# clean prefix through FlashAttention-4's block-sparse forward (CuTe, `native_fa4=True` in
# `_packed_clean_flex_shard_accumulate_bshd_`) and flex's backward (`_flex_merged_shard_backward`), and its
# block-diagonal part through flex without a mask. Fractions of the 989 TFLOP/s dense bf16 peak, from
# published figures at head dim 128:
# * FA3-class forward 620.7 TFLOP/s, and the Triton flash forward flex is built on 476.8 TFLOP/s, both on
#   H100 at (batch 1, 16 heads, 16K, d 128); at 512 tokens 430.3 and 328.9 (pytorch/benchmark PR #2391,
#   commit ff65cb6, `--op flash_attention --metrics tflops`);
# * flex attention at ~90% of FlashAttention-2 in the forward and ~85% in the backward (PyTorch blog,
#   "FlexAttention: The Flexibility of PyTorch with the Performance of FlashAttention", Aug 2024; quoted
#   from that post, whose text was not re-read where this was written);
# * a flash backward at ~0.85 of its forward's throughput: an ASSUMPTION (FlashAttention-2's A100 figures put
#   the backward below the forward; no H100 backward figure was at hand).
# Assumed, not measured on an H200: flex forward = 0.90 x 476.8; every backward (flex's, which both modes
# run) = 0.85 x 0.85 x 476.8; dense blocks of the block size (flex without a mask on short problems) at the
# 512-token Triton figure, x 0.90 forward and x 0.85 x 0.85 backward.
_TRITON_FORWARD, _FA3_FORWARD, _TRITON_SHORT_FORWARD, _PEAK = 476.8, 620.7, 328.9, 989.0
SM90_KERNELS = (
    ((kernel_work.MASKED, FORWARD), 0.90 * _TRITON_FORWARD / _PEAK),
    ((kernel_work.PREFIX, FORWARD), _FA3_FORWARD / _PEAK),
    ((kernel_work.DENSE, FORWARD), 0.90 * _TRITON_SHORT_FORWARD / _PEAK),
    ((kernel_work.MASKED, BACKWARD), 0.85 * 0.85 * _TRITON_FORWARD / _PEAK),
    ((kernel_work.PREFIX, BACKWARD), 0.85 * 0.85 * _TRITON_FORWARD / _PEAK),
    ((kernel_work.DENSE, BACKWARD), 0.85 * 0.85 * _TRITON_SHORT_FORWARD / _PEAK),
)

# Dense bf16 peak from the data sheets; 45% of it is a typical Megatron dense-model figure;
# ~360 GB/s all-gather bus bandwidth over NVLink 4 and ~45 GB/s per GPU over 400 Gb/s NDR InfiniBand
# are typical nccl-tests values. Chosen before any comparison with the paper, not fitted to it.
GPU_PRESETS = {
    "h100": GPU("h100", bf16_tflops=989.0, achievable_fraction=0.45, hbm_gb=80.0,
                nvlink_gb_s=360.0, internode_gb_s=45.0, kernel_fractions=SM90_KERNELS),
    "h200": GPU("h200", bf16_tflops=989.0, achievable_fraction=0.45, hbm_gb=141.0,
                nvlink_gb_s=360.0, internode_gb_s=45.0, kernel_fractions=SM90_KERNELS),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu: GPU

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("--gpus and --gpus-per-node must be positive")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"--gpus ({self.gpus}) must be a multiple of --gpus-per-node "
                             f"({self.gpus_per_node}) when it spans several nodes")

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class Model:
    """A GPT model by Megatron's hyper-parameters, trained as a BDLM on `seq_length` clean tokens."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    block_size: int
    ffn_hidden_size: int = None
    num_query_groups: int = None
    kv_channels: int = None
    vocab_size: int = 131070  # ids before EOD and MASK, as the trainer's --vocab-size (131072 rows)
    swiglu: bool = False
    untie_embeddings: bool = False
    recompute: str = None
    bytes_per_elem: int = 2
    micro_batch_size: int = 1
    global_batch_size: int = None
    transport: transports.Transport = transports.COLLECTIVE  # or its name
    clean_attention: CleanAttention = BLOCK_CAUSAL  # or its name: what a clean row sees of the clean copy
    clean_logits: bool = False  # the LM head runs over the clean rows too (an autoregressive co-loss)
    sharded_gradients: bool = False  # fp32 gradients sharded over DP×P (ZeRO-2 / FSDP), not whole on every rank
    logits_tile_rows: int = None     # the loss in tiles of this many rows of the micro-batch (None: all at once)
    # mixture of experts (the trainer's flags; num_experts None: a dense model)
    num_experts: int = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = None  # None: ffn_hidden_size
    moe_shared_expert_intermediate_size: int = None
    moe_layer_freq: object = 1       # an int N (layers 0, N, 2N, ... MoE) or a 0/1 pattern per layer
    moe_router_dtype: str = None     # the routing probabilities' precision (fp32, fp64; None: the model's)
    # Gated DeltaNet layers (megatron-core's flags; experimental_attention_variant None: none)
    experimental_attention_variant: str = None  # "gated_delta_net"
    linear_attention_freq: object = None        # N (every N-th layer full attention) or a 0/1 pattern per layer
    linear_sizes: tuple = ()                    # (name, value) of the --linear-* sizes given (the others default)
    attention_output_gate: bool = False         # a sigmoid gate on each full-attention layer's output
    # sliding-window layers (megatron-core's flags; window_size None: every layer global)
    window_size: tuple = None                   # (LEFT, 0)
    window_attn_skip_freq: object = None        # N (every N-th layer global) or a 0/1 pattern per layer
    gemma4_attention: tuple = ()                # Gemma 4's global layers: (head size, K/V heads); (): none
    gemma4_moe: bool = False                    # Gemma 4's MoE block (gated GELU-tanh MLPs, its norms)
    self_conditioning: float = 0.0              # the chance of a first, detached pass (DiffusionGemma's objective)

    def __post_init__(self):
        fill = lambda name, value: object.__setattr__(self, name, value)
        for name in ("window_size", "window_attn_skip_freq", "gemma4_attention"):
            if isinstance(getattr(self, name), list):
                fill(name, tuple(getattr(self, name)))
        rules.refuse(windows.window_size_problem(self.window_size, self.window_attn_skip_freq, self.num_layers))
        if isinstance(self.moe_layer_freq, list):
            fill("moe_layer_freq", tuple(self.moe_layer_freq))
        if isinstance(self.linear_attention_freq, list):
            fill("linear_attention_freq", tuple(self.linear_attention_freq))
        linear = LinearAttentionShape.from_flags(
            self.experimental_attention_variant, self.linear_attention_freq if isinstance(
                self.linear_attention_freq, (int, type(None))) else list(self.linear_attention_freq),
            self.num_layers, **dict(self.linear_sizes))
        if self.num_experts is not None:
            rules.refuse(rules.moe_layer_freq_problem(
                self.moe_layer_freq if isinstance(self.moe_layer_freq, int) else list(self.moe_layer_freq),
                self.num_layers)
                or rules.moe_problem(self.num_experts, self.moe_router_topk, "aux_loss", "alltoall", 1, 1, True, 1))
        problems = [rules.whole_blocks_problem(self.seq_length, self.block_size),
                    rules.choice_problem("--recompute-granularity", self.recompute, rules.RECOMPUTE_GRANULARITIES)
                    if self.recompute is not None else None,
                    rules.TRANSPORTS.problem(self.transport)]
        rules.refuse(next(filter(None, problems), None))
        fill("transport", transports.transport(self.transport))
        fill("clean_attention", CLEAN_ATTENTIONS(self.clean_attention))
        shape = ModelShape(
            num_layers=self.num_layers, hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups, kv_channels=self.kv_channels, ffn_hidden_size=self.ffn_hidden_size,
            swiglu=self.swiglu or self.gemma4_moe, add_bias_linear=False, layernorm_bias=False,
            untied_output=self.untie_embeddings,
            moe=None if self.num_experts is None else MoEShape(
                self.num_experts, self.moe_router_topk, self.moe_ffn_hidden_size, sum(self.moe_layers()),
                self.moe_shared_expert_intermediate_size or 0, gemma4=self.gemma4_moe),
            linear=linear, attention_output_gate=self.attention_output_gate,
            gemma4_attention=Gemma4AttentionShape(*self.gemma4_attention) if self.gemma4_attention else None)
        fill("shape", shape)  # the sizes the defaults leave, resolved there (RMSNorm, no linear biases)
        for name in ("ffn_hidden_size", "num_query_groups", "kv_channels"):
            fill(name, getattr(shape, name))
        if shape.moe is not None:
            fill("moe_ffn_hidden_size", shape.moe.ffn_hidden_size)

    @property
    def full_recompute(self) -> bool:
        return self.recompute == "full"

    def padded_vocab_size(self, tp: int) -> int:
        """The model's rows as the trainer pads them: the ids, EOD and MASK, to Megatron's default multiple
        (`--make-vocab-size-divisible-by` x TP)."""
        return rules.padded_vocab_size(self.vocab_size + 2, rules.MAKE_VOCAB_SIZE_DIVISIBLE_BY, tp)

    @property
    def moe(self) -> "MoEShape | None":
        """The experts as the FLOPs count takes them (None for a dense model)."""
        return self.shape.moe

    def moe_layers(self) -> list:
        """1 for each MoE layer, 0 for each dense one (all 0 for a dense model)."""
        if self.num_experts is None:
            return [0] * self.num_layers
        freq = self.moe_layer_freq
        return rules.moe_layer_pattern(freq if isinstance(freq, int) else list(freq), self.num_layers)

    @property
    def probs_bytes(self) -> int:
        """Bytes of one routing probability as the dispatcher sends it (the router's dtype, else the model's)."""
        return {"fp32": 4, "fp64": 8}.get(self.moe_router_dtype, self.bytes_per_elem)

    def layer_windows(self) -> tuple:
        """Each layer's window (`core.windows`), megatron-core's reading of the flags."""
        return windows.layer_windows(self.window_size, self.window_attn_skip_freq, self.num_layers)

    def layer_params(self, gated_delta: bool = False) -> int:
        """One dense layer's parameters as the trainer counts them (`flops.layer_parameter_count`; a Gated DeltaNet
        layer's, `flops.gated_delta_layer_parameter_count`)."""
        return (flops.gated_delta_layer_parameter_count if gated_delta else flops.layer_parameter_count)(self.shape)


@dataclasses.dataclass(frozen=True)
class Topology:
    """One layout: `p` ranks share a sequence (Megatron's CP slot); CP uses `c == p`, BP `c == 1`."""
    mode: modes.ParallelMode  # or its name
    tp: int
    pp: int
    p: int
    c: int
    dp: int
    ep: int = 1            # expert parallel: EP x ETP x expert-DP carved from each stage's TP x P x DP ranks
    etp: int = None        # expert tensor parallel (None: TP)

    def __post_init__(self):
        object.__setattr__(self, "mode", modes.parallel_mode(self.mode))

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.p * self.dp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel size: each expert's replicas, over which its gradients and optimizer state go."""
        return self.tp * self.p * self.dp // (self.ep * self.expert_tp)

    def record(self) -> dict:
        return dict(dataclasses.asdict(self), mode=self.mode.name)

    def label(self) -> str:
        experts = f" EP{self.ep}" + (f" ETP{self.etp}" if self.etp not in (None, self.tp) else "") \
            if self.ep > 1 or self.etp not in (None, self.tp) else ""
        return f"{self.mode.name:<4} TP{self.tp} PP{self.pp} P{self.p} C{self.c} DP{self.dp}{experts}"


def _divisors(n: int):
    return [d for d in range(1, n + 1) if n % d == 0]


def topology_problem(model: Model, cluster: Cluster, topo: Topology):
    """Why `topo` cannot run `model` on `cluster`, or None when it can.

    The trainer's own refusal: the layout's `RunConfig` is built as the trainer builds it (for the trainer's
    flags of this layout: `--context-block-parallel p --context-block-parallel-clean-shards c`, the dual-end
    schedule, the zigzag clean layout), so the planner refuses exactly what the trainer refuses, in its
    words; then two of the planner's own: DP is what the cluster leaves, and a TP group stays inside a node.
    """
    if topo.gpus != cluster.gpus:
        return f"TP·PP·P·DP = {topo.gpus} is not the {cluster.gpus} GPUs"
    try:
        run_config(model, topo, cluster)
    except rules.ConfigError as error:
        return str(error)
    if topo.tp > cluster.gpus_per_node or cluster.gpus_per_node % topo.tp:
        return f"TP{topo.tp} would leave the node"
    return None


def run_config(model: Model, topo: Topology, cluster: Cluster) -> RunConfig:
    """The trainer's `RunConfig` of `model` in layout `topo` on `cluster` (`ConfigError` where it refuses)."""
    return RunConfig(model.shape, seq_length=model.seq_length, block_size=model.block_size, mode=topo.mode,
                     block_parallel_size=topo.p, clean_shards=topo.c, transport=model.transport,
                     clean_attention=model.clean_attention,
                     tensor_parallel_size=topo.tp, pipeline_parallel_size=topo.pp, world_size=cluster.gpus,
                     micro_batch_size=model.micro_batch_size, global_batch_size=model.global_batch_size,
                     expert_parallel_size=topo.ep, expert_tensor_parallel_size=topo.etp,
                     window_size=model.window_size, window_attn_skip_freq=model.window_attn_skip_freq,
                     # a first pass priced means DiffusionGemma's objective, whose rules (no PP beside it) hold here too
                     **(dict(objective=objectives.DIFFUSION_GEMMA,
                             self_conditioning_probability=model.self_conditioning) if model.self_conditioning else {}))


def candidate_topologies(cluster: Cluster, model: Model = None):
    """Every (mode, TP, PP, P, C, DP) that multiplies to the cluster size, valid or not: CP and pure BP at every
    P, CSBP at every C > 1 dividing P (CSBP with C = 1 is pure BP, and at P = 1 all three are the same run); for
    a model with experts, every EP dividing the expert count, with ETP = TP and, under TP, ETP = 1 (which of them
    the stage's ranks can hold is the trainer's `rules.expert_parallel_problem`)."""
    n = cluster.gpus
    experts = model.num_experts if model is not None and model.num_experts else None
    for tp in _divisors(n):
        for pp in _divisors(n // tp):
            for p in _divisors(n // (tp * pp)):
                dp = n // (tp * pp * p)
                for mode in MODES:
                    for c in mode.clean_shard_choices(p):
                        if experts is None:
                            yield Topology(mode, tp, pp, p, c, dp)
                            continue
                        for ep in _divisors(experts):
                            for etp in (None, 1) if tp > 1 else (None,):
                                yield Topology(mode, tp, pp, p, c, dp, ep, etp)


def valid_topologies(model: Model, cluster: Cluster):
    return [t for t in candidate_topologies(cluster, model) if topology_problem(model, cluster, t) is None]


def _ring_crossings(cluster: Cluster, topo: Topology) -> int:
    """Most node boundaries any ring of `c` block ranks crosses (rank = tp + TP·(cp + P·(dp + DP·pp)))."""
    if topo.c == 1:
        return 0
    worst = 0
    for outer in range(topo.dp * topo.pp):
        for ring in range(topo.p // topo.c):
            base = topo.tp * (ring * topo.c + topo.p * outer)
            nodes = [cluster.node(base + topo.tp * i) for i in range(topo.c)]
            worst = max(worst, sum(nodes[i] != nodes[(i + 1) % topo.c] for i in range(topo.c)))
    return worst


def _spans_nodes(cluster: Cluster, ranks) -> bool:
    return len({cluster.node(r) for r in ranks}) > 1


def _expert_group_spans_nodes(cluster: Cluster, topo: Topology) -> bool:
    """Whether an expert-parallel group leaves a node: megatron-core orders the expert ranks tp-ep-dp-pp (ETP
    fastest), so an EP group is `EP` ranks `ETP` apart; every group of a stage is a shifted copy of rank 0's."""
    stage = topo.tp * topo.p * topo.dp
    return any(_spans_nodes(cluster, [base + topo.expert_tp * i for i in range(topo.ep)])
               for base in range(0, stage, topo.expert_tp * topo.ep))


@dataclasses.dataclass
class Prediction:
    topology: Topology
    noisy_rows: int
    clean_rows: int
    flops_per_rank: float
    attention_bytes: float
    ring_link: str
    bytes_intra_node: float
    bytes_inter_node: float
    activation_bytes: float
    state_bytes: float  # parameter_bytes + gradient_bytes + optimizer_bytes
    memory_bytes: float
    memory_limit_bytes: float
    compute_s: float
    forward_s: float  # the step's forward passes (recomputed forwards count with the backward)
    exposed_attention_s: float
    exposed_other_comm_s: float
    bubble_s: float
    step_time_s: float
    tokens_per_s: float
    # parameters on one rank of the worst stage (dense: attention, norms, dense MLPs, router, shared expert,
    # embeddings; expert: its EP rank's routed experts, their ETP shard), and their weights, gradients, optimizer
    dense_params_per_rank: float = 0.0
    expert_params_per_rank: float = 0.0
    parameter_bytes: float = 0.0
    gradient_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    all_to_all_bytes: float = 0.0      # MoE token dispatcher bytes this rank sends per step (uniform routing)
    logits_bytes: float = 0.0          # the LM head's logits (and their fp32 copy) live at once, one micro-batch
    exposed_all_to_all_s: float = 0.0
    reason: str = ""

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit_bytes

    @property
    def attention_gib(self) -> float:
        return self.attention_bytes / GIB

    def record(self) -> dict:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "topology"}
        return {**self.topology.record(), **fields, "fits": self.fits,
                "attention_traffic_gib_per_step": round(self.attention_gib, 2)}


@functools.lru_cache(maxsize=256)
def _kernel_calls(mode, seq_length: int, block_size: int, p: int, c: int, tile: int, clean_attention,
                  window=windows.GLOBAL) -> tuple:
    """Every rank's kernel calls of one layer's forward (`ParallelMode.kernel_calls`), once per layout."""
    return tuple(mode.kernel_calls(seq_length, block_size, p, c, rank, tile, clean_attention, window)
                 for rank in range(p))


def attention_seconds(mode, model: Model, topo: Topology, gpu: GPU, per_pair: float,
                      window=windows.GLOBAL) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's core attention (of `window`) on the slowest rank, one micro-batch:
    each kernel call's computed pairs at its family's rate in that pass (the backward does
    `rules.BACKWARD_FLOPS_PER_FORWARD` times the forward's FLOPs).
    """
    seconds = []
    for calls in _kernel_calls(mode, model.seq_length, model.block_size, topo.p, topo.c, gpu.tile,
                               model.clean_attention, window):
        work = lambda pass_: sum(call.calls * call.computed_pairs * per_pair / gpu.kernel_rate(call.kind, pass_)
                                 for call in calls)
        seconds.append((work(FORWARD), rules.BACKWARD_FLOPS_PER_FORWARD * work(BACKWARD)))
    return max(seconds, key=sum)


def predict(model: Model, cluster: Cluster, topo: Topology) -> Prediction:
    """The analytic step of `topo` (see the module docstring for what is modelled)."""
    problem = topology_problem(model, cluster, topo)
    if problem:
        raise ValueError(f"invalid topology {topo.label()}: {problem}")
    gpu, L, h, e = cluster.gpu, model.seq_length, model.hidden_size, model.bytes_per_elem
    mode, tp, pp, p, c, dp = topo.mode, topo.tp, topo.pp, topo.p, topo.c, topo.dp
    mbs = model.micro_batch_size
    global_batch = model.global_batch_size or dp * mbs
    microbatches = global_batch // (mbs * dp)
    rate = gpu.linear_rate

    noisy_rows, clean_rows = mode.rows(L, p, c)
    rows = noisy_rows + clean_rows
    vocab = model.padded_vocab_size(tp)
    layers = model.num_layers // pp
    passes = rules.step_passes(model.full_recompute)
    attention_passes = rules.step_passes(model.recompute)  # selective recompute redoes the core attention
    head_passes = rules.step_passes(model.logits_tile_rows is not None)  # the tiled loss recomputes the logits
    first = model.self_conditioning  # expected first, detached forward passes (DiffusionGemma's self-conditioning)
    # Each layer: its window and attention shape (`flops.layer_attention_shape`: a Gemma 4 global layer's own), its
    # linear FLOPs per row (the MoE layers' router, top-k experts and shared expert: `flops.moe_layer_linear_flops_
    # per_row`; a Gated DeltaNet layer's projections, convolution and MLP); under uniform routing each rank's experts
    # get as many (row, expert) pairs as its rows send out, so a rank computes its own rows' share, / TP under SP.
    pattern, linear_pattern, layer_windows = model.moe_layers(), model.shape.linear_layers, model.layer_windows()
    linear = model.shape.linear
    moe_extra = (flops.moe_layer_linear_flops_per_row(model.shape) - flops.linear_flops_per_row(model.shape)
                 if model.moe else 0)
    gated_delta_row_flops = flops.gated_delta_linear_flops_per_row(model.shape) if linear else 0
    row_flops = [gated_delta_row_flops + moe_extra * moe if gated_delta else
                 flops.linear_flops_per_row(model.shape, window) + moe_extra * moe
                 for window, moe, gated_delta in zip(layer_windows, pattern, linear_pattern)]
    gated_delta_core = flops.gated_delta_core_flops(
        noisy_rows, clean_rows, model.block_size, linear.num_value_heads // tp, linear.key_head_dim,
        linear.value_head_dim) if linear else 0
    # The stage with the most work bounds the step (exact at PP1): its layers.
    stages = [range(stage * layers, (stage + 1) * layers) for stage in range(pp)]
    stage = max(stages, key=lambda span: sum(row_flops[n] for n in span))
    moe_layers = sum(pattern[n] for n in stage)
    linear_layers = sum(linear_pattern[n] for n in stage)
    kinds = [_attention_kind(model, topo, gpu, layer_windows[n]) for n in stage if not linear_pattern[n]]
    attention_layers = len(kinds)
    stage_linear = rows * sum(row_flops[n] for n in stage) / tp + linear_layers * gated_delta_core
    attention_forward = sum(kind.pairs * kind.per_pair for kind in kinds)
    forward_attention_s = sum(kind.forward_s for kind in kinds)
    backward_attention_s = sum(kind.backward_s for kind in kinds)
    head_rows = rows if model.clean_logits else noisy_rows  # the AR co-loss' head runs over the clean rows too
    head_forward = head_rows * flops.lm_head_flops_per_row(h, vocab) / tp
    # Self-conditioning: the block's MLP (gate, up, down) on the canvas rows, trained (forward and backward) and in
    # the first pass; the first pass runs the layers once (its attention ring too) and the head over the canvas rows
    # with the signal's product with the embedding (as much again).
    block = noisy_rows * 3 * 2 * h * model.ffn_hidden_size / tp if first else 0.0
    first_forward = first * (stage_linear + attention_forward + 2 * noisy_rows * flops.lm_head_flops_per_row(h, vocab)
                             / tp + block)
    forward_s = mbs * (stage_linear / rate + forward_attention_s + head_forward / rate)
    microbatch_flops = mbs * (passes * stage_linear + attention_passes * attention_forward
                              + head_passes * head_forward + rules.step_passes() * block + first_forward)
    # forward runs of the core attention: 1, or 2 when recomputed
    attention_runs = attention_passes - rules.BACKWARD_FLOPS_PER_FORWARD
    compute_s = mbs * (passes * stage_linear / rate
                       + attention_runs * forward_attention_s + backward_attention_s
                       + head_passes * head_forward / rate + rules.step_passes() * block / rate
                       + first * (forward_attention_s + (first_forward / first - attention_forward) / rate
                                  if first else 0.0))

    # MoE all-to-all (alltoall dispatcher) of the stage's MoE layers: every row of the rank is routed (noisy and
    # clean; / TP under sequence parallelism), uniformly, on the EP group's link; on the critical path (the
    # experts wait for their rows), so exposed; 3 exchanges per pass (rows, probabilities, combine).
    model_forward_runs = 2 if model.full_recompute else 1
    a2a_layer = flops.moe_all_to_all_bytes(mbs * rows // tp, model.moe, topo.ep, h, e, model.probs_bytes,
                                           model_forward_runs + first) if model.moe and topo.ep > 1 else 0.0
    a2a_bw = (gpu.internode_gb_s if _expert_group_spans_nodes(cluster, topo) else gpu.nvlink_gb_s) * 1e9
    a2a_s = moe_layers * (a2a_layer / a2a_bw + 3 * (model_forward_runs + first + 1) * gpu.link_latency_us * 1e-6) \
        if a2a_layer else 0.0

    # Attention traffic of each layer, forward (gather) and backward parts, on the ring's link; the forward runs
    # again when recomputed, and in the first pass.
    crossings = _ring_crossings(cluster, topo)
    ring_bw = (gpu.internode_gb_s if crossings else gpu.nvlink_gb_s) * 1e9
    forward_runs = 2 if model.recompute else 1
    transport = model.transport
    latency = gpu.link_latency_us * 1e-6 if c > 1 else 0.0
    layer_bytes = exposed_layers = 0.0
    for kind in kinds:
        forward_bytes, backward_bytes = mbs * kind.forward_bytes, mbs * kind.backward_bytes
        layer_bytes += (forward_runs + first) * forward_bytes + backward_bytes
        forward_link_s = transport.forward_messages(c) * latency + forward_bytes / ring_bw
        backward_link_s = transport.backward_messages(c) * latency + backward_bytes / ring_bw
        hide_forward = mbs * kind.forward_s * (1 if transport.hides_behind_all_pairs else kind.local_fraction)
        exposed_layers += ((forward_runs + first) * max(0.0, forward_link_s - hide_forward)
                           + max(0.0, backward_link_s - 2 * hide_forward)) if c > 1 else 0.0
    # Gated DeltaNet layers send no K/V: the clean states, chunk maps and convolution histories of
    # `flops.gated_delta_bytes` (the ring's busiest rank), waited for at once, so exposed; forward twice when
    # the whole layer is recomputed.
    gated_delta_forward, gated_delta_backward = _gated_delta_bytes(model, topo) if linear else (0, 0)
    gated_delta_layer = mbs * (model_forward_runs * gated_delta_forward + gated_delta_backward)
    gated_delta_s = (gated_delta_layer / ring_bw + 3 * (model_forward_runs + 1) * latency) if gated_delta_layer else 0.0
    exposed_attention_s = exposed_layers + linear_layers * gated_delta_s
    attention_bytes = microbatches * (layer_bytes + linear_layers * gated_delta_layer)
    inter_fraction = crossings / c if c > 1 else 0.0

    # Tensor parallel (sequence parallel: 2 all-gathers + 2 reduce-scatters per pass) and PP p2p.
    forward_passes = 2 if model.full_recompute else 1
    tp_bytes = layers * 4 * (forward_passes + 1) * (tp - 1) / tp * rows * h * e * mbs
    pp_bytes = 2 * rows * h * e * mbs / tp if pp > 1 else 0.0
    pp_bw = gpu.internode_gb_s if _spans_nodes(cluster, [0, tp * p * dp]) else gpu.nvlink_gb_s
    tp_pp_s = tp_bytes / (gpu.nvlink_gb_s * 1e9) + pp_bytes / (pp_bw * 1e9)

    # Distributed optimizer (megatron-core's): dense parameters' fp32 grad reduce-scatter + param all-gather over
    # the DP×P group; the experts' over the expert-data-parallel group (TP·P·DP / (EP·ETP) ranks).
    embeddings = 2 if pp == 1 and model.untie_embeddings else 1
    dense_params, expert_params = _stage_parameters(
        model, topo, [layer_windows[n] for n in stage if not linear_pattern[n]], moe_layers, vocab, embeddings,
        linear_layers)
    group, expert_group = dp * p, topo.expert_dp
    dp_bytes = (dense_params * (group - 1) / group + expert_params * (expert_group - 1) / expert_group) * (4 + e)
    dp_ranks = [tp * i for i in range(group)]
    dp_bw = gpu.internode_gb_s if _spans_nodes(cluster, dp_ranks) else gpu.nvlink_gb_s
    exposed_dp_s = max(0.0, dp_bytes / (dp_bw * 1e9) - compute_s)

    microbatch_s = compute_s + exposed_attention_s + tp_pp_s + a2a_s
    bubble_s = (pp - 1) * microbatch_s
    step_time_s = microbatches * microbatch_s + bubble_s + exposed_dp_s

    # Memory of the worst stage.
    working_layer = max((mbs * kind.working_bytes for kind in kinds), default=0.0)
    working_gated_delta = mbs * _gated_delta_working_bytes(model, noisy_rows, clean_rows, tp) if linear else 0.0
    layer_stored = mbs * rows * h * e / tp if model.full_recompute else None
    stage_stored = (layer_stored * layers if layer_stored is not None
                    else sum(mbs * kind.working_bytes for kind in kinds) + linear_layers * working_gated_delta)
    # A recomputed layer's backward holds its saved tensors and, as it runs, gradients of the same sizes.
    recompute_working = 2 * max(working_layer if attention_layers else 0.0, working_gated_delta) \
        if model.full_recompute else 0.0
    # The CE keeps an fp32 copy of the logits until its backward, which runs before any layer's (one tile's
    # logits when the loss runs in tiles of rows).
    logits = min(mbs * head_rows, model.logits_tile_rows or mbs * head_rows) * vocab / tp * (e + 4)
    last_stage = stage_stored + max(logits, recompute_working)
    first_stage = stage_stored * min(pp, microbatches) + recompute_working
    activation_bytes = max(last_stage, first_stage) if pp > 1 else last_stage
    parameter_bytes, gradient_bytes, optimizer_bytes = _state_bytes(model, dense_params, expert_params, group,
                                                                    expert_group)
    state_bytes = parameter_bytes + gradient_bytes + optimizer_bytes
    memory_limit = gpu.hbm_gb * 1e9 * gpu.usable_memory_fraction

    return Prediction(
        topology=topo, noisy_rows=noisy_rows, clean_rows=clean_rows,
        flops_per_rank=microbatches * microbatch_flops, attention_bytes=attention_bytes,
        ring_link="none" if c == 1 else ("inter-node" if crossings else "NVLink"),
        bytes_intra_node=attention_bytes * (1 - inter_fraction), bytes_inter_node=attention_bytes * inter_fraction,
        activation_bytes=activation_bytes, state_bytes=state_bytes,
        memory_bytes=activation_bytes + state_bytes, memory_limit_bytes=memory_limit,
        compute_s=microbatches * compute_s, forward_s=microbatches * forward_s,
        exposed_attention_s=microbatches * exposed_attention_s,
        exposed_other_comm_s=microbatches * tp_pp_s + exposed_dp_s, bubble_s=bubble_s,
        step_time_s=step_time_s, tokens_per_s=global_batch * L / step_time_s,
        dense_params_per_rank=dense_params, expert_params_per_rank=expert_params, parameter_bytes=parameter_bytes,
        gradient_bytes=gradient_bytes, optimizer_bytes=optimizer_bytes,
        all_to_all_bytes=microbatches * moe_layers * a2a_layer, exposed_all_to_all_s=microbatches * a2a_s,
        logits_bytes=logits)


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """One attention layer of a window and shape in a layout, per rank and sample: its forward FLOPs per pair (`/ TP`)
    and pairs, the share of them needing no remote key, the slowest rank's core attention seconds, the busiest
    rank's ring bytes (forward; backward), the bytes its forward holds (saved tensors and the gathered K/V)."""
    per_pair: int
    pairs: float
    local_fraction: float
    forward_s: float
    backward_s: float
    forward_bytes: int
    backward_bytes: int
    working_bytes: float


@functools.lru_cache(maxsize=256)
def _attention_kind(model: Model, topo: Topology, gpu: GPU, window) -> AttentionKind:
    """The `AttentionKind` of `model`'s attention layers of `window` in `topo`: the layer's head size and K/V heads
    (`flops.layer_attention_shape`), its pairs and kernel calls under the window, and the rows its ring exchanges
    (`ParallelMode.exchanged_rows`: the whole transported copies in a global layer, the windows another member's rows
    see in a sliding one under CSBP), K and V both sent (Gemma 4's global value is a norm of the key: a tensor of
    its own by the time the attention runs)."""
    mode, tp, e, L = topo.mode, topo.tp, model.bytes_per_elem, model.seq_length
    head, groups, _ = flops.layer_attention_shape(model.shape, window)
    heads_tp, kv_heads_tp = model.num_attention_heads // tp, groups // tp
    per_pair = flops.attention_flops_per_pair(heads_tp, head)
    pairs, local = mode.attention_pairs(flops.bdlm_attention_pair_parts(L, model.block_size, model.clean_attention,
                                                                        window), topo.p, topo.c)
    forward_s, backward_s = attention_seconds(mode, model, topo, gpu, per_pair, window)
    sent, received = max((mode.exchanged_rows(L, model.block_size, topo.p, topo.c, rank, model.clean_attention, window)
                          for rank in range(topo.c)), key=sum)
    beta = flops.kv_bytes_per_token(kv_heads_tp, head, e)
    again = sent if model.transport.backward_bytes_per_forward > 1 else 0
    noisy_rows, clean_rows = mode.rows(L, topo.p, topo.c)
    windowed = window.sliding and topo.c > 1 and not mode.shards_both_copies
    gathered = clean_rows + received if windowed else mode.gathered_tokens(L, topo.c)
    query, kv = model.num_attention_heads * head, groups * head
    ffn_saved = model.ffn_hidden_size * (3 if model.swiglu else 2)
    gate = query if model.attention_output_gate else 0
    row_bytes = e * (4 * model.hidden_size + query + gate + 2 * kv + query + ffn_saved) / tp + 4 * heads_tp
    return AttentionKind(per_pair, pairs, local / pairs, forward_s, backward_s, sent * beta, (again + received) * beta,
                         (noisy_rows + clean_rows) * row_bytes + gathered * beta)


@functools.lru_cache(maxsize=256)
def _gated_delta_bytes(model: Model, topo: Topology) -> tuple[int, int]:
    """(forward, backward) bytes the busiest rank of `topo`'s ring sends in one Gated DeltaNet layer, one sample
    (`flops.gated_delta_bytes`: value heads and convolution channels / TP, histories in the model's dtype)."""
    linear, tp = model.shape.linear, topo.tp
    channels = 2 * linear.num_key_heads * linear.key_head_dim + linear.num_value_heads * linear.value_head_dim
    sent = [flops.gated_delta_bytes(topo.mode, model.seq_length, model.block_size, topo.p, topo.c, rank,
                                    linear.num_value_heads // tp, linear.key_head_dim, linear.value_head_dim,
                                    channels // tp, linear.conv_kernel_dim, model.bytes_per_elem)
            for rank in range(topo.c)]
    return max(sent, key=sum)


def _gated_delta_working_bytes(model: Model, noisy_rows: int, clean_rows: int, tp: int) -> float:
    """Bytes one Gated DeltaNet layer's forward holds on a rank, one sample (what its backward keeps, or a recomputed
    layer rebuilds): per row its input, norm and residual (`4h`), the in-projection's output, the convolution's,
    the MLP's (model dtype), and in fp32 q, k, v, the core's output (the clean rows' widened by `dk` per head: read-
    outs); per clean block its map and the entry and end states composed (`dk x (dk + dv)` per head each), per
    noisy block the state it starts from (`dk x dv`)."""
    linear, h, e = model.shape.linear, model.hidden_size, model.bytes_per_elem
    qk, v, heads = linear.num_key_heads * linear.key_head_dim, linear.num_value_heads * linear.value_head_dim, \
        linear.num_value_heads
    in_projection, channels = 2 * qk + 2 * v + 2 * heads, 2 * qk + v
    ffn_saved = model.ffn_hidden_size * (3 if model.swiglu else 2)
    rows = noisy_rows + clean_rows
    per_row = (e * (4 * h + in_projection + channels + v + ffn_saved) + 4 * (channels + v)) / tp
    widened = clean_rows * 4 * heads * linear.key_head_dim / tp
    dk, dv = linear.key_head_dim, linear.value_head_dim
    states = (3 * clean_rows // model.block_size * dk * (dk + dv) + noisy_rows // model.block_size * dk * dv) \
        * 4 * heads / tp
    return rows * per_row + widened + states


def _stage_parameters(model: Model, topo: Topology, attention_windows: list, moe_layers: int, vocab: int,
                      embeddings: int, linear_layers: int = 0) -> tuple[float, float]:
    """(dense, expert) parameters on one rank of a stage of attention layers of `attention_windows` (each layer's
    window: a Gemma 4 global layer has its own attention shape) and `linear_layers` Gated DeltaNet layers,
    `moe_layers` of them MoE.

    Dense: the layers' attention, norms and MLPs, the shared experts, the final norm and the embeddings, / TP
    (as the planner counts a dense model; every stage is charged the embeddings and the final norm, the worst
    case), and the MoE layers' routers, whole on every rank; expert: the `E / EP` routed experts of each MoE layer
    this rank's EP rank holds, / ETP."""
    dense = (sum(flops.layer_parameter_count(model.shape, window) for window in attention_windows)
             + (linear_layers * model.layer_params(gated_delta=True) if linear_layers else 0)
             + embeddings * vocab * model.hidden_size + model.hidden_size)
    if model.moe is None:
        return dense / topo.tp, 0.0
    parts = flops.moe_mlp_parameters(model.hidden_size, model.moe, model.swiglu, add_bias_linear=False)
    dense_mlp = flops.mlp_parameters(model.hidden_size, model.ffn_hidden_size, model.swiglu, add_bias_linear=False)
    dense += moe_layers * (parts["shared"] - dense_mlp)
    experts = moe_layers * parts["experts"] / topo.ep / topo.expert_tp
    return dense / topo.tp + moe_layers * parts["router"], experts


def _state_bytes(model: Model, dense: float, expert: float, group: int, expert_group: int):
    """(weights, gradients, optimizer) bytes of `dense` parameters whose distributed-optimizer state is sharded over
    `group` (DP×P) and `expert` parameters sharded over `expert_group` (expert-DP), as megatron-core 0.16 shards
    them: weights in the model's dtype; fp32 main gradients (sharded too with `sharded_gradients`, ZeRO-2); Adam's
    two fp32 moments, and with bf16 weights an fp32 master copy, sharded."""
    e = model.bytes_per_elem
    optimizer = 12 if e == 2 else 8
    gradients = sum(params * 4 / (shards if model.sharded_gradients else 1)
                    for params, shards in ((dense, group), (expert, expert_group)))
    return (dense + expert) * e, gradients, dense * optimizer / group + expert * optimizer / expert_group


def _count(n: float) -> str:
    """A parameter count in a few digits: 8.19K, 72.3M, 1.2B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def _reason(pred: Prediction, baseline: Prediction = None) -> str:
    """`baseline`: the baseline mode's prediction at the same TP, PP, C and replicas, if valid."""
    topo, said = pred.topology, []
    mode = topo.mode
    if mode.compared_with_baseline and baseline is not None:
        said.append(f"sends {pred.attention_gib:.2f} GiB vs {baseline.topology.mode.name.upper()}{topo.c}'s "
                    f"{baseline.attention_gib:.2f}")
    said += mode.traits(topo.p, topo.c)
    if pred.ring_link != "none":
        said.append("ring inside a node" if pred.ring_link == "NVLink" else "ring crosses nodes")
    exposed = pred.exposed_attention_s + pred.exposed_other_comm_s
    said.append(f"comm exposed {100 * exposed / pred.step_time_s:.1f}% of the step")
    if pred.bubble_s:
        said.append(f"PP bubble {100 * pred.bubble_s / pred.step_time_s:.0f}%")
    if pred.expert_params_per_rank:
        said.append(f"EP{topo.ep}: {_count(pred.expert_params_per_rank)} expert + "
                    f"{_count(pred.dense_params_per_rank)} dense params per rank, expert state over "
                    f"expert-DP {topo.expert_dp}"
                    + (f", all-to-all {pred.all_to_all_bytes / GIB:.2f} GiB per step "
                       f"(exposed {100 * pred.exposed_all_to_all_s / pred.step_time_s:.1f}%)" if topo.ep > 1 else ""))
    mem = f"{pred.memory_bytes / GIB:.1f} of {pred.memory_limit_bytes / GIB:.1f} GiB"
    said.append(f"fits ({mem})" if pred.fits else f"does NOT fit ({mem})")
    return "; ".join(said)


def plan(model: Model, cluster: Cluster):
    """Predictions for every valid layout, fitting ones first, fastest first, each with its reason."""
    preds = [predict(model, cluster, t) for t in valid_topologies(model, cluster)]
    baseline_by_key = {(q.topology.tp, q.topology.pp, q.topology.c, q.topology.dp * q.topology.p // q.topology.c): q
                       for q in preds if q.topology.mode.is_baseline}
    for q in preds:
        t = q.topology
        q.reason = _reason(q, baseline_by_key.get((t.tp, t.pp, t.c, t.dp * t.p // t.c)))
    return sorted(preds, key=lambda q: (not q.fits, -q.tokens_per_s))


def best_by_mode(preds):
    """The fastest fitting prediction of each mode (None when no layout of that mode fits)."""
    best = {}
    for q in preds:
        if q.fits and q.topology.mode not in best:
            best[q.topology.mode] = q
    return {mode: best.get(mode) for mode in MODES}


def requested_topologies(model: Model, cluster: Cluster, tp: int, pp: int, p: int, c: int, ep: int = 1,
                         etp: int = None):
    """The user's layout in each mode: CP over the same P ranks, CSBP (P, C), BP (P, 1); EP and ETP as given."""
    rules.refuse(rules.world_size_problem(tp, pp, p, cluster.gpus))
    dp = cluster.gpus // (tp * pp * p)
    return [Topology(mode, tp, pp, p, mode.clean_shards(p, c), dp, ep, etp) for mode in MODES]


# The paper's 16×H200, 256K rows (docs/algorithm.md §11; /work/shared csbp-algorithm §8): the model shapes of
# the shipped configs/nemotron_labs_diffusion_*.yaml (Nemotron-Labs-Diffusion as Megatron-Bridge trains it: a
# token-causal clean stream whose rows carry the AR co-loss), the published layouts (no TP), block size 256, full
# recompute, tokens/s and peak GiB per GPU as published (CP baseline, CSBP).
PAPER_ROWS = [
    # name, config, (DP, P = C), published tok/s CP -> CSBP, published peak GiB CP -> CSBP
    ("Nemotron-Diffusion 3B", "nemotron_labs_diffusion_3b_256k", (4, 4), (13434, 16027), (57.1, 57.0)),
    ("Nemotron-Diffusion 8B", "nemotron_labs_diffusion_8b_256k", (4, 4), (9668, 11379), (97.5, 97.5)),
    ("Nemotron-Diffusion 14B", "nemotron_labs_diffusion_14b_256k", (2, 8), (7884, 9301), (91.1, 90.6)),
]
# The 14B operator profile, CP8 -> CSBP (seconds per step): forward, backward (with the recomputed forward),
# exposed communication.
PAPER_PROFILE_14B = {"forward_s": (17.57, 13.00), "backward_s": (49.46, 45.02), "exposed_comm_s": (3.034, 2.414)}
PAPER_BLOCK_SIZE = 256
PAPER_SEQ_LENGTH = 262144
# The paper's runs (turbo-dllm recipes): ZeRO-2 (gradients and optimizer sharded over the data-parallel
# world), the loss as a tiled linear cross-entropy (ASSUMED tile: 1024 rows), full activation checkpointing.
PAPER_LOGITS_TILE_ROWS = 1024
PAPER_TOLERANCE = 0.10


@dataclasses.dataclass(frozen=True)
class PaperRow:
    """A published model row checked at its own layout: the figures as published CP -> CSBP, the speedup at each
    context length, and what the planner leaves out (printed where a number misses by more than ±10%)."""

    name: str
    config: str
    described: str  # what the row's line says of the model, in parentheses
    label: str  # the layout as published
    layout: dict  # the Topology fields (dp, tp, ep) that run it here, beside P = C
    ranks: int  # P = C
    tokens_per_s: tuple
    peak_gib: tuple
    scaling: tuple  # (context length, published speedup)
    vocab_ids: int  # the model's ids (its vocabulary rows less EOD and MASK)
    not_modelled: str
    traffic_gib: tuple | None = None  # attention traffic per GPU per step, where published
    views: int = 1  # rows one sample trains as (tokens/s counts samples' clean tokens)


# DiffusionGemma 26B-A4B (configs/diffusion_gemma_26b_a4b_256k.yaml: the released model's shape, 25 sliding layers of
# window 1024 and 5 global ones with 2 K/V heads of 512, Gemma 4's MoE, self-conditioning 0.5, the AR co-loss) at
# DP1/EP2/CP8 -> DP1/EP2/CP8/BP8 (Turbo-dLLM's EP2 ranks read two samples: here 2 replicas of P = C = 8, EP2 carved
# from them); the vocabulary is the model's 262,144 rows (262,142 ids + EOD + MASK).
PAPER_GEMMA = PaperRow(
    "DiffusionGemma 26B-A4B", "diffusion_gemma_26b_a4b_256k",
    "25 sliding + 5 global layers, Gemma 4 MoE, self-conditioning 0.5", "DP1/EP2/CP8", dict(dp=2, ep=2), 8,
    (10557, 15359), (118.1, 113.6), ((65536, 1.25), (131072, 1.44), (262144, 1.45), (524288, 1.61)), 262142,
    "Turbo-dLLM runs DiffusionGemma as two model passes, a causal encoder over the clean rows and a decoder over the "
    "canvas reading the encoder's cache, each with its own ring (the published traffic fits the clean copy's K/V "
    "moving in both: 1.5x this trainer's both-copies gather under CP, 2x its clean gather under CSBP), and its "
    "self-conditioning pass is the decoder's alone; here one pass runs [x_t ; x_0] and the first, detached pass "
    "reruns it whole (its exchange too), K and V sent apart in the global layers (K = V is not exploited); the "
    "attention kernels' rates at head dims 256 and 512 (SM90_KERNELS cites 128) and the sliding layers' windowed "
    "kernels; the MoE's grouped GEMMs at the linear layers' rate, routing imbalance and DeepEP's transport; what the "
    "published runs hold beyond this trainer's (here the peak is a recomputed layer's working set, the tiled loss's "
    "and the sharded state)",
    traffic_gib=(433, 28))
# Qwen3.8-27B with Fast-dLLM v2 (configs/qwen3_8_27b_fast_dllm_v2_256k.yaml: the public Qwen3.5/3.6-27B shape, 48
# Gated DeltaNet + 16 gated full-attention layers) at DP1/TP2/CP8 -> DP1/TP2/CP8/BP8. Turbo-dLLM runs each sample as
# its two complementary views (a batch of 2 rows); the vocabulary is the model's 248,320 rows (248,318 ids + EOD +
# MASK), not the byte-level default's.
PAPER_QWEN = PaperRow(
    "Qwen3.8-27B", "qwen3_8_27b_fast_dllm_v2_256k",
    "Fast-dLLM v2, 48 Gated DeltaNet + 16 full-attention layers", "DP1/TP2/CP8", dict(dp=1, tp=2), 8, (2623, 3490),
    (120.7, 111.1), ((65536, 1.26), (131072, 1.30), (262144, 1.33)), 248318,
    "Turbo-dLLM's Gated DeltaNet layers run head-parallel (the projected q, k, v, z, beta, alpha rows all-to-all to "
    "heads and back: both copies under CP, the clean copy under CP/BP, then the block states routed), where the "
    "planner prices this trainer's state sends; the attention kernels' rates at head dim 256 (SM90_KERNELS cites "
    "head dim 128); fla's delta-rule kernels priced at the linear layers' rate; what the published CP run holds "
    "beyond CSBP (here both hold the same rows, and the peak is a recomputed Gated DeltaNet layer's working set)",
    views=2)


def paper_model(config: str, seq_length: int = PAPER_SEQ_LENGTH, **changes) -> Model:
    """The shipped config's model, as the paper's runs hold and compute it (`changes`: other `Model` fields)."""
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "configs" / f"{config}.yaml"
    model = _model(parse_args(["--config", str(path)]))
    return dataclasses.replace(model, **{**dict(
        seq_length=seq_length, block_size=PAPER_BLOCK_SIZE, recompute="full", bytes_per_elem=2, micro_batch_size=1,
        global_batch_size=None, transport=transports.COLLECTIVE, sharded_gradients=True,
        logits_tile_rows=PAPER_LOGITS_TILE_ROWS), **changes})


def _within(predicted: float, published: float) -> str:
    off = predicted / published - 1
    return f"{off:+.0%}" + ("" if abs(off) <= PAPER_TOLERANCE else " (outside ±10%)")


def paper_check(gpu: GPU, out=sys.stdout):
    """The planner at each published row's own layout, beside the published speedup and peak memory; returns
    the records. Baseline: the field's CP (`is_baseline`), one masked kernel per rank."""
    cluster = Cluster(16, 8, gpu)
    baseline = next(mode for mode in MODES if mode.is_baseline)
    print(f"paper check: 16 x {gpu.name}, 256K context, block {PAPER_BLOCK_SIZE}, full recompute, bf16, ZeRO-2, "
          f"tiled CE; each row at its published layout", file=out)
    records = []
    for name, config, (dp, p), (cp_tokens, csbp_tokens), (cp_peak, csbp_peak) in PAPER_ROWS:
        model = paper_model(config)
        cp = predict(model, cluster, Topology(baseline, 1, 1, p, p, dp))
        csbp = predict(model, cluster, Topology(modes.CSBP, 1, 1, p, p, dp))
        published, predicted = csbp_tokens / cp_tokens, csbp.tokens_per_s / cp.tokens_per_s
        record = {"model": name, "layout": f"DP{dp}/CP{p}", "published_speedup": published,
                  "predicted_speedup": predicted, "published_cp_tokens_per_s": cp_tokens,
                  "published_csbp_tokens_per_s": csbp_tokens, "predicted_cp_tokens_per_s": cp.tokens_per_s,
                  "predicted_csbp_tokens_per_s": csbp.tokens_per_s, "published_cp_peak_gib": cp_peak,
                  "published_csbp_peak_gib": csbp_peak, "predicted_cp_peak_gib": cp.memory_bytes / GIB,
                  "predicted_csbp_peak_gib": csbp.memory_bytes / GIB,
                  "predicted_cp_forward_s": cp.forward_s, "predicted_csbp_forward_s": csbp.forward_s,
                  "predicted_cp_backward_s": cp.step_time_s - cp.forward_s - cp.exposed_attention_s,
                  "predicted_csbp_backward_s": csbp.step_time_s - csbp.forward_s - csbp.exposed_attention_s,
                  "predicted_cp_exposed_s": cp.exposed_attention_s,
                  "predicted_csbp_exposed_s": csbp.exposed_attention_s,
                  "predicted_cp_step_s": cp.step_time_s, "predicted_csbp_step_s": csbp.step_time_s}
        records.append(record)
        print(f"  {name:<23} DP{dp}/CP{p}: speedup published {published:.2f}x, predicted {predicted:.3f}x "
              f"({_within(predicted, published)}); peak GiB published {cp_peak:.1f} -> {csbp_peak:.1f}, predicted "
              f"{record['predicted_cp_peak_gib']:.1f} ({_within(record['predicted_cp_peak_gib'], cp_peak)}) -> "
              f"{record['predicted_csbp_peak_gib']:.1f} ({_within(record['predicted_csbp_peak_gib'], csbp_peak)}); "
              f"step predicted {cp.step_time_s:.1f} -> {csbp.step_time_s:.1f} s", file=out)
    fourteen = records[-1]
    print("  14B operator profile, CP8 -> CSBP, published | predicted (s):", file=out)
    for key, label in (("forward_s", "forward"), ("backward_s", "backward (with the recomputed forward)"),
                       ("exposed_comm_s", "exposed attention communication")):
        (cp_s, csbp_s), short = PAPER_PROFILE_14B[key], key.split("_")[0]
        mine = (fourteen[f"predicted_cp_{short}_s"], fourteen[f"predicted_csbp_{short}_s"])
        fourteen[f"published_cp_{short}_s"], fourteen[f"published_csbp_{short}_s"] = cp_s, csbp_s
        print(f"    {label:<40} {cp_s:6.2f} -> {csbp_s:6.2f} (gain {cp_s - csbp_s:5.2f}) | "
              f"{mine[0]:6.2f} -> {mine[1]:6.2f} (gain {mine[0] - mine[1]:5.2f})", file=out)
    model = paper_model("nemotron_labs_diffusion_14b_256k")
    traffic = {mode: predict(model, cluster, Topology(mode, 1, 1, 8, 8, 2)).attention_gib
               for mode in (baseline, modes.CSBP)}
    print(f"  14B, CP8, 256K attention traffic per GPU per step: {traffic[baseline]:.2f} -> "
          f"{traffic[modes.CSBP]:.2f} GiB (published 210 -> 105)", file=out)
    records += [_paper_row(row, cluster, baseline, out) for row in (PAPER_GEMMA, PAPER_QWEN)]
    return records


def _paper_row(row: PaperRow, cluster: Cluster, baseline, out) -> dict:
    """One published row and its context-scaling curve, predicted beside the published; the unmodelled parts named
    where a number misses by more than ±10%."""
    predictions = {}
    for seq_length, _ in row.scaling:
        model = paper_model(row.config, seq_length, micro_batch_size=row.views, vocab_size=row.vocab_ids)
        predictions[seq_length] = [predict(model, cluster, Topology(mode, pp=1, p=row.ranks, c=row.ranks,
                                                                    **{"tp": 1, **row.layout}))
                                   for mode in (baseline, modes.CSBP)]
    cp, csbp = predictions[PAPER_SEQ_LENGTH]
    (cp_tokens, csbp_tokens), (cp_peak, csbp_peak) = row.tokens_per_s, row.peak_gib
    published, predicted = csbp_tokens / cp_tokens, csbp.tokens_per_s / cp.tokens_per_s
    record = {"model": row.name, "layout": row.label, "published_speedup": published, "predicted_speedup": predicted,
              "published_cp_tokens_per_s": cp_tokens, "published_csbp_tokens_per_s": csbp_tokens,
              "predicted_cp_tokens_per_s": cp.tokens_per_s / row.views,
              "predicted_csbp_tokens_per_s": csbp.tokens_per_s / row.views,
              "published_cp_peak_gib": cp_peak, "published_csbp_peak_gib": csbp_peak,
              "predicted_cp_peak_gib": cp.memory_bytes / GIB, "predicted_csbp_peak_gib": csbp.memory_bytes / GIB,
              "predicted_cp_traffic_gib": cp.attention_gib, "predicted_csbp_traffic_gib": csbp.attention_gib,
              "predicted_cp_step_s": cp.step_time_s, "predicted_csbp_step_s": csbp.step_time_s,
              "scaling": [{"seq_length": L, "published_speedup": speedup,
                           "predicted_speedup": predictions[L][1].tokens_per_s / predictions[L][0].tokens_per_s}
                          for L, speedup in row.scaling]}
    points = [(predicted, published), (record["predicted_cp_peak_gib"], cp_peak),
              (record["predicted_csbp_peak_gib"], csbp_peak)]
    points += [(point["predicted_speedup"], point["published_speedup"]) for point in record["scaling"]]
    traffic = ""
    if row.traffic_gib:
        (cp_traffic, csbp_traffic), (cp_gib, csbp_gib) = row.traffic_gib, (cp.attention_gib, csbp.attention_gib)
        record["published_cp_traffic_gib"], record["published_csbp_traffic_gib"] = row.traffic_gib
        points += [(cp_gib, cp_traffic), (csbp_gib, csbp_traffic)]
        traffic = (f"; attention traffic GiB per GPU per step published {cp_traffic} -> {csbp_traffic}, predicted "
                   f"{cp_gib:.2f} ({_within(cp_gib, cp_traffic)}) -> {csbp_gib:.2f} "
                   f"({_within(csbp_gib, csbp_traffic)})")
    print(f"  {row.name} ({row.described}) {row.label} -> {row.label}/BP{row.ranks}: tokens/s published {cp_tokens} "
          f"-> {csbp_tokens}, predicted {record['predicted_cp_tokens_per_s']:.0f} -> "
          f"{record['predicted_csbp_tokens_per_s']:.0f}; speedup published {published:.2f}x, predicted "
          f"{predicted:.3f}x ({_within(predicted, published)}); peak GiB published {cp_peak:.1f} -> {csbp_peak:.1f}, "
          f"predicted {record['predicted_cp_peak_gib']:.1f} ({_within(record['predicted_cp_peak_gib'], cp_peak)}) -> "
          f"{record['predicted_csbp_peak_gib']:.1f} ({_within(record['predicted_csbp_peak_gib'], csbp_peak)})"
          f"{traffic}; step predicted {cp.step_time_s:.1f} -> {csbp.step_time_s:.1f} s", file=out)
    print("    context scaling, speedup published | predicted: " + ", ".join(
        f"{point['seq_length'] // 1024}K {point['published_speedup']:.2f}x | {point['predicted_speedup']:.3f}x "
        f"({_within(point['predicted_speedup'], point['published_speedup'])})" for point in record["scaling"]),
        file=out)
    if any(abs(mine / theirs - 1) > PAPER_TOLERANCE for mine, theirs in points):
        print(f"    not modelled: {row.not_modelled}", file=out)
    return record


# --- command line -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_csbp.plan", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--config", help="YAML of Megatron flag names (either spelling); flags given here win")
    add("--num-layers", type=int)
    add("--hidden-size", type=int)
    add("--ffn-hidden-size", type=int)
    add("--num-attention-heads", type=int)
    add("--group-query-attention", action="store_true")
    add("--num-query-groups", type=int)
    add("--kv-channels", type=int)
    add("--vocab-size", type=int, default=131070,
        help="ids before EOD and MASK, as the trainer's --vocab-size (default: 131072 rows with both)")
    add("--swiglu", action="store_true")
    add("--untie-embeddings-and-output-weights", action="store_true")
    add("--seq-length", type=int, help="clean context length L")
    add("--bdlm-block-size", type=int)
    add("--micro-batch-size", type=int, default=1)
    add("--global-batch-size", type=int, help="default: one micro-batch per data-parallel replica")
    add("--recompute-granularity", choices=rules.RECOMPUTE_GRANULARITIES)
    add("--bf16", action="store_true")
    add("--fp16", action="store_true")
    add("--csbp-transport", choices=rules.TRANSPORTS, default=transports.COLLECTIVE.name)
    add("--bdlm-clean-attention", choices=CLEAN_ATTENTIONS, default=BLOCK_CAUSAL.name,
        help="what a clean row sees of the clean copy: its block (block-causal) or the tokens up to its own")
    add("--bdlm-ar-loss-weight", type=float, default=0.0,
        help="> 0: an autoregressive co-loss on the clean rows (the LM head runs over them too)")
    add("--cross-entropy-loss-fusion", action="store_true",
        help="the loss as the trainer's tiled linear cross-entropy (one tile's logits live, the head's forward twice)")
    add("--cross-entropy-tile-rows", type=int, default=rules.CROSS_ENTROPY_TILE_ROWS, help="rows per tile")
    add("--num-experts", type=int, help="experts per MoE layer (default: a dense model)")
    add("--moe-router-topk", type=int, default=2)
    add("--moe-ffn-hidden-size", type=int, help="each expert's FFN size (default: --ffn-hidden-size)")
    add("--moe-shared-expert-intermediate-size", type=int)
    add("--moe-layer-freq", type=moe_layer_freq, default=1, help="one MoE layer every N, or a 0/1 pattern per layer")
    add("--moe-router-dtype", choices=("fp32", "fp64"), help="the routing probabilities' dtype (default: the model's)")
    add("--experimental-attention-variant", choices=(GATED_DELTA_NET,),
        help="gated_delta_net: Gated DeltaNet layers beside the full-attention ones (--linear-attention-freq)")
    add("--linear-attention-freq", type=linear_attention_freq,
        help="every N-th layer full attention, the others Gated DeltaNet, or a 1 (Gated DeltaNet) / 0 pattern")
    for name in LINEAR_SIZES:
        add(f"--linear-{name.replace('_', '-')}", type=int, help="Gated DeltaNet's size (megatron-core's default)")
    add("--attention-output-gate", action="store_true", help="a sigmoid gate on each full-attention layer's output")
    add("--window-size", type=window_size, help="LEFT,0: sliding-window layers (megatron-core's)")
    add("--window-attn-skip-freq", type=window_attn_skip_freq, help="every N-th layer global, or a 1 (sliding) / 0 "
        "pattern")
    add("--gemma4-moe", action="store_true", help="Gemma 4's MoE block: a dense gated GELU-tanh MLP beside the experts")
    add("--gemma4-attention", action="store_true", help="Gemma 4's global layers with their own head size and K/V")
    add("--global-kv-channels", type=int, help="with --gemma4-attention: the global layers' head size")
    add("--global-num-query-groups", type=int, help="with --gemma4-attention: the global layers' K/V heads")
    add("--bdlm-objective", choices=objectives.OBJECTIVES, default=objectives.BD3LM.name,
        help="diffusion-gemma: self-conditioning's first, detached pass is priced")
    add("--bdlm-self-conditioning-probability", type=float, help="default: the objective's")
    add("--expert-model-parallel-size", type=int, default=1, help="your EP (its layout is printed)")
    add("--expert-tensor-parallel-size", type=int, help="your ETP (default: TP)")
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--context-block-parallel", type=int, help="your block-parallel size P (its traffic is printed)")
    add("--context-block-parallel-clean-shards", type=int, help="your C (default P)")
    add("--gpus", type=int, help="cluster size (default: TP·PP·P of your layout)")
    add("--gpus-per-node", type=int, default=8)
    add("--gpu", choices=sorted(GPU_PRESETS), default="h200")
    add("--gpu-tflops", type=float, help="override the preset's dense bf16 TFLOP/s")
    add("--achievable-fraction", type=float, help="override the preset's achievable fraction of peak")
    add("--hbm-gb", type=float, help="override the preset's HBM capacity (GB)")
    add("--nvlink-gb-s", type=float, help="override the preset's NVLink bus bandwidth (GB/s)")
    add("--internode-gb-s", type=float, help="override the preset's inter-node bandwidth per GPU (GB/s)")
    add("--top", type=int, default=5, help="how many layouts to print")
    add("--json", help="write the records to this file")
    add("--paper-check", action="store_true", help="compare with the paper's published figures and exit")
    return parser


def _yaml_defaults(path: str, parser: argparse.ArgumentParser) -> dict:
    """The YAML's values for the flags this planner knows, read as training reads it (sections included)."""
    from megatron_csbp.training.config import load_config

    known = {action.dest for action in parser._actions} - {"config", "json"}
    values = {flag.replace("-", "_"): value for flag, value in load_config(path).items()}
    return {dest: value for dest, value in values.items() if dest in known}


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**_yaml_defaults(pre.config, parser))
    args = parser.parse_args(argv)
    if args.paper_check:
        return args
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "bdlm_block_size"):
        if getattr(args, flag) is None:
            parser.error(f"--{flag.replace('_', '-')} is required (on the command line or in --config)")
    return args


def _gpu(args) -> GPU:
    overrides = {name: value for name, value in (
        ("bf16_tflops", args.gpu_tflops), ("achievable_fraction", args.achievable_fraction),
        ("hbm_gb", args.hbm_gb), ("nvlink_gb_s", args.nvlink_gb_s), ("internode_gb_s", args.internode_gb_s))
        if value is not None}
    return dataclasses.replace(GPU_PRESETS[args.gpu], **overrides)


def verdict(best: dict) -> list:
    """Short sentences comparing the best layout of each mode."""
    cp, csbp, bp = best[modes.CP], best[modes.CSBP], best[modes.BP]
    said = []
    if cp and csbp:
        said.append(f"CSBP {csbp.tokens_per_s / cp.tokens_per_s:.3f}x CP: at equal C it sends half the attention "
                    f"bytes; best layouts send {csbp.attention_gib:.2f} vs {cp.attention_gib:.2f} GiB per GPU per "
                    f"step, exposed {csbp.exposed_attention_s:.3f} vs {cp.exposed_attention_s:.3f} s of a "
                    f"{cp.step_time_s:.3f} s step")
    elif csbp:
        said.append("CP does not fit in memory; CSBP does (it keeps L gathered K/V tokens per layer, not 2L)")
    if bp is None:
        said.append("BP does not fit in memory: every rank holds and recomputes the whole clean sequence")
    elif csbp:
        said.append(f"BP {bp.tokens_per_s / csbp.tokens_per_s:.2f}x CSBP: no attention traffic but "
                    f"{bp.flops_per_rank / csbp.flops_per_rank:.2f}x the FLOPs per rank (replicated clean rows)")
    return said


def _model(args) -> Model:
    heads = args.num_attention_heads
    groups = args.num_query_groups or heads
    return Model(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                 seq_length=args.seq_length, block_size=args.bdlm_block_size, ffn_hidden_size=args.ffn_hidden_size,
                 num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, vocab_size=args.vocab_size,
                 swiglu=args.swiglu, untie_embeddings=args.untie_embeddings_and_output_weights,
                 recompute=args.recompute_granularity, bytes_per_elem=2 if (args.bf16 or args.fp16) else 4,
                 micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                 transport=args.csbp_transport, clean_attention=args.bdlm_clean_attention,
                 clean_logits=args.bdlm_ar_loss_weight > 0,
                 logits_tile_rows=args.cross_entropy_tile_rows if args.cross_entropy_loss_fusion else None,
                 num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                 moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                 moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                 moe_layer_freq=args.moe_layer_freq, moe_router_dtype=args.moe_router_dtype,
                 experimental_attention_variant=args.experimental_attention_variant,
                 linear_attention_freq=args.linear_attention_freq,
                 linear_sizes=tuple((name, getattr(args, "linear_" + name)) for name in LINEAR_SIZES
                                    if getattr(args, "linear_" + name) is not None),
                 attention_output_gate=args.attention_output_gate, window_size=args.window_size,
                 window_attn_skip_freq=args.window_attn_skip_freq,
                 gemma4_attention=(args.global_kv_channels or args.kv_channels or args.hidden_size // heads,
                                   args.global_num_query_groups or groups) if args.gemma4_attention else (),
                 gemma4_moe=args.gemma4_moe,
                 self_conditioning=_self_conditioning(args))


def _self_conditioning(args) -> float:
    """The chance of self-conditioning's first pass: the flag's, else the objective's (0 without its block)."""
    objective = objectives.objective_kind(args.bdlm_objective)
    if not objective.self_conditioning_probability:
        return 0.0
    given = args.bdlm_self_conditioning_probability
    return objective.self_conditioning_probability if given is None else given


def _print_setting(model: Model, cluster: Cluster, out):
    gpu = cluster.gpu
    print(f"model: {model.num_layers} layers, hidden {model.hidden_size}, ffn {model.ffn_hidden_size}, "
          f"{model.num_attention_heads} heads / {model.num_query_groups} KV groups x {model.kv_channels}, "
          f"vocab {model.vocab_size} ids + EOD + MASK, L = {model.seq_length}, B = {model.block_size}, "
          f"recompute {model.recompute or 'none'}, {'bf16' if model.bytes_per_elem == 2 else 'fp32'}, "
          f"micro-batch {model.micro_batch_size}, {model.transport} transport, {model.clean_attention} clean rows"
          f"{', LM head over the clean rows too (AR co-loss)' if model.clean_logits else ''}"
          f"{f', tiled linear cross-entropy ({model.logits_tile_rows} rows a tile)' if model.logits_tile_rows else ''}"
          f"{'' if model.bytes_per_elem == 2 else ' (FLOP rate is still the bf16 peak)'}", file=out)
    if model.moe:
        moe = model.moe
        print(f"experts: {moe.num_experts} per MoE layer in {moe.num_moe_layers} of {model.num_layers} layers, top-"
              f"{moe.topk}, expert ffn {moe.ffn_hidden_size}, shared expert ffn {moe.shared_expert_ffn_hidden_size}; "
              f"alltoall dispatcher, every row (noisy and clean) routed, uniform routing assumed", file=out)
    linear = model.shape.linear
    if linear is not None:
        print(f"Gated DeltaNet: {linear.num_linear_layers} of {model.num_layers} layers, {linear.num_key_heads} QK / "
              f"{linear.num_value_heads} V heads of {linear.key_head_dim} / {linear.value_head_dim}, convolution "
              f"{linear.conv_kernel_dim}; no K/V in them, the clean states travel"
              f"{'; full-attention layers output-gated' if model.attention_output_gate else ''}", file=out)
    print(f"cluster: {cluster.gpus} x {gpu.name} ({cluster.gpus_per_node} per node), {gpu.bf16_tflops:g} TFLOP/s "
          f"x {gpu.achievable_fraction:g}, {gpu.hbm_gb:g} GB HBM ({gpu.usable_memory_fraction:.0%} usable), "
          f"NVLink {gpu.nvlink_gb_s:g} GB/s, inter-node {gpu.internode_gb_s:g} GB/s", file=out)


def _print_requested(model: Model, cluster: Cluster, tp: int, pp: int, p: int, c: int, out, ep: int = 1,
                     etp: int = None) -> list:
    experts = f" EP{ep}" + (f" ETP{etp}" if etp else "") if model.moe else ""
    print(f"\nattention traffic per GPU per step, your layout (TP{tp} PP{pp} P{p} C{c}{experts}):", file=out)
    records, baseline = [], None
    for topo in requested_topologies(model, cluster, tp, pp, p, c, ep, etp):
        problem = topology_problem(model, cluster, topo)
        if problem:
            print(f"  {topo.mode.name:<4}  invalid: {problem}", file=out)
            continue
        pred = predict(model, cluster, topo)
        baseline = pred if topo.mode.is_baseline else baseline
        pred.reason = _reason(pred, baseline)
        print(f"  {topo.mode.name:<4} {pred.attention_gib:8.2f} GiB   step {pred.step_time_s:8.3f} s   "
              f"{pred.tokens_per_s:9.0f} tok/s   {pred.reason}", file=out)
        records.append({**pred.record(), "requested": True})
        if topo.mode is modes.CSBP:
            _print_logits(model, cluster, topo, out)
    return records


def _print_logits(model: Model, cluster: Cluster, topo: Topology, out):
    """The LM head's logits per GPU in `topo`, whole and as the tiled linear cross-entropy, and the memory of each."""
    tile = model.logits_tile_rows or rules.CROSS_ENTROPY_TILE_ROWS
    whole, tiled = (predict(dataclasses.replace(model, logits_tile_rows=rows), cluster, topo) for rows in (None, tile))
    print(f"       LM head logits per GPU: {whole.logits_bytes / GIB:.2f} GiB whole (memory "
          f"{whole.memory_bytes / GIB:.1f} GiB), {tiled.logits_bytes / GIB:.3f} GiB in tiles of {tile} rows "
          f"(--cross-entropy-loss-fusion; memory {tiled.memory_bytes / GIB:.1f} GiB, step {tiled.step_time_s:.3f} s)",
          file=out)


def _print_plan(preds: list, top: int, out):
    print(f"\nbest layouts of {len(preds)} valid ({sum(q.fits for q in preds)} fit in memory):", file=out)
    experts = any(q.expert_params_per_rank for q in preds)  # MoE columns: all-to-all, state per rank
    moe_header = f" {'a2a GiB':>8} {'state GiB':>9}" if experts else ""
    print(f"  {'layout':<38} {'step s':>8} {'tok/s':>9} {'attn GiB':>9}{moe_header} {'mem GiB':>8}  why", file=out)
    for q in preds[:top]:
        moe = f" {q.all_to_all_bytes / GIB:8.2f} {q.state_bytes / GIB:9.2f}" if experts else ""
        print(f"  {q.topology.label():<38} {q.step_time_s:8.3f} {q.tokens_per_s:9.0f} {q.attention_gib:9.2f}{moe} "
              f"{q.memory_bytes / GIB:8.1f}  {q.reason}", file=out)
    print("best per mode (attention traffic per GPU per step):", file=out)
    best = best_by_mode(preds)
    for mode, q in best.items():
        if q is None:
            least = min((r.memory_bytes for r in preds if r.topology.mode == mode), default=None)
            need = f" (needs at least {least / GIB:.1f} GiB)" if least else ""
            print(f"  {mode.name:<4} does not fit in memory in any layout{need}", file=out)
        else:
            print(f"  {mode.name:<4} {q.attention_gib:8.2f} GiB   {q.topology.label()}   {q.tokens_per_s:9.0f} tok/s",
                  file=out)
    for sentence in verdict(best):
        print(f"  {sentence}", file=out)


def main(argv=None, out=sys.stdout) -> list:
    """Runs the planner; returns the records it printed (and wrote with `--json`)."""
    args = parse_args(argv)
    gpu = _gpu(args)
    if args.paper_check:
        records = paper_check(gpu, out)
    else:
        model = _model(args)
        tp, pp, p = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_block_parallel
        cluster = Cluster(args.gpus or tp * pp * (p or 1), args.gpus_per_node, gpu)
        _print_setting(model, cluster, out)
        records = []
        if p is not None:
            records += _print_requested(model, cluster, tp, pp, p, args.context_block_parallel_clean_shards or p, out,
                                        args.expert_model_parallel_size, args.expert_tensor_parallel_size)
        preds = plan(model, cluster)
        if preds:
            _print_plan(preds, args.top, out)
        else:
            print(f"\nno valid layout of {cluster.gpus} GPUs for this model", file=out)
        records += [{**q.record(), "requested": False} for q in preds]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as stream:
            json.dump(records, stream, indent=1)
    return records


def command(argv=None) -> None:
    """`python -m megatron_csbp.plan`: a refusal (e.g. a --config it cannot read) is one line,
    exit 2, as at every entry of ours."""
    from megatron_csbp.core.rules import ConfigError

    try:
        main(argv)
    except ConfigError as error:
        print(f"python -m megatron_csbp.plan: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    command()
