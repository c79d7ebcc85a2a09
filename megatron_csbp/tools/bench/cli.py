"""Side-by-side benchmark of CSBP, the field's conventional CP, its bytes-only ablation and pure BP on one model,
data and noise.

    python -m megatron_csbp.bench --modes csbp,cp,cp-traffic,bp --seq-lengths 1024,4096,16384 --nproc 2 \
        [--block-size 64] [--num-layers 2 --hidden-size 128 ...] [--json out.json] [--plot out.png] \
        [--link-gbps 100,10,1,0.1 --link-plot link.png] [--overlap-check] [--predict]

Every (mode, length) runs in freshly spawned ranks (gloo on the CPU, NCCL on GPUs), so each one's peak
memory is its own. Per rank it measures a forward+backward step of the BDLM GPT model (median of
`--steps` after `--warmup`), the bytes the attention ops sent (their counters), the time the compute
path waited on those collectives (exposed communication, with its share of the step), the peak memory
(the allocator's on a GPU; on the CPU the growth of the process's peak RSS over the steps, beside the
exact bytes autograd saved for backward), the real attention pairs the rank's rows may see, and tokens/s.
Beside them, what the attention kernels compute, per rank, per head and sample in one layer's forward, counted
off the kernels' own plans (masks and tiles; the streaming transport makes the remote call once per ring
step): kernel calls by family (dense / prefix / masked), real pairs and computed pairs (whole tiles at the
kernel's tile size).

In the same ranks, after the backend's own link: every `--link-gbps` value as a simulated link
(`comm.simulated_link`: each collective lasts at least latency + bytes / bandwidth, the delay taken
where the compute waits, so overlap works as on a real link), and with `--overlap-check` the backend's
link with every collective waited for at once (`comm.serialised`), which shows what the overlap hides.
`--predict` calibrates the planner on this machine (the model's matmuls, the attention kernel on the
BDLM mask and the backend's all-gather, timed in each run's ranks just before and just after its steps, so
under the same load, keeping the faster of the two) and prints its prediction beside every measured step.
`--kernel-check` also times the CPU attention kernel on the BDLM mask against a dense matmul, and every rank's
kernels of CSBP and CP on that rank's own rows and plan in one process, paired (does one layout's plan cost more
per pair than the other's?). `--transport-memory` also measures, in the same ranks, the peak tensor memory of a
step and of the attention op alone under each transport (collective, streaming): exact tensor bytes (torch's
profiler on the CPU, the allocator's peak on accelerators), for the modes with a ring. `--logits-memory` measures
the same way the peak tensor memory of a step with the LM head's logits whole and as the tiled linear
cross-entropy (`--cross-entropy-tile-rows`), beside the logits' bytes; `--cross-entropy-loss-fusion` times the
steps with the tiled one.

This module is the command line and its checks: every run the bench will make is the trainer's `RunConfig`
(`runs`), so a refusal is the trainer's own, in its order, naming the bench's flags.
"""

import argparse
import json

from megatron_csbp.core import modes, rules, transports
from megatron_csbp.core.clean_attention import BLOCK_CAUSAL, CLEAN_ATTENTIONS
from megatron_csbp.core.model_shape import ModelShape, MoEShape
from megatron_csbp.core.run_config import RunConfig
from megatron_csbp.tools.bench.records import Calibration

MODES = modes.PARALLEL_MODES
RING_MODES = tuple(mode for mode in MODES.values() if mode.transported_copies)  # CSBP and the CPs: --kernel-check's
# The trainer's rules (megatron_csbp.core.rules, through each run's RunConfig), told the bench's flag names.
FLAGS = rules.FLAGS.renamed(seq_length="--seq-lengths", block_size="--block-size", parallel_size="--nproc",
                            clean_shards="clean shards", mode="--modes", clean_layout="clean layout", kv_channels=None)
