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
under the same load, keeping the faster of the two) and prints its prediction beside every measured step. `--kernel-check` also times the CPU attention kernel on the
BDLM mask against a dense matmul, and every rank's kernels of CSBP and CP on that rank's own rows and plan in
one process, paired (does one layout's plan cost more per pair than the other's?).
`--transport-memory` also measures, in the same ranks, the peak tensor memory of a step and of the attention
op alone under each transport (collective, streaming): exact tensor bytes (torch's profiler on the CPU,
the allocator's peak on accelerators), for the modes with a ring.
"""

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import time

import torch

from megatron_csbp.core import modes, rules
from megatron_csbp.core.rules import PARALLEL_MODES as MODES

RING_MODES = tuple(mode for mode in MODES if modes.parallel_mode(mode).transported_copies)  # CSBP and the CPs
BASELINE = next(mode for mode in MODES if modes.parallel_mode(mode).is_baseline)  # the field's CP: "vs CP" columns

# The trainer's rules (megatron_csbp.core.rules), told the bench's flag names.
FLAGS = rules.FLAGS.renamed(seq_length="--seq-lengths", block_size="--block-size", parallel_size="--nproc",
                            clean_shards="clean shards", mode="--modes", clean_layout="clean layout")
CALIBRATION_FLAGS = FLAGS.renamed(seq_length="--predict's calibration: half of --seq-lengths,")
# What each rank of a MoE run records (kept per rank: the all-to-all and the routing differ from rank to rank).
MOE_RANK_KEYS = ("all_to_all_bytes", "all_to_all_calls", "ep_rank", "ep_group", "routed_rows",
                 "routed_pairs_to_ep_ranks", "dense_parameters", "expert_parameters", "optimizer_dense_state_bytes",
                 "optimizer_expert_state_bytes", "gradient_buffer_dense_bytes", "gradient_buffer_expert_bytes")
TRANSPORT_MEMORY_KEYS = tuple(f"{transport}_{part}_peak_bytes" for transport in rules.TRANSPORTS
                              for part in ("step", "attention_forward", "attention"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m megatron_csbp.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--seq-lengths", default="1024,4096,16384", help="clean context lengths L, comma-separated")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (the block-parallel / CP size)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--csbp-transport", default="collective", choices=rules.TRANSPORTS)
    parser.add_argument("--transport-memory", action="store_true",
                        help="also measure, in the same ranks, the peak tensor memory of a step and of the attention "
                             "op alone under each transport (collective, streaming), for the modes with a ring")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--num-query-groups", type=int, default=2)
    parser.add_argument("--ffn-hidden-size", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--interleave", action="store_true",
                        help="run every mode of a length in the same ranks, their steps alternating (paired): step "
                             "ratios a slow spell of a shared machine cannot bias; peak memory as exact tensor bytes")
    parser.add_argument("--link-gbps", default="",
                        help="comma-separated simulated link speeds (Gb/s) measured after the backend's own link")
    parser.add_argument("--link-latency-us", type=float, default=10.0, help="latency of each simulated transfer")
    parser.add_argument("--overlap-check", action="store_true",
                        help="also measure with every collective waited for at issue (no overlap)")
    parser.add_argument("--recompute-granularity", choices=rules.RECOMPUTE_GRANULARITIES, default=None,
                        help="megatron-core activation recomputation (full: every layer, uniform)")
    parser.add_argument("--predict", action="store_true",
                        help="calibrate the planner on this machine and print its prediction beside each step")
    parser.add_argument("--calibrate-from", metavar="JSON",
                        help="predict every measured step from the calibration recorded in this earlier bench's "
                             "--json (run with --predict): a held-out prediction, its rates measured in another run")
    parser.add_argument("--link-plot", help="write step time against the simulated link speed to this PNG")
    parser.add_argument("--run-timeout", type=float, default=3600,
                        help="seconds one (mode, length) run may take before its ranks are stopped")
    parser.add_argument("--kernel-check", action="store_true",
                        help="also time the CPU attention kernel at the longest length against dense matmul, and "
                             "each rank's CSBP and CP kernels on their own rows and plans, paired")
    parser.add_argument("--document-balance", type=int, default=0, metavar="N",
                        help="instead of timing: N random packings per length (documents log-uniform from 256 to "
                             "16K tokens, block multiples), and the max/mean real attention pairs per rank of the "
                             "static schedule and of the document-balanced deal")
    parser.add_argument("--json", help="write the records to this file")
    parser.add_argument("--plot", help="write time / bytes / memory against sequence length to this PNG")
    from megatron_csbp.training.flags import add_moe_args

    add_moe_args(parser)  # the trainer's MoE flags, its defaults but the dispatcher (the all-to-all is measured)
    parser.set_defaults(moe_token_dispatcher_type="alltoall")
    parser.add_argument("--moe-round-robin-routing", action="store_true",
                        help="route row i of each rank to experts (i*topk + j) mod E, j < topk, instead of the "
                             "router's choice: exactly uniform routing, the planner's assumption (no load-balancing "
                             "loss is computed)")
    args = parser.parse_args(argv)
    if args.calibrate_from:
        args.held_out_calibration = _recorded_calibration(args.calibrate_from, parser)
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
    problem = next(filter(None, (
        rules.sequence_problem(mode, length, args.block_size, args.nproc, rules.clean_shards(mode, args.nproc),
                               flags=FLAGS) for length in args.seq_lengths for mode in args.modes)), None)
    if args.predict:  # the calibration times the attention op on one rank's L/2 clean rows
        problem = problem or next(filter(None, (
            rules.whole_blocks_problem(length // 2, args.block_size, CALIBRATION_FLAGS)
            for length in args.seq_lengths)), None)
    if args.kernel_check:  # it times the CSBP and CP layouts of the longest length
        problem = problem or next(filter(None, (
            rules.sequence_problem(mode, max(args.seq_lengths), args.block_size, args.nproc,
                                   rules.clean_shards(mode, args.nproc), flags=FLAGS) for mode in RING_MODES)),
            None)
    problem = problem or rules.query_groups_problem(args.num_attention_heads, args.num_query_groups)
    problem = problem or rules.expert_parallel_problem(args.num_experts, args.expert_model_parallel_size,
                                                       args.expert_tensor_parallel_size, 1, 1, args.nproc, FLAGS)
    if args.num_experts and not problem:
        problem = rules.moe_layer_freq_problem(args.moe_layer_freq, args.num_layers) or rules.moe_problem(
            args.num_experts, args.moe_router_topk, args.moe_router_load_balancing_type,
            args.moe_token_dispatcher_type, 1, args.expert_model_parallel_size, False, 1,
            shared_expert=bool(args.moe_shared_expert_intermediate_size), bias=False)
    if problem:
        parser.error(problem)
    apart = [flag for flag, given in (("--link-gbps", args.link_gbps), ("--overlap-check", args.overlap_check),
                                      ("--transport-memory", args.transport_memory), ("--predict", args.predict),
                                      ("--calibrate-from", args.calibrate_from)) if given]
    if args.interleave and apart:
        parser.error(f"--interleave measures the backend's own link only; run {', '.join(apart)} without it")
    args.ffn_hidden_size = args.ffn_hidden_size or rules.default_ffn_hidden_size(args.hidden_size, swiglu=False)
    return args


def _recorded_calibration(path, parser):
    """The calibration of the first backend-link run recorded in an earlier bench's JSON, with where it came from."""
    try:
        with open(path, encoding="utf-8") as handle:
            records = json.load(handle)
    except (OSError, ValueError) as error:
        parser.error(f"--calibrate-from {path}: cannot be read as a bench --json ({error})")
    for record in records if isinstance(records, list) else []:
        if isinstance(record, dict) and record.get("calibration") and record.get("link_gbps") is None:
            return dict(record["calibration"], origin=f"{record['mode']} L={record['seq_length']} of {path}")
    parser.error(f"--calibrate-from {path}: no calibration in it; write one with --predict --json {path}")


def load_warning(load_average, cores=None):
    """A line when the machine ran more work than it has cores during a run (its times are then slowed by
    others' work), else None."""
    cores = cores or os.cpu_count()
    if load_average > cores:
        return (f"WARNING: load average {load_average:.1f} above the {cores} cores during this run: its times "
                f"include waiting for other processes")
    return None


def layout_of(mode, seq_length, block_size, nproc, rank):
    from megatron_csbp.core.layout import layout_for

    return layout_for(mode, seq_length, block_size, nproc, rank=rank)  # C: rules.clean_shards(mode, nproc)


def rank_attention_pairs(layout) -> int:
    """Query-key pairs the BDLM mask lets this rank's rows see, per head, layer and sample."""
    block = layout.block_size
    noisy = layout.noisy_positions // block
    clean = layout.clean_positions // block
    return int(((noisy + 1) * block).sum() + ((clean + 1) * block).sum())


def kernel_work(layout, transport="collective"):
    """The attention kernel calls of one layer's forward on this rank under `transport`, per head and sample,
    counted off the CPU kernels' own plans for `layout` (their masks and tiles: flex's 128 for the masked
    call), as dicts: one remote call against all keys (collective) or one per ring member's shard (streaming)."""
    import dataclasses

    from megatron_csbp.core import ops, transports
    from megatron_csbp.core.kernels import CPUKernels

    plan = ops.ring_plan(layout, torch.device("cpu"), CPUKernels())
    calls = plan.kernel_calls(per_member=transports.transport(transport).call_per_member)
    return [dataclasses.asdict(call) for call in calls]


def _kernel_summary(calls):
    return dict(kernels="+".join(dict.fromkeys(c["kind"] for c in calls)),
                kernel_calls=sum(c["calls"] for c in calls),
                kernel_real_pairs=sum(c["real_pairs"] * c["calls"] for c in calls),
                kernel_computed_pairs=sum(c["computed_pairs"] * c["calls"] for c in calls))


def _saved_bytes_hooks(store):
    seen = set()

    def pack(tensor):
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            store[0] += key[1]
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def _peak_memory(device, baseline_rss):
    if device.type != "cpu":
        return torch.get_device_module(device).max_memory_allocated(device)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return max(peak_rss - baseline_rss, 0)


@contextlib.contextmanager
def peak_tensor_memory(device):
    """`with peak_tensor_memory(device) as peak: ...`, then `peak.bytes`: the most bytes of tensors alive at
    once inside the block beyond those alive when it began (frees of older tensors count). On an accelerator
    the allocator's peak; on the CPU the allocations and frees torch's profiler records, in order: exact
    tensor bytes, unlike the process's RSS, which the allocator's caching and the model's setup blur."""
    peak = argparse.Namespace(bytes=0)
    if device.type != "cpu":
        module = torch.get_device_module(device)
        module.synchronize(device)
        module.reset_peak_memory_stats(device)
        start = module.memory_allocated(device)
        yield peak
        module.synchronize(device)
        peak.bytes = module.max_memory_allocated(device) - start
        return
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        yield peak
    allocations, pending = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size))
    alive = 0
    for _, size in sorted(allocations):
        alive += size
        peak.bytes = max(peak.bytes, alive)


