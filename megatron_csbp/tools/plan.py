"""Topology planner: an analytic model of one BDLM training step for CP, CSBP and pure BP.

`python -m megatron_csbp.plan --num-layers 40 --hidden-size 5120 ... --gpus 16 --gpu h200`
scores every valid (mode, TP, PP, block-parallel P, clean shards C, DP) layout of the cluster and
prints the best few with a reason each, the attention traffic per GPU per step of the requested
layout, and (`--json FILE`) the same as records. `--paper-check` compares with the paper's figures.

The model, in one place so it can be argued with:
* compute: exact per-rank FLOPs (`flops.py` rules; CP and CSBP work is balanced by their zigzag and
  dual-end layouts, BP replicates the clean rows), the linear layers and LM head at
  `peak × achievable_fraction`, the attention pairs at `peak × attention_fraction` (the CP baseline's at
  `cp_attention_fraction`: its kernel may be less efficient on the BDLM mask);
* attention traffic: docs/algorithm.md §9, on NVLink when a ring stays inside a node, else on the
  inter-node network (rank order tp-cp-dp-pp, as Megatron), each collective `link_latency_us` plus
  bytes / bandwidth; the gather hides behind the local noisy→noisy attention and the dK/dV
  reduce-scatter behind the local noisy backward, for CSBP and for our CP baseline alike (ops.py runs
  both through the same op; CP moves twice the bytes behind the same local work). Recompute of the
  core attention (full or selective) runs the gather and the attention a second time;
* TP (sequence parallel: 4 all-gather/reduce-scatter per layer per pass) and PP point-to-point are
  exposed; the distributed optimizer's gradient reduce-scatter and parameter all-gather over the
  DP×P group hide behind one micro-batch of compute; the 1F1B bubble is `(PP-1)` micro-batch times;
* memory: bf16 weights, fp32 main grads, fp32 master weights and Adam moments sharded over DP×P
  (distributed optimizer); activations with sequence parallelism: every layer's saved tensors and
  gathered K/V (selective or no recompute; flash kernels keep no `L²` scores), or each layer's input
  plus the larger of one layer's working set and the noisy rows' logits with their fp32 copy
  (full recompute; the loss's backward frees the logits before any layer's backward runs).
Everything is per GPU per step; one micro-batch per DP replica unless `--global-batch-size` is set.
"""

import argparse
import dataclasses
import json
import sys

import yaml

from megatron_csbp.bdlm import flops
from megatron_csbp.core import modes, rules, transports
from megatron_csbp.core.run_config import RunConfig

GIB = 2 ** 30
MODES = tuple(sorted(rules.PARALLEL_MODES, key=lambda name: not modes.parallel_mode(name).is_baseline))  # baseline first


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
    attention_fraction: float = None     # attention kernel's fraction of peak (default: achievable_fraction)
    cp_attention_fraction: float = None  # the CP baseline's kernel (default: attention_fraction)
    link_latency_us: float = 0.0         # per collective

    def rates(self, mode: str) -> tuple[float, float]:
        """(linear, attention) FLOP/s of `mode`."""
        peak = self.bf16_tflops * 1e12
        attention = self.attention_fraction or self.achievable_fraction
        if modes.parallel_mode(mode).is_baseline and self.cp_attention_fraction:
            attention = self.cp_attention_fraction
        return peak * self.achievable_fraction, peak * attention