CALIBRATION_FLAGS = FLAGS.renamed(seq_length="--predict's calibration: half of --seq-lengths,")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_csbp.bench", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    add("--seq-lengths", default="1024,4096,16384", help="clean context lengths L, comma-separated")
    add("--nproc", type=int, default=2, help="ranks (the block-parallel / CP size)")
    add("--block-size", type=int, default=64)
    add("--csbp-transport", default=transports.COLLECTIVE.name, choices=transports.TRANSPORTS)
    add("--bdlm-clean-attention", default=BLOCK_CAUSAL.name, choices=CLEAN_ATTENTIONS,
        help="what a clean row sees of the clean copy: its block (block-causal) or the tokens up to its own")
    add("--transport-memory", action="store_true",
        help="also measure, in the same ranks, the peak tensor memory of a step and of the attention op alone under "
             "each transport (collective, streaming), for the modes with a ring")
    add("--logits-memory", action="store_true",
        help="also measure, in the same ranks, the peak tensor memory of a step with the LM head's logits whole and "
             "as a tiled linear cross-entropy, and the logits' bytes")
    add("--cross-entropy-loss-fusion", action="store_true",
        help="time the steps with the LM head and its loss as a tiled linear cross-entropy")
    add("--cross-entropy-tile-rows", type=int, default=rules.CROSS_ENTROPY_TILE_ROWS,
        help="rows per tile of the tiled linear cross-entropy")
    add("--num-layers", type=int, default=2)
    add("--hidden-size", type=int, default=128)
    add("--num-attention-heads", type=int, default=4)
    add("--num-query-groups", type=int, default=2)
    add("--ffn-hidden-size", type=int, default=None)
    add("--vocab-size", type=int, default=512)
    add("--micro-batch-size", type=int, default=1)
    add("--steps", type=int, default=3, help="measured steps per run (the median is reported)")
    add("--warmup", type=int, default=1)
    add("--interleave", action="store_true",
        help="run every mode of a length in the same ranks, their steps alternating (paired): step ratios a slow "
             "spell of a shared machine cannot bias; peak memory as exact tensor bytes")
    add("--link-gbps", default="",
        help="comma-separated simulated link speeds (Gb/s) measured after the backend's own link")
    add("--link-latency-us", type=float, default=10.0, help="latency of each simulated transfer")
    add("--overlap-check", action="store_true",
        help="also measure with every collective waited for at issue (no overlap)")
    add("--recompute-granularity", choices=rules.RECOMPUTE_GRANULARITIES, default=None,
        help="megatron-core activation recomputation (full: every layer, uniform)")
    add("--predict", action="store_true",
        help="calibrate the planner on this machine and print its prediction beside each step")
    add("--calibrate-from", metavar="JSON",
        help="predict every measured step from the calibration recorded in this earlier bench's --json (run with "
             "--predict): a held-out prediction, its rates measured in another run")
    add("--link-plot", help="write step time against the simulated link speed to this PNG")
    add("--run-timeout", type=float, default=3600,
        help="seconds one (mode, length) run may take before its ranks are stopped")
    add("--kernel-check", action="store_true",
        help="also time the CPU attention kernel at the longest length against dense matmul, and each rank's CSBP "
             "and CP kernels on their own rows and plans, paired")
    add("--document-balance", type=int, default=0, metavar="N",
        help="instead of timing: N random packings per length (documents log-uniform from 256 to 16K tokens, block "
             "multiples), and the max/mean real attention pairs per rank of the static schedule and of the "
             "document-balanced deal")
    add("--json", help="write the records to this file")
    add("--plot", help="write time / bytes / memory against sequence length to this PNG")
    from megatron_csbp.training.flags import add_moe_args

    add_moe_args(parser)  # the trainer's MoE flags, its defaults but the dispatcher (the all-to-all is measured)
    parser.set_defaults(moe_token_dispatcher_type="alltoall")
    add("--moe-round-robin-routing", action="store_true",
        help="route row i of each rank to experts (i*topk + j) mod E, j < topk, instead of the router's choice: "
             "exactly uniform routing, the planner's assumption (no load-balancing loss is computed)")
    return parser


def model_shape(args, experts: bool = True) -> ModelShape:
    """The bench's model (RMSNorm, an output layer of its own; no linear biases with experts, `experts.moe_config`),
    its experts left out with `experts=False`."""
    moe = MoEShape(args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size,
                   sum(rules.moe_layer_pattern(args.moe_layer_freq, args.num_layers)),
                   args.moe_shared_expert_intermediate_size or 0) if args.num_experts and experts else None
    return ModelShape(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                      ffn_hidden_size=args.ffn_hidden_size, add_bias_linear=not args.num_experts, layernorm_bias=False,
                      untied_output=True, moe=moe, flags=FLAGS)


def run_config(args, mode, seq_length) -> RunConfig:
    """The trainer's run of `mode` (its name or itself) at `seq_length` on `--nproc` ranks, as the bench runs it."""
    return RunConfig(model_shape(args), seq_length, args.block_size, mode=mode, block_parallel_size=args.nproc,
                     transport=args.csbp_transport, clean_attention=args.bdlm_clean_attention,
                     micro_batch_size=args.micro_batch_size,
                     logits_tile_rows=args.cross_entropy_tile_rows if args.cross_entropy_loss_fusion else None,
                     expert_parallel_size=args.expert_model_parallel_size,
                     expert_tensor_parallel_size=args.expert_tensor_parallel_size, flags=FLAGS)