def transport_memory(build_model, forward_step, batch, layout, group, config, micro_batch_size, device):
    """Peak tensor bytes under each transport, in this rank: of one training step of the model `build_model(
    transport)` returns (after a warm-up step), and of the attention op alone on this rank's rows of one layer
    (forward, and forward+backward). Keys `<transport>_step_peak_bytes`, `<transport>_attention_forward_peak_bytes`,
    `<transport>_attention_peak_bytes`."""
    from megatron_csbp.core.ops import context_sharded_block_attention, ring_plan
    from megatron_csbp.core.rules import TRANSPORTS

    head_dim, plan = config.kv_channels, ring_plan(layout, device)
    q = torch.randn(layout.num_rows, micro_batch_size, config.num_attention_heads, head_dim, device=device)
    k, v = (torch.randn(layout.num_rows, micro_batch_size, config.num_query_groups, head_dim, device=device)
            for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    peaks = {}
    for transport in TRANSPORTS:
        model = build_model(transport)

        def train_step():
            output, loss_func = forward_step(iter([batch]), model)
            loss_sum, num_tokens, _ = loss_func(output)
            (loss_sum / num_tokens.clamp(min=1)).backward()
            model.zero_grad(set_to_none=True)

        def attention(backward):
            out = context_sharded_block_attention(q, k, v, layout, group, transport=transport, plan=plan)
            if backward:
                out.sum().backward()
                q.grad = k.grad = v.grad = None

        for name, run in [("step", train_step), ("attention_forward", lambda: attention(False)),
                          ("attention", lambda: attention(True))]:
            run()  # warm-up: plans, masks, first-call allocations
            torch.distributed.barrier()
            with peak_tensor_memory(device) as peak:
                run()
            peaks[f"{transport}_{name}_peak_bytes"] = peak.bytes
        del model
    return peaks


def moe_config(args) -> dict:
    """The `TransformerConfig` fields of the bench's experts: the trainer's mapping of its MoE flags
    (`megatron_config.moe_config_kwargs`), without linear biases (megatron-core's shared expert has none, and the
    planner counts none); nothing for a dense model."""
    if not args.num_experts:
        return {}
    from megatron_csbp.training.megatron_config import moe_config_kwargs

    return dict(moe_config_kwargs(args), add_bias_linear=False)


def round_robin_routing(router, logits, padding_mask=None):
    """Top-k routing that ignores the scores' order: the rank's row `i` (in `[s, b]` order) goes to experts
    `(i * topk + j) mod E`, `j < topk`, weighted by its softmax scores there. Over `R` rows with `E | R * topk`
    every expert gets `R * topk / E` (row, expert) pairs: the planner's uniform routing, exactly."""
    experts, topk = router.config.num_moe_experts, router.topk
    logits = logits.reshape(-1, experts)
    chosen = (torch.arange(logits.shape[0], device=logits.device).unsqueeze(1) * topk
              + torch.arange(topk, device=logits.device)) % experts
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(1, chosen, True)
    return torch.softmax(logits, dim=-1) * routing_map, routing_map


class MoERouting:
    """What this rank's MoE layers route in a step, read off each router's output (a forward hook, apart from the
    all-to-all counting): per router call, the (row, expert) pairs going to each expert-parallel rank's experts
    (`E / EP` consecutive experts each); and the rank's dense and expert parameters. With
    `--moe-round-robin-routing` the routers route by `round_robin_routing`."""

    def __init__(self, model, args):
        import functools

        from megatron.core import parallel_state as mpu

        self.ep, self.ep_rank = mpu.get_expert_model_parallel_world_size(), mpu.get_expert_model_parallel_rank()
        self.ep_group = torch.distributed.get_process_group_ranks(mpu.get_expert_model_parallel_group())
        self.pairs, self.rows = [], []
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is None:
                continue
            if args.moe_round_robin_routing:
                router.routing = functools.partial(round_robin_routing, router)
            router.register_forward_hook(self._routed)
        # routed experts by module name: every MoE layer's `experts` (a shared expert is dense)
        sizes = [(".experts." in name, param.numel()) for name, param in model.named_parameters()]
        self.dense_parameters = sum(size for expert, size in sizes if not expert)
        self.expert_parameters = sum(size for expert, size in sizes if expert)

    def _routed(self, module, inputs, output):
        routing_map = output[1]
        self.rows.append(routing_map.shape[0])
        self.pairs.append(routing_map.reshape(routing_map.shape[0], self.ep, -1).sum(dim=(0, 2)).tolist())

    def clear(self):
        self.pairs, self.rows = [], []

    def record(self) -> dict:
        return dict(ep_rank=self.ep_rank, ep_group=self.ep_group, routed_rows=list(self.rows),
                    routed_pairs_to_ep_ranks=list(self.pairs), dense_parameters=self.dense_parameters,
                    expert_parameters=self.expert_parameters)


def optimizer_state(model, config) -> dict:
    """The memory megatron-core's distributed optimizer gives this rank, measured on `model`: the fp32 gradient
    buffers DDP allocates (whole, dense and expert, padded as megatron-core pads them), and Adam's state tensors
    for the shard of the parameters megatron-core assigns this rank (the dense parameters' sharded over DP x CP,
    the experts' over the expert-data-parallel group, which is DP x CP under EP1; the plugin gives the experts
    their own optimizer on every EP size, `mcore.model`). The state is allocated by the inner torch optimizer's own
    step on those shards, given zero gradients: the shards are megatron-core's, the step needs no gradient
    exchange (which gloo cannot coalesce)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                        use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True,
                                                       params_dtype=torch.float32), [ddp])
    state = {"dense": 0, "expert": 0}
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        inner.step()
        for group in inner.param_groups:
            for param in group["params"]:
                tensors = [t for t in inner.state.get(param, {}).values()
                           if torch.is_tensor(t) and t.dim() > 0]  # Adam's moments (not its step count)
                state["expert" if group["is_expert_parallel"] else "dense"] += sum(
                    t.numel() * t.element_size() for t in tensors)
    gradient = lambda buffers: sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)  # noqa: E731
    return dict(optimizer_dense_state_bytes=state["dense"], optimizer_expert_state_bytes=state["expert"],
                gradient_buffer_dense_bytes=gradient(ddp.buffers),
                gradient_buffer_expert_bytes=gradient(ddp.expert_parallel_buffers))


def _rank_run(rank, world_size, args, mode, seq_length):
    """One (mode, length) on this rank, inside the CPU backend (a no-op on accelerators); returns its record."""
    from megatron_csbp.mcore import cpu_backend

    with cpu_backend.active():
        before = _calibration_rank(rank, world_size, args, seq_length) if args.predict else None
        records = _rank_record(rank, world_size, args, mode, seq_length)
        calibration = _least_disturbed(before, _calibration_rank(rank, world_size, args, seq_length)) \
            if args.predict else None
    return [dict(record, calibration=calibration) for record in records]


def _least_disturbed(before, after):
    """Rates calibrated before and after the steps, each the faster of the two: the planner is compared with
    the fastest measured step, so it gets the least disturbed calibration too; a load burst during one of
    the two (minutes on a shared machine) does not decide the prediction."""
    fastest = {key: max(before[key], after[key]) for key in ("linear_gflops", "attention_gflops")}
    return dict(before, **fastest, gather_s=min(before["gather_s"], after["gather_s"]),
                latency_s=min(before["latency_s"], after["latency_s"]))


def conditions(args):
    """What each spawned run measures, in order: (simulated link in Gb/s or None, overlap on?)."""
    measured = [(None, True)] + [(gbps, True) for gbps in args.link_gbps]
    return measured + ([(None, False)] if args.overlap_check else [])


class _ModeRun:
    """One mode's model, data and noise on this rank, and its timed step: what a (mode, length) run measures,
    whether its ranks measure only it or every mode in turn (`--interleave`)."""

    def __init__(self, rank, world_size, args, mode, seq_length):
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        from megatron_csbp.bdlm.forward_step import BDLMForwardStep
        from megatron_csbp.bdlm.objective import BDLMObjective
        from megatron_csbp.core.device import default_device
        from megatron_csbp.mcore import parallel_state
        from megatron_csbp.mcore.model import model_provider

        self.mode, self.seq_length, self.rank, self.args = mode, seq_length, rank, args
        self.device = device = default_device()
        self.clean_shards = layout_of(mode, seq_length, args.block_size, world_size, 0).clean_shards
        if not parallel_state.is_initialized():
            parallel_state.initialize_model_parallel(
                context_block_parallel_size=world_size, clean_shards=self.clean_shards,
                expert_model_parallel_size=args.expert_model_parallel_size,
                expert_tensor_parallel_size=args.expert_tensor_parallel_size)
        elif parallel_state.get_clean_shards() != self.clean_shards:  # this mode's rings, in Megatron's CP groups
            parallel_state.initialize_block_parallel_groups(self.clean_shards)
        self.group = parallel_state.get_block_parallel_groups()
        self.layout = layout = layout_of(mode, seq_length, args.block_size, world_size,
                                         mpu.get_context_parallel_rank())
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
            if args.recompute_granularity == "full" else dict(recompute_granularity=args.recompute_granularity)
        self.config = config = TransformerConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
            context_parallel_size=world_size, normalization="RMSNorm", use_cpu_initialization=True,
            calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0, **recompute,
            **moe_config(args))
        mask_token = args.vocab_size - 1

        def build_model(transport):
            torch.manual_seed(1234)
            model_parallel_cuda_manual_seed(1234)
            return model_provider(config=config, layout=layout, vocab_size=args.vocab_size,
                                  mask_token_id=mask_token, group=self.group, transport=transport).to(device)

        self.build_model = build_model
        self.model = build_model(args.csbp_transport)
        self.routing = MoERouting(self.model, args) if args.num_experts else None
        self.forward_step = BDLMForwardStep(BDLMObjective(block_size=args.block_size, mask_token_id=mask_token,
                                                          seed=7), layout)
        generator = torch.Generator().manual_seed(42)
        self.batch = {"tokens": torch.randint(0, mask_token, (args.micro_batch_size, seq_length),
                                              generator=generator),
                      "sample_index": torch.arange(args.micro_batch_size)}
        self.work = kernel_work(layout, args.csbp_transport)
        self.saved = [0]  # bytes the first step's forward kept for backward

    def step(self):
        """One forward+backward; returns (seconds, this process's CPU seconds, the byte counter of its collectives).
        The CPU seconds (every thread of the rank, gloo's included; not the time it waited for a core or a peer)
        are what the step computed whatever else the machine ran."""
        from megatron_csbp.core import comm

        torch.distributed.barrier()
        if self.routing:
            self.routing.clear()
        start, cpu_start = time.perf_counter(), time.process_time()
        with comm.count_bytes() as counter, comm.count_all_to_all() as exchanged:
            with _saved_bytes_hooks(self.saved if not self.saved[0] else [0]):  # not what recompute re-saves
                output, loss_func = self.forward_step(iter([self.batch]), self.model)
                loss_sum, num_tokens, _ = loss_func(output)
            (loss_sum / num_tokens.clamp(min=1)).backward()
        if self.device.type != "cpu":
            torch.accelerator.synchronize()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        self.model.zero_grad(set_to_none=True)
        counter.all_to_all_bytes, counter.all_to_all_calls = exchanged.bytes_sent, exchanged.calls
        return elapsed, cpu, counter

    def record(self, times, cpu_times, waits, counter, peak_memory_bytes, **condition):
        """The record of this mode's measured steps under one condition (link, overlap)."""
        args, config = self.args, self.config
        step_time, best = statistics.median(times), min(range(len(times)), key=times.__getitem__)
        return dict(
            mode=self.mode, seq_length=self.seq_length, block_size=args.block_size,
            nproc=torch.distributed.get_world_size(), rank=self.rank, transport=args.csbp_transport,
            recompute=args.recompute_granularity or "none", **condition,
            bytes_sent_per_rank=counter.bytes_sent, step_time_s=step_time, exposed_comm_s=statistics.median(waits),
            best_step_time_s=times[best], best_exposed_comm_s=waits[best], step_times_s=list(times),
            cpu_time_s=statistics.median(cpu_times), cpu_times_s=list(cpu_times),
            peak_memory_bytes=peak_memory_bytes,
            saved_activation_bytes=self.saved[0], rows_per_rank=self.layout.num_rows,
            attention_pairs_per_rank=rank_attention_pairs(self.layout) * config.num_attention_heads
            * config.num_layers * args.micro_batch_size,
            tokens_per_s=args.micro_batch_size * self.seq_length / step_time, kernel_work=self.work,
            **_kernel_summary(self.work), all_to_all_bytes=counter.all_to_all_bytes,
            all_to_all_calls=counter.all_to_all_calls, **(self.routing.record() if self.routing else {}))

    def expert_memory(self) -> dict:
        """Parameters and optimizer state per rank, dense and expert (an MoE model; else nothing)."""
        return optimizer_state(self.model, self.config) if self.routing else {}


def _rank_record(rank, world_size, args, mode, seq_length):
    import psutil

    from megatron_csbp.core import comm
    from megatron_csbp.mcore import parallel_state

    baseline_rss = psutil.Process().memory_info().rss
    run = _ModeRun(rank, world_size, args, mode, seq_length)
    if run.device.type != "cpu":
        torch.get_device_module(run.device).reset_peak_memory_stats(run.device)
    for _ in range(args.warmup):
        run.step()
    records = []
    for gbps, overlap in conditions(args):
        times, cpu_times, waits = [], [], []
        link = comm.simulated_link(gbps, args.link_latency_us) if gbps else contextlib.nullcontext()
        with link, contextlib.nullcontext() if overlap else comm.serialised():
            for _ in range(args.steps):
                elapsed, cpu, counter = run.step()
                times.append(elapsed)
                cpu_times.append(cpu)
                waits.append(counter.wait_s)
        records.append(run.record(times, cpu_times, waits, counter, _peak_memory(run.device, baseline_rss),
                                  link_gbps=gbps,
                                  link_latency_us=args.link_latency_us if gbps else None, overlap=overlap))
    records = [dict(record, **run.expert_memory()) for record in records]
    if args.transport_memory and run.clean_shards > 1:
        del run.model
        memory = transport_memory(run.build_model, run.forward_step, run.batch, run.layout, run.group, run.config,
                                  args.micro_batch_size, run.device)
        records = [dict(record, **memory) for record in records]
    parallel_state.destroy_model_parallel()
    return records


def _rank_interleaved(rank, world_size, args, seq_length):
    """Every mode at one length in the same ranks, their steps alternating (round r starts at mode r, so no mode
    always follows the same one): paired, so a slow spell of a shared host slows every mode alike and the step
    ratios keep what the modes do. Peak memory: each mode's exact tensor bytes in one more step
    (`peak_tensor_memory`), as the process's RSS would mix the modes. One record per mode."""
    from megatron_csbp.mcore import cpu_backend, parallel_state

    with cpu_backend.active():
        runs = [_ModeRun(rank, world_size, args, mode, seq_length) for mode in args.modes]
        for _ in range(args.warmup):
            for run in runs:
                run.step()
        times, cpu_times, waits, counters = ({run.mode: [] for run in runs} for _ in range(4))
        for round_index in range(args.steps):
            for run in runs[round_index % len(runs):] + runs[:round_index % len(runs)]:
                elapsed, cpu, counter = run.step()
                times[run.mode].append(elapsed)
                cpu_times[run.mode].append(cpu)
                waits[run.mode].append(counter.wait_s)
                counters[run.mode] = counter
        records = []
        for run in runs:
            with peak_tensor_memory(run.device) as peak:
                run.step()
            records.append(run.record(times[run.mode], cpu_times[run.mode], waits[run.mode], counters[run.mode],
                                      peak.bytes, **run.expert_memory(),
                                      link_gbps=None, link_latency_us=None, overlap=True, interleaved=True))
        parallel_state.destroy_model_parallel()
    return records


def _spawn_run(args, mode, seq_length):
    from megatron_csbp.training.launch import run_ranks

    return run_ranks(_rank_run, args.nproc, args, mode, seq_length, timeout=args.run_timeout)


def _spawn_interleaved(args, seq_length):
    from megatron_csbp.training.launch import run_ranks

    return run_ranks(_rank_interleaved, args.nproc, args, seq_length, timeout=args.run_timeout * len(args.modes))


def summarise(per_rank):
    """One record per (mode, length, condition): the slowest rank's time and exposed communication, the
    largest rank's bytes and memory. `per_rank`: each rank's list of records, one per condition."""
    records = []
    for conditions_of_ranks in zip(*per_rank):
        first = conditions_of_ranks[0]
        record = {key: first[key] for key in ("mode", "seq_length", "block_size", "nproc", "transport", "recompute",
                                              "link_gbps", "link_latency_us", "overlap")}
        record["interleaved"] = first.get("interleaved", False)
        for key in ("step_times_s", "cpu_times_s"):  # round by round, the slowest rank's
            record[key] = [max(times) for times in zip(*(r[key] for r in conditions_of_ranks))]
        for key in ("bytes_sent_per_rank", "step_time_s", "cpu_time_s", "exposed_comm_s", "best_step_time_s",
                    "best_exposed_comm_s", "peak_memory_bytes",
                    "saved_activation_bytes", "rows_per_rank", "attention_pairs_per_rank"):
            record[key] = max(r[key] for r in conditions_of_ranks)
        for key in TRANSPORT_MEMORY_KEYS:
            if key in first:
                record[key] = max(r[key] for r in conditions_of_ranks)
        busiest = max(conditions_of_ranks, key=lambda r: r["kernel_computed_pairs"])  # the rank computing most
        record.update({key: busiest[key] for key in ("kernels", "kernel_calls", "kernel_real_pairs",
                                                     "kernel_computed_pairs")})
        record["kernel_work_by_rank"] = [r["kernel_work"] for r in conditions_of_ranks]
        record["exposed_share"] = record["exposed_comm_s"] / record["step_time_s"]
        if first.get("calibration"):
            record["calibration"] = combine_calibrations([r["calibration"] for r in conditions_of_ranks])
        record["tokens_per_s"] = min(r["tokens_per_s"] for r in conditions_of_ranks)
        record["all_to_all_bytes_per_rank"] = max(r.get("all_to_all_bytes", 0) for r in conditions_of_ranks)
        for key in MOE_RANK_KEYS:
            if key in first:
                record[f"{key}_by_rank"] = [r[key] for r in conditions_of_ranks]
        records.append(record)
    return records


def planned_experts(args, record):
    """The planner's figures for a MoE bench record (its model, layout and EP; bytes do not depend on the GPU):
    the prediction, whose `all_to_all_bytes` assume uniform routing."""
    from megatron_csbp.tools import plan

    model = plan.Model(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                       ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.vocab_size - 2, untie_embeddings=True,
                       seq_length=record["seq_length"], block_size=args.block_size, bytes_per_elem=4,
                       recompute=None if record["recompute"] == "none" else record["recompute"],
                       micro_batch_size=args.micro_batch_size, transport=args.csbp_transport,
                       num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                       moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                       moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                       moe_layer_freq=args.moe_layer_freq, moe_router_dtype=args.moe_router_dtype)
    nproc, mode = record["nproc"], record["mode"]
    topology = plan.Topology(mode, 1, 1, nproc, rules.clean_shards(mode, nproc), 1, args.expert_model_parallel_size,
                             args.expert_tensor_parallel_size)
    return plan.predict(model, plan.Cluster(nproc, nproc, plan.GPU_PRESETS["h200"]), topology)


def print_experts(args, records, out=None):
    """Per rank of each MoE run: the all-to-all bytes it sent (counted off the collectives) beside the planner's
    uniform-routing figure, the (row, expert) pairs its rows sent to other EP ranks and received from them (off
    the routers' outputs), its dense and expert parameters and the distributed optimizer's state, beside the
    planner's."""
    out = out or sys.stdout
    rows = [r for r in records if "routed_pairs_to_ep_ranks_by_rank" in r]  # runs with experts
    if not rows:
        return
    routing = " (round robin: uniform)" if args.moe_round_robin_routing else ""
    print(f"\nexperts: {args.num_experts} per MoE layer, top-{args.moe_router_topk}, EP"
          f"{args.expert_model_parallel_size}, {args.moe_token_dispatcher_type} dispatcher{routing}; per rank, "
          f"measured | planner", file=out)
    header = (f"{'mode':<10} {'L':>7} {'rank':>4} {'a2a bytes':>12} {'planner':>12} {'pairs out':>9} {'pairs in':>8} "
              f"{'dense params':>12} {'planner':>10} {'expert params':>13} {'planner':>10} {'Adam dense B':>12} "
              f"{'Adam expert B':>13} {'planner':>10}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        q = planned_experts(args, r)
        for rank, sent in enumerate(r["all_to_all_bytes_by_rank"]):
            ep_rank = r["ep_rank_by_rank"][rank]
            routed = r["routed_pairs_to_ep_ranks_by_rank"]
            pairs_out = sum(sum(layer) - layer[ep_rank] for layer in routed[rank])
            pairs_in = sum(layer[ep_rank] for other in r["ep_group_by_rank"][rank] if other != rank
                           for layer in routed[other])
            adam = r["optimizer_dense_state_bytes_by_rank"][rank], r["optimizer_expert_state_bytes_by_rank"][rank]
            print(f"{r['mode']:<10} {r['seq_length']:>7} {rank:>4} {sent:>12,} {q.all_to_all_bytes:>12,.0f} "
                  f"{pairs_out:>9,} {pairs_in:>8,} {r['dense_parameters_by_rank'][rank]:>12,} "
                  f"{q.dense_params_per_rank:>10,.0f} {r['expert_parameters_by_rank'][rank]:>13,} "
                  f"{q.expert_params_per_rank:>10,.0f} {adam[0]:>12,} {adam[1]:>13,} {q.optimizer_bytes:>10,.0f}",
                  file=out)


def kernel_efficiency(seq_length, block_size, heads=8, head_dim=64, repeats=3):
    """GFLOP/s of the CPU kernel on the full BDLM mask (real pairs only, model FLOPs: `rules.step_passes`) and of
    a dense fp32 matmul, on ONE thread, as this thread's CPU time (`time.thread_time`: other processes' load
    on a shared machine does not enter it as it would a wall clock), each the best of `repeats` rounds that
    alternate matmul, forward and backward (a burst cannot favour one). `prefix_forward_fraction`: the clean-
    prefix kernel alone (`CPUKernels.prefix_forward` on the op's plan), the op's bulk."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core import ops
    from megatron_csbp.core.kernels import CPUKernels
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.core.ops import context_sharded_block_attention

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    size = 2048
    a, b = torch.randn(size, size), torch.randn(size, size)
    layout = CSBPLayout(seq_length, block_size, 1, 1)
    rows = layout.num_rows
    q = torch.randn(rows, 1, heads, head_dim, requires_grad=True)
    k = torch.randn(rows, 1, heads // 2, head_dim, requires_grad=True)
    v = torch.randn(rows, 1, heads // 2, head_dim, requires_grad=True)
    kernels = CPUKernels()
    plan = ops.ring_plan(layout, torch.device("cpu"), kernels).gathered
    pq = torch.randn(1, heads // 2, 2, rows, head_dim)
    pk, pv = (torch.randn(1, heads // 2, seq_length, head_dim) for _ in range(2))

    def timed(function):
        start = time.thread_time()
        result = function()
        return time.thread_time() - start, result

    matmul_s = forward_s = backward_s = prefix_s = math.inf
    context_sharded_block_attention(q, k, v, layout).sum().backward()  # warm-up: plans, caches, allocator
    kernels.prefix_forward(pq, pk, pv, plan, 0.125)
    for _ in range(repeats):
        matmul_s = min(matmul_s, timed(lambda: a @ b)[0])
        seconds, out = timed(lambda: context_sharded_block_attention(q, k, v, layout))
        forward_s = min(forward_s, seconds)
        backward_s = min(backward_s, timed(lambda: out.sum().backward())[0])
        prefix_s = min(prefix_s, timed(lambda: kernels.prefix_forward(pq, pk, pv, plan, 0.125))[0])
    torch.set_num_threads(threads)
    matmul = 2 * size ** 3 / matmul_s / 1e9
    parts = flops.bdlm_attention_pair_parts(seq_length, block_size)
    per_pair = flops.attention_flops_per_pair(heads, head_dim)
    forward_flops = sum(parts.values()) * per_pair
    forward = forward_flops / forward_s / 1e9
    both = rules.step_passes() * forward_flops / (forward_s + backward_s) / 1e9
    prefix = (parts["noisy_clean"] + parts["clean_clean"]) * per_pair / prefix_s / 1e9
    return dict(seq_length=seq_length, block_size=block_size, threads=1, load_average=os.getloadavg()[0],
                matmul_gflops=matmul, attention_forward_gflops=forward, attention_train_gflops=both,
                prefix_forward_gflops=prefix, forward_fraction=forward / matmul, train_fraction=both / matmul,
                prefix_forward_fraction=prefix / matmul)


def kernel_plans_check(seq_length, block_size, nproc, heads=4, groups=2, head_dim=32, repeats=3):
    """The attention kernels of every rank of every mode on that rank's own rows and plan, timed in ONE process,
    modes alternating in each repeat (paired, best of `repeats`), so a load burst cannot favour one mode.

    It answers whether a layout's plan costs more per pair than another's: CSBP and CP compute the same real
    pairs per rank but cut them into different row groups (kernel calls of other shapes)."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core import ops
    from megatron_csbp.core.kernels import CPUKernels

    kernels, device, threads = CPUKernels(), torch.device("cpu"), torch.get_num_threads()
    torch.set_num_threads(1)  # as each bench rank computes
    cases = []
    for mode in RING_MODES:
        for rank in range(nproc):
            layout = layout_of(mode, seq_length, block_size, nproc, rank)
            ring = ops.ring_plan(layout, device, kernels)
            plan, noisy = ring.gathered, layout.num_noisy_rows if ring.block_diagonal else 0
            q = torch.randn(1, groups, heads // groups, layout.num_rows, head_dim)
            k, v = (torch.randn(1, groups, ring.num_keys, head_dim) for _ in range(2))
            out, lse = ring.remote_forward(q, k, v, plan, 0.1)
            cases.append(dict(mode=mode, rank=rank, layout=layout, ring=ring, plan=plan, q=q, k=k, v=v, out=out,
                              lse=lse,
                              dout=torch.randn_like(out), noisy_k=k[:, :, :noisy], noisy_v=v[:, :, :noisy],
                              forward_s=math.inf, backward_s=math.inf))

    def forward(c):
        c["ring"].remote_forward(c["q"], c["k"], c["v"], c["plan"], 0.1)
        if c["noisy_k"].shape[2]:
            kernels.block_diagonal_forward(c["q"][..., :c["noisy_k"].shape[2], :], c["noisy_k"], c["noisy_v"],
                                           block_size, 0.1)

    def backward(c):
        c["ring"].remote_backward(c["dout"], c["q"], c["k"], c["v"], c["out"], c["lse"], c["plan"], 0.1)

    for _ in range(repeats):
        for c in cases:
            for key, function in (("forward_s", forward), ("backward_s", backward)):
                start = time.perf_counter()
                function(c)
                c[key] = min(c[key], time.perf_counter() - start)
    torch.set_num_threads(threads)
    results = []
    for c in cases:
        real = rank_attention_pairs(c["layout"])
        seconds = c["forward_s"] + c["backward_s"]
        computed = sum(call.computed_pairs * call.calls for call in c["ring"].kernel_calls())
        results.append(dict(mode=c["mode"], rank=c["rank"], seq_length=seq_length, rows=c["layout"].num_rows,
                            row_groups=len(c["plan"].groups), real_pairs=real, padded_pairs=computed,
                            forward_s=c["forward_s"], backward_s=c["backward_s"],
                            gflops=rules.step_passes() * real * flops.attention_flops_per_pair(heads, head_dim) / seconds / 1e9))
    return results


def print_kernel_plans(results, out=None):
    cp = {(r["rank"]): r for r in results if r["mode"] == BASELINE}
    print("| mode | L | rank | rows | row groups | real pairs/head | computed pairs/head | forward (s) "
          "| backward: remote part (s) "
          "| GFLOP/s (real pairs) | time vs CP's same rank |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in results:
        both = r["forward_s"] + r["backward_s"]
        versus = both / (cp[r["rank"]]["forward_s"] + cp[r["rank"]]["backward_s"])
        print(f"| {r['mode']} | {r['seq_length']} | {r['rank']} | {r['rows']} | {r['row_groups']} | {r['real_pairs']:,} "
              f"| {r['padded_pairs']:,} | {r['forward_s']:.3f} | {r['backward_s']:.3f} | {r['gflops']:.1f} "
              f"| {versus:.2f} |", file=out)


def _timed(function, repeats):
    """The best of `repeats` timed calls after a warm-up (allocator, plans, caches): on a shared machine the
    fastest run is the one least disturbed by other work."""
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def _calibration_rank(rank, world_size, args, seq_length, repeats=4):
    """This rank's rates at `seq_length`, measured in the bench's own ranks just before and just after their steps (same load; `_least_disturbed`
    keeps the faster of the two):
    the model's linear layers (forward+backward, FLOP/s), the attention kernel on a one-rank BDLM mask with
    as many rows as a CSBP rank holds, and the backend's all-gather of CSBP's forward K/V alone."""
    from megatron_csbp.core import comm
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.core.ops import context_sharded_block_attention

    h, heads, groups = args.hidden_size, args.num_attention_heads, args.num_query_groups
    d, ffn, rows = h // heads, args.ffn_hidden_size, seq_length
    shapes = [(h, (heads + 2 * groups) * d), (heads * d, h), (h, ffn), (ffn, h)]
    weights = [torch.randn(n_out, n_in, requires_grad=True) for n_in, n_out in shapes]
    inputs = [torch.randn(rows, n_in, requires_grad=True) for n_in, _ in shapes]

    def linear():
        sum(torch.nn.functional.linear(x, w).sum() for x, w in zip(inputs, weights)).backward()

    shape = flops.ModelShape(1, h, heads, num_query_groups=groups, kv_channels=d, ffn_hidden_size=ffn)
    linear_flops = rules.step_passes() * rows * flops.linear_flops_per_row(shape)
    linear_s = _timed(linear, repeats)

    layout = CSBPLayout(seq_length // 2, args.block_size, 1, 1)
    q = torch.randn(layout.num_rows, 1, heads, d, requires_grad=True)
    k, v = (torch.randn(layout.num_rows, 1, groups, d, requires_grad=True) for _ in range(2))
    attention_flops = rules.step_passes() * flops.bdlm_attention_pairs(seq_length // 2, args.block_size) \
        * flops.attention_flops_per_pair(heads, d)
    attention_s = _timed(lambda: context_sharded_block_attention(q, k, v, layout).sum().backward(), repeats)

    shard = torch.randn(seq_length // (2 * world_size), 2, args.micro_batch_size, groups, d)
    tiny = torch.zeros(1)
    with comm.count_bytes() as counter:
        gather_s = _timed(lambda: comm.all_gather_start(shard, None)[1].wait(), repeats)
    gather_bytes = counter.bytes_sent // (repeats + 1)  # the warm-up's call counts too
    latency_s = _timed(lambda: comm.all_gather_start(tiny, None)[1].wait(), 4 * repeats)
    return dict(linear_gflops=linear_flops / linear_s / 1e9, attention_gflops=attention_flops / attention_s / 1e9,
                gather_bytes=gather_bytes, gather_s=gather_s, latency_s=latency_s)


def combine_calibrations(per_rank):
    """The machine as the planner sees it: the slowest rank's rates, the backend's link as the ranks saw it."""
    slowest = lambda key: min(r[key] for r in per_rank)
    gather_s = max(r["gather_s"] for r in per_rank)
    latency_s = max(r["latency_s"] for r in per_rank)
    return dict(linear_gflops=slowest("linear_gflops"), attention_gflops=slowest("attention_gflops"),
                gather_s=gather_s, latency_s=latency_s,
                backend_gb_s=per_rank[0]["gather_bytes"] / max(gather_s - latency_s, 1e-9) / 1e9)


def machine(calibration, link_gbps=None, link_latency_us=0.0):
    """A `plan.GPU` for this machine at one length: measured rates, and the simulated link where it is
    slower than the backend's own (a collective lasts the longer of the two)."""
    from megatron_csbp.tools import plan

    link_gb_s, latency_us = calibration["backend_gb_s"], calibration["latency_s"] * 1e6
    if link_gbps:
        link_gb_s, latency_us = min(link_gb_s, link_gbps / 8), max(latency_us, link_latency_us)
    return plan.GPU("this machine", bf16_tflops=calibration["linear_gflops"] / 1e3, achievable_fraction=1.0,
                    attention_fraction=calibration["attention_gflops"] / calibration["linear_gflops"],
                    hbm_gb=1e6, nvlink_gb_s=link_gb_s, internode_gb_s=link_gb_s, link_latency_us=latency_us,
                    tile=1)  # the calibration's rate is per real pair


def predict_record(args, record, calibration):
    """The planner's step for a bench record, on this machine as calibrated."""
    from megatron_csbp.tools import plan

    model = plan.Model(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                       ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.vocab_size,
                       seq_length=record["seq_length"], block_size=args.block_size, bytes_per_elem=4,
                       recompute=None if record["recompute"] == "none" else record["recompute"],
                       micro_batch_size=args.micro_batch_size, transport=args.csbp_transport)
    nproc, mode = record["nproc"], record["mode"]
    clean_shards = rules.clean_shards(mode, nproc)
    cluster = plan.Cluster(nproc, nproc, machine(calibration, record["link_gbps"], record["link_latency_us"] or 0))
    return plan.predict(model, cluster, plan.Topology(mode, 1, 1, nproc, clean_shards, 1))


def _link_label(record) -> str:
    if not record["overlap"]:
        return "backend, serialised"
    return "backend" if record["link_gbps"] is None else f"{record['link_gbps']:g} Gb/s"


def baseline(records):
    """The records measured on the backend's own link, with overlap (the main table's)."""
    return [r for r in records if r.get("link_gbps") is None and r.get("overlap", True) and r["mode"] in MODES]


def step_ratio(record, cp, times="step_times_s"):
    """A step time (`times`: "step_times_s" wall clock, "cpu_times_s" CPU) against CP's. Interleaved, the median
    over rounds of each round's ratio: the two steps of a round ran side by side, so a slow spell of the machine
    divides out. Otherwise the ratio of the medians."""
    if record.get("interleaved") and cp.get("interleaved"):
        return statistics.median(a / b for a, b in zip(record[times], cp[times]))
    summary = {"step_times_s": "step_time_s", "cpu_times_s": "cpu_time_s"}[times]
    return record[summary] / cp[summary]


def print_table(records, out=None):
    out = out or sys.stdout
    header = (f"{'mode':<10} {'L':>7} {'rows/rank':>9} {'bytes/rank':>12} {'vs CP':>6} {'step (s)':>9} "
              f"{'vs CP':>6} {'CPU (s)':>8} {'vs CP':>6} {'exposed (s)':>11} {'share':>6} {'peak mem (MiB)':>14} "
              f"{'saved act (MiB)':>15} "
              f"{'pairs/rank':>12} {'tokens/s':>9} {'load':>5} {'kernels':>13} {'calls':>5} {'real pairs':>12} "
              f"{'computed':>12} {'comp/real':>9}")
    print("CP = the field's conventional CP (mode cp); kernels, calls, real and computed pairs: one layer's forward "
          "on the rank computing most, per head and sample, counted off the kernels' plans; CPU: the step's CPU "
          "seconds (the busiest rank's; not time waiting for a core or a peer); load: the load average during the "
          "run", file=out)
    if any(r.get("interleaved") for r in records):
        print("interleaved: each length's modes in the same ranks, steps alternating; step vs CP: the median of the "
              "rounds' ratios; peak mem: exact tensor bytes of one step (not the RSS growth of a run of its own)",
              file=out)
    print(header, file=out)
    print("-" * len(header), file=out)
    by_key = {(r["mode"], r["seq_length"]): r for r in records}
    for r in records:
        cp = by_key.get((BASELINE, r["seq_length"]))
        byte_ratio = f"{r['bytes_sent_per_rank'] / cp['bytes_sent_per_rank']:.3f}" if cp and cp["bytes_sent_per_rank"] else "-"
        time_ratio = f"{step_ratio(r, cp):.3f}" if cp else "-"
        cpu_ratio = f"{step_ratio(r, cp, 'cpu_times_s'):.3f}" if cp else "-"
        print(f"{r['mode']:<10} {r['seq_length']:>7} {r['rows_per_rank']:>9} {r['bytes_sent_per_rank']:>12,} "
              f"{byte_ratio:>6} {r['step_time_s']:>9.3f} {time_ratio:>6} {r['cpu_time_s']:>8.3f} {cpu_ratio:>6} "
              f"{r['exposed_comm_s']:>11.3f} "
              f"{r['exposed_share']:>6.1%} {r['peak_memory_bytes'] / 2**20:>14.1f} "
              f"{r['saved_activation_bytes'] / 2**20:>15.1f} {r['attention_pairs_per_rank']:>12,} "
              f"{r['tokens_per_s']:>9.0f} {r.get('load_average', float('nan')):>5.1f} {r['kernels']:>13} "
              f"{r['kernel_calls']:>5} {r['kernel_real_pairs']:>12,} {r['kernel_computed_pairs']:>12,} "
              f"{r['kernel_computed_pairs'] / r['kernel_real_pairs']:>9.3f}", file=out)


def print_transport_memory(records, out=None):
    """Peak tensor memory per rank under each transport (`--transport-memory`), the largest rank's."""
    out = out or sys.stdout
    rows = [r for r in records if TRANSPORT_MEMORY_KEYS[0] in r]
    if not rows:
        return
    print("\ntransport memory: peak tensor MiB per rank (largest rank), collective / streaming", file=out)
    header = (f"{'mode':<10} {'L':>7} {'ranks':>5} {'C':>3} {'transport':<10} {'step':>9} {'attention fwd':>13} "
              f"{'attention fwd+bwd':>17}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        for transport in rules.TRANSPORTS:
            step, forward, both = (r[f"{transport}_{part}_peak_bytes"] / 2**20
                                   for part in ("step", "attention_forward", "attention"))
            clean_shards = layout_of(r["mode"], r["seq_length"], r["block_size"], r["nproc"], 0).clean_shards
            print(f"{r['mode']:<10} {r['seq_length']:>7} {r['nproc']:>5} {clean_shards:>3} {transport:<10} "
                  f"{step:>9.1f} {forward:>13.1f} {both:>17.1f}", file=out)


def print_link_sweep(records, out=None):
    """Step time and exposed communication of each mode as the link slows, and CSBP / CP."""
    out = out or sys.stdout
    rows = [r for r in records if r["mode"] in MODES and r["overlap"]]
    links = sorted({r["link_gbps"] for r in rows}, key=lambda g: -(g or float("inf")))
    if len(links) < 2:
        return
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    print("\nsimulated link sweep: step s (exposed comm s, share of the step)", file=out)
    print(f"{'L':>7} {'link':>10} " + " ".join(f"{m:>22}" for m in modes) + f" {'CSBP/CP':>8}", file=out)
    by_key = {(r["mode"], r["seq_length"], r["link_gbps"]): r for r in rows}
    for length in sorted({r["seq_length"] for r in rows}):
        for gbps in links:
            cells, found = [], {}
            for mode in modes:
                r = by_key.get((mode, length, gbps))
                found[mode] = r
                cells.append(f"{r['step_time_s']:8.3f} ({r['exposed_comm_s']:6.3f}, {r['exposed_share']:4.0%})"
                             if r else f"{'-':>22}")
            ratio = (f"{found['csbp']['step_time_s'] / found[BASELINE]['step_time_s']:8.3f}"
                     if found.get("csbp") and found.get(BASELINE) else f"{'-':>8}")
            label = "backend" if gbps is None else f"{gbps:g} Gb/s"
            print(f"{length:>7} {label:>10} " + " ".join(cells) + f" {ratio}", file=out)


def print_overlap(records, out=None):
    """Exposed communication with the overlap and with every collective waited for at issue: the difference is
    what the local noisy attention hid."""
    out = out or sys.stdout
    serial = {(r["mode"], r["seq_length"]): r for r in records if r["mode"] in MODES and not r["overlap"]}
    if not serial:
        return
    print("\noverlap check (backend link): exposed comm s with overlap | serialised (the collectives alone) | hidden",
          file=out)
    for r in baseline(records):
        s = serial.get((r["mode"], r["seq_length"]))
        if s is None or not s["bytes_sent_per_rank"]:
            continue
        hidden = s["exposed_comm_s"] - r["exposed_comm_s"]
        print(f"  {r['mode']:<10} L={r['seq_length']:<6} {r['exposed_comm_s']:7.3f} | {s['exposed_comm_s']:7.3f} | "
              f"{hidden:7.3f} s ({hidden / max(s['exposed_comm_s'], 1e-12):.0%} of the collectives' time); step "
              f"{r['step_time_s']:.3f} s vs {s['step_time_s']:.3f} s serialised", file=out)


def print_calibrations(records, out=None):
    """Each spawned run's calibration (measured in its ranks before and after its steps, the faster kept)."""
    out = out or sys.stdout
    print("\ncalibration (in each run's ranks, best of 4): linear GFLOP/s, attention kernel GFLOP/s, backend "
          "all-gather GB/s + latency", file=out)
    for r in records:
        c = r.get("calibration")
        if c and r["link_gbps"] is None and r["overlap"]:
            print(f"  {r['mode']:<10} L={r['seq_length']:<6} {c['linear_gflops']:6.1f} {c['attention_gflops']:6.1f} "
                  f"{c['backend_gb_s']:6.2f} + {c['latency_s'] * 1e6:.0f} us", file=out)


def print_predictions(records, predictions, out=None):
    """The calibrated planner beside every measured step (its fastest: the planner models an undisturbed
    machine, and the calibration takes the best of its runs too); returns the largest relative error."""
    out = out or sys.stdout
    print("\nplanner (calibrated on this machine) vs bench: fastest measured step s", file=out)
    print(f"  {'mode':<10} {'L':>7} {'link':>20} {'measured':>9} {'predicted':>9} {'error':>7}   "
          f"{'exposed meas.':>13} {'pred.':>7}", file=out)
    worst = 0.0
    for r, q in zip(records, predictions):
        error = q.step_time_s / r["best_step_time_s"] - 1
        worst = max(worst, abs(error))
        print(f"  {r['mode']:<10} {r['seq_length']:>7} {_link_label(r):>20} {r['best_step_time_s']:>9.3f} "
              f"{q.step_time_s:>9.3f} {error:>+7.1%}   {r['best_exposed_comm_s']:>13.3f} {q.exposed_attention_s:>7.3f}",
              file=out)
    print(f"  largest |error| {worst:.1%}", file=out)
    return worst


def print_scaling(records, out=None):
    """How each mode's cost grows between its two longest lengths, where attention dominates:
    activations per rank ~ L (L/C of clean rows), step time ~ L²."""
    out = out or sys.stdout
    for mode in MODES:
        points = sorted((r["seq_length"], r) for r in records if r["mode"] == mode)
        if len(points) < 2:
            continue
        (short, first), (long, last) = points[-2], points[-1]
        growth = long / short
        print(f"{mode}: L {short} -> {long} (x{growth:g}): saved activations per rank "
              f"x{last['saved_activation_bytes'] / first['saved_activation_bytes']:.2f} (linear x{growth:g}), "
              f"peak memory x{last['peak_memory_bytes'] / max(first['peak_memory_bytes'], 1):.2f}, "
              f"step time x{last['step_time_s'] / first['step_time_s']:.1f} (quadratic x{growth ** 2:g})", file=out)


def plot_links(records, path):
    """Step time against the simulated link speed, one panel per length, with CSBP / CP beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r["mode"] in MODES and r["overlap"] and r["link_gbps"]]
    lengths = sorted({r["seq_length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths) + 1, figsize=(5 * (len(lengths) + 1), 4), squeeze=False)
    for axis, length in zip(axes[0], lengths):
        for mode in MODES:
            points = sorted((r["link_gbps"], r["step_time_s"]) for r in rows
                            if r["mode"] == mode and r["seq_length"] == length)
            if points:
                axis.plot(*zip(*points), marker="o", label=mode)
        axis.set_title(f"step time (s), L = {length}")
    ratio_axis = axes[0][-1]
    for length in lengths:
        by = {(r["mode"], r["link_gbps"]): r["step_time_s"] for r in rows if r["seq_length"] == length}
        points = sorted((g, by["csbp", g] / by[BASELINE, g]) for m, g in by if m == "csbp" and (BASELINE, g) in by)
        if points:
            ratio_axis.plot(*zip(*points), marker="o", label=f"L = {length}")
    ratio_axis.axhline(1.0, color="grey", linewidth=0.8)
    ratio_axis.set_title("CSBP / CP step time")
    for axis in axes[0]:
        axis.set_xscale("log")
        axis.set_xlabel("simulated link (Gb/s)")
        axis.grid(True, alpha=0.3)
        axis.legend()
    fig.suptitle(f"simulated link sweep, {rows[0]['nproc']} ranks, block size {rows[0]['block_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("step_time_s", "step time (s)"), ("bytes_sent_per_rank", "attention bytes sent per rank"),
              ("peak_memory_bytes", "peak memory growth (bytes)"), ("saved_activation_bytes", "saved activations (bytes)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for axis, (key, title) in zip(axes, panels):
        for mode in MODES:
            points = sorted((r["seq_length"], r[key]) for r in records if r["mode"] == mode)
            if points:
                axis.plot(*zip(*points), marker="o", label=mode)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("clean sequence length L")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    nproc = records[0]["nproc"]
    fig.suptitle(f"CSBP vs conventional CP vs pure BP, {nproc} ranks, block size {records[0]['block_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def random_packing(seq_length, block_size, generator, shortest=256, longest=16384):
    """`Documents` of one packed sample: lengths log-uniform in [shortest, longest], rounded up to blocks."""
    from megatron_csbp.core.documents import Documents

    starts, position = [0], 0
    while True:
        length = math.exp(generator.uniform(math.log(shortest), math.log(min(longest, seq_length))))
        position += -(-int(length) // block_size) * block_size
        if position >= seq_length:
            return Documents(seq_length, tuple(starts))
        starts.append(position)


def document_balance(args):
    """Records of max/mean real attention pairs per rank over `--document-balance` random packings."""
    import random

    from megatron_csbp.core.documents import document_balanced_schedule, rank_pairs
    from megatron_csbp.core.layout import CPLayout, CSBPLayout

    records, generator, P = [], random.Random(0), args.nproc
    for seq_length in args.seq_lengths:
        packings = [random_packing(seq_length, args.block_size, generator) for _ in range(args.document_balance)]
        shards = sorted({P, *(c for c in (2, 1) if P % c == 0)}, reverse=True)
        for C in shards:
            layouts = [CSBPLayout(seq_length, args.block_size, P, C, r) for r in range(P)]
            static, balanced, seconds = [], [], []
            for documents in packings:
                pairs = rank_pairs(layouts, documents)
                static.append(max(pairs) * P / sum(pairs))
                started = time.perf_counter()
                table = document_balanced_schedule(layouts[0], documents)
                seconds.append(time.perf_counter() - started)
                pairs = rank_pairs([layout.dealt(table) for layout in layouts], documents)
                balanced.append(max(pairs) * P / sum(pairs))
            records.append(dict(seq_length=seq_length, nproc=P, clean_shards=C, packings=len(packings),
                                static_mean=statistics.mean(static), static_worst=max(static),
                                balanced_mean=statistics.mean(balanced), balanced_worst=max(balanced),
                                deal_seconds=statistics.mean(seconds)))
        cp = [rank_pairs([CPLayout(seq_length, args.block_size, P, r) for r in range(P)], d) for d in packings]
        ratios = [max(pairs) * P / sum(pairs) for pairs in cp]
        records.append(dict(seq_length=seq_length, nproc=P, clean_shards="cp", packings=len(packings),
                            static_mean=statistics.mean(ratios), static_worst=max(ratios)))
    return records


def print_document_balance(records, out=None):
    out = out or sys.stdout
    print("packed documents (256..16K tokens, log-uniform): max/mean real attention pairs per rank", file=out)
    print(f"{'L':>8} {'P':>3} {'C':>4} {'packings':>8} {'static mean':>11} {'worst':>6} {'balanced mean':>13} "
          f"{'worst':>6} {'deal s':>7}", file=out)
    for r in records:
        balanced = (f"{r['balanced_mean']:>13.3f} {r['balanced_worst']:>6.3f} {r['deal_seconds']:>7.3f}"
                    if "balanced_mean" in r else f"{'(zigzag chunks, not dealt)':>28}")
        print(f"{r['seq_length']:>8} {r['nproc']:>3} {r['clean_shards']!s:>4} {r['packings']:>8} "
              f"{r['static_mean']:>11.3f} {r['static_worst']:>6.3f} {balanced}", file=out)


def main(argv=None):
    args = parse_args(argv)
    if args.document_balance:
        records = document_balance(args)
        print_document_balance(records)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(records, handle, indent=2)
        return records
    records = []
    runs = [(seq_length, None) for seq_length in args.seq_lengths] if args.interleave else \
        [(seq_length, mode) for seq_length in args.seq_lengths for mode in args.modes]
    for seq_length, mode in runs:
        what = f"{mode or ','.join(args.modes)} L={seq_length}"
        load_before = os.getloadavg()[0]
        run = summarise(_spawn_interleaved(args, seq_length) if mode is None else _spawn_run(args, mode, seq_length))
        load = max(load_before, os.getloadavg()[0])  # the 1-minute average, before and at the end of the run
        records += [dict(r, load_average=load) for r in run]
        warning = load_warning(load)
        if warning:
            print(f"{what}: {warning}", file=sys.stderr)
        if args.json:  # kept up to date, so a long sweep cut short keeps what it measured
            with open(args.json, "w") as handle:
                json.dump(records, handle, indent=2)
        print(f"measured {what}: " + ", ".join(
            f"{r['mode']} {_link_label(r)} {r['step_time_s']:.3f} s/step" for r in run), file=sys.stderr)
    main_records = baseline(records)
    for record in main_records:
        cp = next((r for r in main_records if r["mode"] == BASELINE and r["seq_length"] == record["seq_length"]), None)
        record["step_vs_cp"] = step_ratio(record, cp) if cp else None
        record["cpu_vs_cp"] = step_ratio(record, cp, "cpu_times_s") if cp else None
    print_table(main_records)
    for seq_length in args.seq_lengths:
        by_mode = {r["mode"]: r for r in main_records if r["seq_length"] == seq_length}
        if "csbp" in by_mode and BASELINE in by_mode:
            csbp, cp = by_mode["csbp"], by_mode[BASELINE]
            print(f"L={seq_length}: CSBP/CP bytes {csbp['bytes_sent_per_rank'] / cp['bytes_sent_per_rank']:.3f}, "
                  f"step time {step_ratio(csbp, cp):.3f} (CPU {step_ratio(csbp, cp, 'cpu_times_s'):.3f}), "
                  f"exposed comm {csbp['exposed_comm_s']:.3f} vs {cp['exposed_comm_s']:.3f} s, "
                  f"saved activations {csbp['saved_activation_bytes'] / cp['saved_activation_bytes']:.3f}, "
                  f"peak memory {csbp['peak_memory_bytes'] / max(cp['peak_memory_bytes'], 1):.3f}, "
                  f"computed pairs {csbp['kernel_computed_pairs'] / cp['kernel_computed_pairs']:.3f}")
    print_scaling(main_records)
    print_experts(args, main_records)
    print_transport_memory(main_records)
    print_link_sweep(records)
    print_overlap(records)
    if args.predict or args.calibrate_from:
        measured = [r for r in records if r["overlap"]]  # the planner models the overlapped ops
        held_out = getattr(args, "held_out_calibration", None)
        if held_out:
            print(f"held-out prediction: every step predicted from the calibration of {held_out['origin']}")
        predictions = [predict_record(args, r, held_out or r["calibration"]) for r in measured]
        for r, q in zip(measured, predictions):
            r["predicted_step_time_s"], r["predicted_exposed_comm_s"] = q.step_time_s, q.exposed_attention_s
        print_calibrations(records)
        print_predictions(measured, predictions)
    if args.kernel_check:
        efficiency = kernel_efficiency(max(args.seq_lengths), args.block_size)
        records.append(dict(mode="kernel", nproc=1, **efficiency))
        print(f"CPU kernel at L={efficiency['seq_length']} (1 thread, thread CPU time, load average "
              f"{efficiency['load_average']:.1f}): forward {efficiency['attention_forward_gflops']:.1f} GFLOP/s = "
              f"{efficiency['forward_fraction']:.0%} of dense matmul {efficiency['matmul_gflops']:.1f} GFLOP/s "
              f"(the prefix kernel alone {efficiency['prefix_forward_fraction']:.0%}); forward+backward "
              f"{efficiency['attention_train_gflops']:.1f} GFLOP/s = {efficiency['train_fraction']:.0%}")
        plans = kernel_plans_check(max(args.seq_lengths), args.block_size, args.nproc, args.num_attention_heads,
                                   args.num_query_groups, args.hidden_size // args.num_attention_heads)
        records += [dict(r, mode=f"kernel-{r['mode']}") for r in plans]
        print_kernel_plans(plans)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=2)
    if args.plot:
        plot(main_records, args.plot)
        print(f"plot written to {args.plot}")
    if args.link_plot:
        if not args.link_gbps:
            print("--link-plot needs --link-gbps; no link plot written", file=sys.stderr)
        else:
            plot_links(records, args.link_plot)
            print(f"link plot written to {args.link_plot}")
    return records


if __name__ == "__main__":
    main()