# Dense bf16 peak from the data sheets; 45% of it is a typical Megatron dense-model figure;
# ~360 GB/s all-gather bus bandwidth over NVLink 4 and ~45 GB/s per GPU over 400 Gb/s NDR InfiniBand
# are typical nccl-tests values. Chosen before any comparison with the paper, not fitted to it.
GPU_PRESETS = {
    "h100": GPU("h100", bf16_tflops=989.0, achievable_fraction=0.45, hbm_gb=80.0,
                nvlink_gb_s=360.0, internode_gb_s=45.0),
    "h200": GPU("h200", bf16_tflops=989.0, achievable_fraction=0.45, hbm_gb=141.0,
                nvlink_gb_s=360.0, internode_gb_s=45.0),
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
    transport: str = "collective"

    def __post_init__(self):
        fill = lambda name, value: object.__setattr__(self, name, value)
        if self.ffn_hidden_size is None:
            fill("ffn_hidden_size", rules.default_ffn_hidden_size(self.hidden_size, self.swiglu))
        if self.num_query_groups is None:
            fill("num_query_groups", self.num_attention_heads)
        problems = [rules.whole_blocks_problem(self.seq_length, self.block_size),
                    rules.query_groups_problem(self.num_attention_heads, self.num_query_groups),
                    rules.kv_channels_problem(self.hidden_size, self.num_attention_heads)
                    if self.kv_channels is None else None,
                    rules.choice_problem("--recompute-granularity", self.recompute, rules.RECOMPUTE_GRANULARITIES)
                    if self.recompute is not None else None,
                    rules.choice_problem("--csbp-transport", self.transport, rules.TRANSPORTS)]
        rules.refuse(next(filter(None, problems), None))
        if self.kv_channels is None:
            fill("kv_channels", self.hidden_size // self.num_attention_heads)

    @property
    def num_blocks(self) -> int:
        return self.seq_length // self.block_size

    @property
    def full_recompute(self) -> bool:
        return self.recompute == "full"

    def padded_vocab_size(self, tp: int) -> int:
        """The model's rows as the trainer pads them: the ids, EOD and MASK, to Megatron's default multiple
        (`--make-vocab-size-divisible-by` x TP)."""
        return rules.padded_vocab_size(self.vocab_size + 2, rules.MAKE_VOCAB_SIZE_DIVISIBLE_BY, tp)

    def layer_params(self) -> int:
        """One layer's parameters as the trainer counts them (`flops.layer_parameter_count`), for the planner's
        models: RMSNorm, no linear biases."""
        return flops.layer_parameter_count(
            hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size, num_query_groups=self.num_query_groups,
            kv_channels=self.kv_channels, swiglu=self.swiglu, add_bias_linear=False, layernorm_bias=False)


@dataclasses.dataclass(frozen=True)
class Topology:
    """One layout: `p` ranks share a sequence (Megatron's CP slot); CP uses `c == p`, BP `c == 1`."""
    mode: str
    tp: int
    pp: int
    p: int
    c: int
    dp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.p * self.dp

    def label(self) -> str:
        return f"{self.mode:<4} TP{self.tp} PP{self.pp} P{self.p} C{self.c} DP{self.dp}"


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
    return RunConfig(num_layers=model.num_layers, hidden_size=model.hidden_size,
                     num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
                     kv_channels=model.kv_channels, seq_length=model.seq_length, block_size=model.block_size,
                     mode=topo.mode, block_parallel_size=topo.p, clean_shards=topo.c, transport=model.transport,
                     tensor_parallel_size=topo.tp, pipeline_parallel_size=topo.pp, world_size=cluster.gpus,
                     micro_batch_size=model.micro_batch_size, global_batch_size=model.global_batch_size)


def candidate_topologies(cluster: Cluster):
    """Every (mode, TP, PP, P, C, DP) that multiplies to the cluster size, valid or not: CP and pure BP at every
    P, CSBP at every C > 1 dividing P (CSBP with C = 1 is pure BP, and at P = 1 all three are the same run)."""
    n = cluster.gpus
    for tp in _divisors(n):
        for pp in _divisors(n // tp):
            for p in _divisors(n // (tp * pp)):
                dp = n // (tp * pp * p)
                for mode in MODES:
                    for c in modes.parallel_mode(mode).clean_shard_choices(p):
                        yield Topology(mode, tp, pp, p, c, dp)


def valid_topologies(model: Model, cluster: Cluster):
    return [t for t in candidate_topologies(cluster) if topology_problem(model, cluster, t) is None]


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
    state_bytes: float
    memory_bytes: float
    memory_limit_bytes: float
    compute_s: float
    exposed_attention_s: float
    exposed_other_comm_s: float
    bubble_s: float
    step_time_s: float
    tokens_per_s: float
    reason: str = ""

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit_bytes

    @property
    def attention_gib(self) -> float:
        return self.attention_bytes / GIB

    def record(self) -> dict:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "topology"}
        return {**dataclasses.asdict(self.topology), **fields, "fits": self.fits,
                "attention_traffic_gib_per_step": round(self.attention_gib, 2)}


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
    rate, attention_rate = gpu.rates(mode)

    parallel_mode = modes.parallel_mode(mode)
    noisy_rows, clean_rows = parallel_mode.rows(L, p, c)
    pairs, local_pairs = parallel_mode.attention_pairs(flops.bdlm_attention_pair_parts(L, model.block_size), p, c)
    rows = noisy_rows + clean_rows
    heads_tp = model.num_attention_heads // tp
    groups = model.num_query_groups
    kv_heads_tp = groups // tp
    vocab = model.padded_vocab_size(tp)
    layers = model.num_layers // pp
    passes = rules.step_passes(model.full_recompute)
    attention_passes = rules.step_passes(model.recompute)  # selective recompute redoes the core attention
    head_passes = rules.step_passes()

    per_pair = flops.attention_flops_per_pair(heads_tp, model.kv_channels)
    linear_forward = rows * flops.linear_flops_per_row(h, model.ffn_hidden_size, model.num_attention_heads,
                                                       groups, model.kv_channels, model.swiglu) / tp
    attention_forward = pairs * per_pair
    head_forward = noisy_rows * flops.lm_head_flops_per_row(h, vocab) / tp
    microbatch_flops = mbs * (layers * (passes * linear_forward + attention_passes * attention_forward)
                              + head_passes * head_forward)
    compute_s = mbs * (layers * (passes * linear_forward / rate + attention_passes * attention_forward
                                 / attention_rate) + head_passes * head_forward / rate)

    # Attention traffic of one layer, forward (gather) and backward parts, on the ring's link.
    crossings = _ring_crossings(cluster, topo)
    ring_bw = (gpu.internode_gb_s if crossings else gpu.nvlink_gb_s) * 1e9
    forward_runs = 2 if model.recompute else 1
    layer_bytes = mbs * flops.attention_traffic_bytes(
        mode, L, c, kv_heads_tp, model.kv_channels, e, model.transport, forward_runs == 2)
    forward_bytes = mbs * flops.attention_forward_bytes(mode, L, c, kv_heads_tp, model.kv_channels, e)
    backward_bytes = layer_bytes - forward_bytes * forward_runs
    transport = transports.transport(model.transport)
    latency = gpu.link_latency_us * 1e-6 if c > 1 else 0.0
    forward_link_s = transport.forward_messages(c) * latency + forward_bytes / ring_bw
    backward_link_s = transport.backward_messages(c) * latency + backward_bytes / ring_bw
    hide_forward = mbs * (pairs if transport.hides_behind_all_pairs else local_pairs) * per_pair / attention_rate
    exposed_layer = (forward_runs * max(0.0, forward_link_s - hide_forward)
                     + max(0.0, backward_link_s - 2 * hide_forward)) if c > 1 else 0.0
    exposed_attention_s = layers * exposed_layer
    attention_bytes = microbatches * layers * layer_bytes
    inter_fraction = crossings / c if c > 1 else 0.0

    # Tensor parallel (sequence parallel: 2 all-gathers + 2 reduce-scatters per pass) and PP p2p.
    forward_passes = 2 if model.full_recompute else 1
    tp_bytes = layers * 4 * (forward_passes + 1) * (tp - 1) / tp * rows * h * e * mbs
    pp_bytes = 2 * rows * h * e * mbs / tp if pp > 1 else 0.0
    pp_bw = gpu.internode_gb_s if _spans_nodes(cluster, [0, tp * p * dp]) else gpu.nvlink_gb_s
    tp_pp_s = tp_bytes / (gpu.nvlink_gb_s * 1e9) + pp_bytes / (pp_bw * 1e9)

    # Distributed optimizer over the DP×P group: fp32 grad reduce-scatter + bf16 param all-gather.
    embeddings = 2 if pp == 1 and model.untie_embeddings else 1
    stage_params = (layers * model.layer_params() + embeddings * vocab * h) / tp
    group = dp * p
    dp_bytes = stage_params * (group - 1) / group * (4 + e)
    dp_ranks = [tp * i for i in range(group)]
    dp_bw = gpu.internode_gb_s if _spans_nodes(cluster, dp_ranks) else gpu.nvlink_gb_s
    exposed_dp_s = max(0.0, dp_bytes / (dp_bw * 1e9) - compute_s)

    microbatch_s = compute_s + exposed_attention_s + tp_pp_s
    bubble_s = (pp - 1) * microbatch_s
    step_time_s = microbatches * microbatch_s + bubble_s + exposed_dp_s

    # Memory of the worst stage.
    query, kv = model.num_attention_heads * model.kv_channels, groups * model.kv_channels
    ffn_saved = model.ffn_hidden_size * (3 if model.swiglu else 2)
    row_bytes = e * (4 * h + query + 2 * kv + query + ffn_saved) / tp + 4 * heads_tp
    kv_buffer = parallel_mode.gathered_tokens(L, c) * flops.kv_bytes_per_token(kv_heads_tp, model.kv_channels, e)
    working_layer = mbs * (rows * row_bytes + kv_buffer)
    layer_stored = mbs * rows * h * e / tp if model.full_recompute else working_layer
    recompute_working = working_layer if model.full_recompute else 0.0
    # The CE keeps an fp32 copy of the logits until its backward, which runs before any layer's.
    logits = mbs * noisy_rows * vocab / tp * (e + 4)
    last_stage = layer_stored * layers + max(logits, recompute_working)
    first_stage = layer_stored * layers * min(pp, microbatches) + recompute_working
    activation_bytes = max(last_stage, first_stage) if pp > 1 else last_stage
    state_bytes = stage_params * ((e + 4 + 12 / group) if e == 2 else (8 + 8 / group))
    memory_limit = gpu.hbm_gb * 1e9 * gpu.usable_memory_fraction

    return Prediction(
        topology=topo, noisy_rows=noisy_rows, clean_rows=clean_rows,
        flops_per_rank=microbatches * microbatch_flops, attention_bytes=attention_bytes,
        ring_link="none" if c == 1 else ("inter-node" if crossings else "NVLink"),
        bytes_intra_node=attention_bytes * (1 - inter_fraction), bytes_inter_node=attention_bytes * inter_fraction,
        activation_bytes=activation_bytes, state_bytes=state_bytes,
        memory_bytes=activation_bytes + state_bytes, memory_limit_bytes=memory_limit,
        compute_s=microbatches * compute_s, exposed_attention_s=microbatches * exposed_attention_s,
        exposed_other_comm_s=microbatches * tp_pp_s + exposed_dp_s, bubble_s=bubble_s,
        step_time_s=step_time_s, tokens_per_s=global_batch * L / step_time_s)


def _reason(pred: Prediction, baseline: Prediction = None) -> str:
    """`baseline`: the baseline mode's prediction at the same TP, PP, C and replicas, if valid."""
    topo, said = pred.topology, []
    mode = modes.parallel_mode(topo.mode)
    if mode.compared_with_baseline and baseline is not None:
        said.append(f"sends {pred.attention_gib:.2f} GiB vs {baseline.topology.mode.upper()}{topo.c}'s "
                    f"{baseline.attention_gib:.2f}")
    said += mode.traits(topo.p, topo.c)
    if pred.ring_link != "none":
        said.append("ring inside a node" if pred.ring_link == "NVLink" else "ring crosses nodes")
    exposed = pred.exposed_attention_s + pred.exposed_other_comm_s
    said.append(f"comm exposed {100 * exposed / pred.step_time_s:.1f}% of the step")
    if pred.bubble_s:
        said.append(f"PP bubble {100 * pred.bubble_s / pred.step_time_s:.0f}%")
    mem = f"{pred.memory_bytes / GIB:.1f} of {pred.memory_limit_bytes / GIB:.1f} GiB"
    said.append(f"fits ({mem})" if pred.fits else f"does NOT fit ({mem})")
    return "; ".join(said)


def plan(model: Model, cluster: Cluster):
    """Predictions for every valid layout, fitting ones first, fastest first, each with its reason."""
    preds = [predict(model, cluster, t) for t in valid_topologies(model, cluster)]
    baseline_by_key = {(q.topology.tp, q.topology.pp, q.topology.c, q.topology.dp * q.topology.p // q.topology.c): q
                       for q in preds if modes.parallel_mode(q.topology.mode).is_baseline}
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


def requested_topologies(model: Model, cluster: Cluster, tp: int, pp: int, p: int, c: int):
    """The user's layout in each mode: CP over the same P ranks, CSBP (P, C), BP (P, 1)."""
    rules.refuse(rules.world_size_problem(tp, pp, p, cluster.gpus))
    dp = cluster.gpus // (tp * pp * p)
    return [Topology(mode, tp, pp, p, rules.clean_shards(mode, p, c), dp) for mode in MODES]


# The paper's 16×H200, 256K settings (docs/algorithm.md §11). The 14B's 40 layers, 8 KV heads and head
# dim 128 are the paper's; the other sizes are ASSUMED (Ministral-3-like shapes of the stated sizes,
# SwiGLU, 131072 vocab, block 32), since the paper's summary does not give them.
PAPER_SETTINGS = [
    ("Nemotron-Diffusion 3B", dict(num_layers=26, hidden_size=3072, ffn_hidden_size=9216, num_attention_heads=32,
                                   num_query_groups=8, kv_channels=128), 13434, 16027),
    ("Nemotron-Diffusion 8B", dict(num_layers=34, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                                   num_query_groups=8, kv_channels=128), 9668, 11379),
    ("Nemotron-Diffusion 14B", dict(num_layers=40, hidden_size=5120, ffn_hidden_size=16384, num_attention_heads=32,
                                    num_query_groups=8, kv_channels=128), 7884, 9301),
]
PAPER_SPEEDUP_RANGE = (1.18, 1.61)


def paper_check(gpu: GPU, out=sys.stdout):
    """Predicted best-CSBP / best-CP speedups beside the published ones; returns the records.

    `traffic bound` is the speedup CP would get if its attention traffic cost nothing at all: the
    most that halving it can buy under this model.
    """
    cluster = Cluster(16, 8, gpu)
    records = []
    print(f"paper check: 16 x {gpu.name}, 256K context, full recompute, bf16 "
          "(DiffusionGemma 26B-A4B MoE and Qwen3.8-27B skipped: MoE and that model are not modelled)", file=out)
    for name, shape, cp_tokens, csbp_tokens in PAPER_SETTINGS:
        model = Model(seq_length=262144, block_size=32, swiglu=True, recompute="full", **shape)
        best = best_by_mode(plan(model, cluster))
        cp, csbp = best["cp"], best["csbp"]
        published = csbp_tokens / cp_tokens
        predicted = csbp.tokens_per_s / cp.tokens_per_s
        bound = cp.step_time_s / (cp.step_time_s - cp.exposed_attention_s)
        print(f"  {name:<23} published {cp_tokens:>6} -> {csbp_tokens:>6} tok/s ({published:.2f}x) | "
              f"predicted {cp.tokens_per_s:>6.0f} -> {csbp.tokens_per_s:>6.0f} tok/s ({predicted:.3f}x, "
              f"off by {predicted - published:+.2f}x; traffic bound {bound:.3f}x) | "
              f"best {cp.topology.label()} vs {csbp.topology.label()}", file=out)
        records.append({"model": name, "published_speedup": published, "predicted_speedup": predicted,
                        "traffic_bound_speedup": bound,
                        "published_cp_tokens_per_s": cp_tokens, "published_csbp_tokens_per_s": csbp_tokens,
                        "predicted_cp_tokens_per_s": cp.tokens_per_s,
                        "predicted_csbp_tokens_per_s": csbp.tokens_per_s,
                        "best_cp": cp.topology.label(), "best_csbp": csbp.topology.label()})
    lo, hi = PAPER_SPEEDUP_RANGE
    inside = sum(lo <= r["predicted_speedup"] <= hi for r in records)
    print(f"  {inside} of {len(records)} predicted speedups inside the published {lo:.2f}-{hi:.2f}x range",
          file=out)
    fourteen = Model(seq_length=262144, block_size=32, swiglu=True, recompute="full", **PAPER_SETTINGS[2][1])
    traffic = {t.mode: predict(fourteen, cluster, t).attention_gib
               for t in requested_topologies(fourteen, cluster, 1, 1, 8, 8)[:2]}
    print(f"  14B, CP8, 256K attention traffic per GPU per step: {traffic['cp']:.2f} -> {traffic['csbp']:.2f} GiB "
          "(published 210 -> 105)", file=out)
    trend = []
    for seq_length in (65536, 131072, 262144, 524288):
        best = best_by_mode(plan(dataclasses.replace(fourteen, seq_length=seq_length), cluster))
        if best["cp"] and best["csbp"]:
            trend.append(f"{seq_length // 1024}K {best['csbp'].tokens_per_s / best['cp'].tokens_per_s:.3f}x")
    print(f"  14B predicted speedup by context: {', '.join(trend)} (published DiffusionGemma: 1.25x at 64K -> "
          "1.61x at 512K)", file=out)
    target = PAPER_SPEEDUP_RANGE[0]
    print(f"  what would have to change to reach {target:.2f}x at 256K (one term at a time):", file=out)
    for (name, shape, _, _), record in zip(PAPER_SETTINGS, records):
        model = Model(seq_length=262144, block_size=32, swiglu=True, recompute="full", **shape)
        gap = paper_gap(model, cluster, target)
        record.update(gap)
        print(f"    {name:<23} CP's masked attention kernel at {gap['cp_kernel_efficiency']:.0%} of CSBP's efficiency; "
              f"or every link x{gap['link_scale']:.3f} (CP's exposed attention comm {gap['cp_exposed_needed_s']:.1f} s "
              f"instead of {gap['cp_exposed_s']:.2f} s of its {gap['cp_step_s']:.1f} s step); memory "
              f"{'does not force' if gap['cp_fits_at_csbp_layout'] else 'forces'} CP off CSBP's layout", file=out)
    return records


def _speedup(model: Model, cluster: Cluster) -> float:
    best = best_by_mode(plan(model, cluster))
    if best["cp"] is None:
        return float("inf")
    return best["csbp"].tokens_per_s / best["cp"].tokens_per_s


def _solve(speedup_at, target: float, low: float, high: float, steps: int = 30) -> float:
    """The least `x` in [low, high] (geometric bisection) with `speedup_at(x) >= target`, for a speedup that
    grows with `x`; NaN when even `high` falls short."""
    if speedup_at(low) >= target:
        return low
    if speedup_at(high) < target:
        return float("nan")
    for _ in range(steps):
        middle = (low * high) ** 0.5
        low, high = (low, middle) if speedup_at(middle) >= target else (middle, high)
    return high


def paper_gap(model: Model, cluster: Cluster, target: float) -> dict:
    """How far each term of the model would have to move for the best CSBP / best CP to reach `target`:
    * `cp_kernel_efficiency`: the CP baseline's attention kernel at this fraction of CSBP's efficiency;
    * `link_scale`: every link (NVLink and inter-node) at this fraction of its bandwidth;
    * the exposed attention communication CP would then show, beside what the model predicts;
    * memory: whether CP's best layout is forced by memory (it is when CSBP's best does not fit as CP)."""
    gpu = cluster.gpu
    attention = gpu.attention_fraction or gpu.achievable_fraction
    with_cp_kernel = lambda k: dataclasses.replace(cluster, gpu=dataclasses.replace(gpu, cp_attention_fraction=k * attention))
    with_links = lambda f: dataclasses.replace(cluster, gpu=dataclasses.replace(
        gpu, nvlink_gb_s=gpu.nvlink_gb_s * f, internode_gb_s=gpu.internode_gb_s * f))
    kernel = _solve(lambda k: _speedup(model, with_cp_kernel(1 / k)), target, 1.0, 100.0)
    links = _solve(lambda f: _speedup(model, with_links(1 / f)), target, 1.0, 1e5)
    best = best_by_mode(plan(model, cluster))
    slow = best_by_mode(plan(model, with_links(1 / links))) if links == links else None
    same_layout_cp = dataclasses.replace(best["csbp"].topology, mode="cp", c=best["csbp"].topology.p)
    cp_there = predict(model, cluster, same_layout_cp) if topology_problem(model, cluster, same_layout_cp) is None \
        else None
    return {"cp_kernel_efficiency": 1 / kernel, "link_scale": 1 / links,
            "cp_exposed_s": best["cp"].exposed_attention_s, "cp_step_s": best["cp"].step_time_s,
            "cp_exposed_needed_s": slow["cp"].exposed_attention_s if slow and slow["cp"] else float("nan"),
            "cp_fits_at_csbp_layout": bool(cp_there and cp_there.fits)}


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
    add("--csbp-transport", choices=rules.TRANSPORTS, default="collective")
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
    cp, csbp, bp = best["cp"], best["csbp"], best["bp"]
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
    return Model(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                 seq_length=args.seq_length, block_size=args.bdlm_block_size, ffn_hidden_size=args.ffn_hidden_size,
                 num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, vocab_size=args.vocab_size,
                 swiglu=args.swiglu, untie_embeddings=args.untie_embeddings_and_output_weights,
                 recompute=args.recompute_granularity, bytes_per_elem=2 if (args.bf16 or args.fp16) else 4,
                 micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                 transport=args.csbp_transport)


def _print_setting(model: Model, cluster: Cluster, out):
    gpu = cluster.gpu
    print(f"model: {model.num_layers} layers, hidden {model.hidden_size}, ffn {model.ffn_hidden_size}, "
          f"{model.num_attention_heads} heads / {model.num_query_groups} KV groups x {model.kv_channels}, "
          f"vocab {model.vocab_size} ids + EOD + MASK, L = {model.seq_length}, B = {model.block_size}, "
          f"recompute {model.recompute or 'none'}, {'bf16' if model.bytes_per_elem == 2 else 'fp32'}, "
          f"micro-batch {model.micro_batch_size}, {model.transport} transport"
          f"{'' if model.bytes_per_elem == 2 else ' (FLOP rate is still the bf16 peak)'}", file=out)
    print(f"cluster: {cluster.gpus} x {gpu.name} ({cluster.gpus_per_node} per node), {gpu.bf16_tflops:g} TFLOP/s "
          f"x {gpu.achievable_fraction:g}, {gpu.hbm_gb:g} GB HBM ({gpu.usable_memory_fraction:.0%} usable), "
          f"NVLink {gpu.nvlink_gb_s:g} GB/s, inter-node {gpu.internode_gb_s:g} GB/s", file=out)


def _print_requested(model: Model, cluster: Cluster, tp: int, pp: int, p: int, c: int, out) -> list:
    print(f"\nattention traffic per GPU per step, your layout (TP{tp} PP{pp} P{p} C{c}):", file=out)
    records, baseline = [], None
    for topo in requested_topologies(model, cluster, tp, pp, p, c):
        problem = topology_problem(model, cluster, topo)
        if problem:
            print(f"  {topo.mode:<4}  invalid: {problem}", file=out)
            continue
        pred = predict(model, cluster, topo)
        baseline = pred if modes.parallel_mode(topo.mode).is_baseline else baseline
        pred.reason = _reason(pred, baseline)
        print(f"  {topo.mode:<4} {pred.attention_gib:8.2f} GiB   step {pred.step_time_s:8.3f} s   "
              f"{pred.tokens_per_s:9.0f} tok/s   {pred.reason}", file=out)
        records.append({**pred.record(), "requested": True})
    return records


def _print_plan(preds: list, top: int, out):
    print(f"\nbest layouts of {len(preds)} valid ({sum(q.fits for q in preds)} fit in memory):", file=out)
    print(f"  {'layout':<30} {'step s':>8} {'tok/s':>9} {'attn GiB':>9} {'mem GiB':>8}  why", file=out)
    for q in preds[:top]:
        print(f"  {q.topology.label():<30} {q.step_time_s:8.3f} {q.tokens_per_s:9.0f} {q.attention_gib:9.2f} "
              f"{q.memory_bytes / GIB:8.1f}  {q.reason}", file=out)
    print("best per mode (attention traffic per GPU per step):", file=out)
    best = best_by_mode(preds)
    for mode, q in best.items():
        if q is None:
            least = min((r.memory_bytes for r in preds if r.topology.mode == mode), default=None)
            need = f" (needs at least {least / GIB:.1f} GiB)" if least else ""
            print(f"  {mode:<4} does not fit in memory in any layout{need}", file=out)
        else:
            print(f"  {mode:<4} {q.attention_gib:8.2f} GiB   {q.topology.label()}   {q.tokens_per_s:9.0f} tok/s",
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
            records += _print_requested(model, cluster, tp, pp, p, args.context_block_parallel_clean_shards or p, out)
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