def calibration_run(args, seq_length) -> RunConfig:
    """The one-rank CSBP run whose attention `--predict`'s calibration times at `seq_length`: one rank's `L/2`
    clean rows (the model without its experts: only its matmuls and attention are timed)."""
    return RunConfig(model_shape(args, experts=False), seq_length // 2, args.block_size,
                     clean_attention=args.bdlm_clean_attention, micro_batch_size=args.micro_batch_size,
                     flags=CALIBRATION_FLAGS)


def kernel_check_runs(args) -> list[RunConfig]:
    """The runs `--kernel-check` times the kernels of: each mode with a ring at the longest length."""
    return [run_config(args, mode, max(args.seq_lengths)) for mode in RING_MODES]


def runs(args):
    """Every run the bench makes, in order: the measured ones (length by length), `--predict`'s calibrations,
    `--kernel-check`'s; `ConfigError` at the first one the trainer would refuse."""
    for seq_length in args.seq_lengths:
        for mode in args.modes:
            yield run_config(args, mode, seq_length)
    if args.predict:
        for seq_length in args.seq_lengths:
            yield calibration_run(args, seq_length)
    if args.kernel_check:
        yield from kernel_check_runs(args)


def parse_args(argv=None):
    """The bench's arguments, checked as the trainer checks a run (one line naming the flag, exit 2): `modes` and
    `csbp_transport` stay names (they travel to the spawned ranks), `ffn_hidden_size` is resolved."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.held_out_calibration = _recorded_calibration(args.calibrate_from, parser) if args.calibrate_from else None
    args.modes = args.modes.split(",")
    args.seq_lengths = [int(n) for n in args.seq_lengths.split(",")]
    try:
        args.link_gbps = [float(x) for x in args.link_gbps.split(",") if x]
    except ValueError:
        parser.error(f"--link-gbps: {args.link_gbps!r} is not a comma-separated list of numbers (Gb/s)")
    if any(not gbps > 0 for gbps in args.link_gbps) or args.link_latency_us < 0:
        parser.error("--link-gbps values must be > 0 and --link-latency-us >= 0")
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: {sorted(unknown)} unknown; choose from {','.join(MODES)}")
    try:  # the trainer's order: the MoE layer pattern, the runs, the experts' routing, the tile
        if args.num_experts:
            rules.refuse(rules.moe_layer_freq_problem(args.moe_layer_freq, args.num_layers), rules.ConfigError)
        for _ in runs(args):
            pass
        if args.num_experts:
            rules.refuse(rules.moe_problem(
                args.num_experts, args.moe_router_topk, args.moe_router_load_balancing_type,
                args.moe_token_dispatcher_type, 1, args.expert_model_parallel_size, False, 1,
                shared_expert=bool(args.moe_shared_expert_intermediate_size), bias=False), rules.ConfigError)
        rules.refuse(rules.at_least(FLAGS.logits_tile_rows, args.cross_entropy_tile_rows), rules.ConfigError)
    except rules.ConfigError as error:
        parser.error(str(error))
    apart = [flag for flag, given in (("--link-gbps", args.link_gbps), ("--overlap-check", args.overlap_check),
                                      ("--transport-memory", args.transport_memory),
                                      ("--logits-memory", args.logits_memory), ("--predict", args.predict),
                                      ("--calibrate-from", args.calibrate_from)) if given]
    if args.interleave and apart:
        parser.error(f"--interleave measures the backend's own link only; run {', '.join(apart)} without it")
    args.ffn_hidden_size = model_shape(args).ffn_hidden_size
    return args


def _recorded_calibration(path, parser) -> Calibration:
    """The calibration of the first backend-link run recorded in an earlier bench's JSON, with where it came from."""
    try:
        with open(path, encoding="utf-8") as handle:
            records = json.load(handle)
    except (OSError, ValueError) as error:
        parser.error(f"--calibrate-from {path}: cannot be read as a bench --json ({error})")
    for record in records if isinstance(records, list) else []:
        if isinstance(record, dict) and record.get("calibration") and record.get("link_gbps") is None:
            try:
                origin = f"{record['mode']} L={record['seq_length']} of {path}"
                return Calibration(**record["calibration"], origin=origin)
            except TypeError as error:
                parser.error(f"--calibrate-from {path}: its calibration is not a bench's ({error}); write one with "
                             f"--predict --json {path}")
    parser.error(f"--calibrate-from {path}: no calibration in it; write one with --predict --json {path}")
