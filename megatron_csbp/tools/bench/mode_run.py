"""One mode's run in freshly spawned ranks: its model, data and noise on each rank, its timed forward+backward
steps under every condition the command asks for, and what each rank measures of them (`records.RankRecord`)."""

import contextlib
import dataclasses
import time

import torch

from megatron_csbp.tools.bench import calibration, memory
from megatron_csbp.tools.bench.cli import run_config
from megatron_csbp.tools.bench.experts import MoERouting, moe_config, optimizer_state
from megatron_csbp.tools.bench.records import Condition, RankRecord


def rank_attention_pairs(layout) -> int:
    """Query-key pairs the BDLM mask lets this rank's rows see, per head, layer and sample: each row's clean keys
    below its limit (the clean-attention rule's), and a noisy row's own block."""
    return int(layout.row_limits.sum()) + layout.num_noisy_rows * layout.block_size


def kernel_work(layout, transport) -> tuple:
    """The attention kernel calls (`core.kernel_work.KernelCall`) of one layer's forward on this rank under
    `transport`, per head and sample, counted off the CPU kernels' own plans for `layout` (their masks and tiles:
    flex's 128 for the masked call): one remote call against all keys, or one per ring member's shard where the
    transport calls per member (streaming)."""
    from megatron_csbp.core import ops, transports
    from megatron_csbp.core.kernels import CPUKernels

    plan = ops.ring_plan(layout, torch.device("cpu"), CPUKernels())
    return plan.kernel_calls(per_member=transports.transport(transport).call_per_member)


def conditions(args) -> list[Condition]:
    """What each spawned run measures, in order: the backend's link, each simulated link, and serialised."""
    measured = [Condition()] + [Condition(gbps, args.link_latency_us) for gbps in args.link_gbps]
    return measured + ([Condition(overlap=False)] if args.overlap_check else [])


class ModeRun:
    """One mode's model, data and noise on this rank, and its timed step: what a (mode, length) run measures,
    whether its ranks measure only it or every mode in turn (`interleaved`). `mode`: its name (ranks are
    spawned processes; the run is the trainer's `RunConfig`, `cli.run_config`)."""

    def __init__(self, rank, args, mode, seq_length):
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        from megatron_csbp.bdlm.forward_step import BDLMForwardStep
        from megatron_csbp.bdlm.objective import BDLMObjective
        from megatron_csbp.core.device import default_device
        from megatron_csbp.mcore import parallel_state
        from megatron_csbp.mcore.model import model_provider

        run = run_config(args, mode, seq_length)
        self.mode, self.seq_length, self.rank, self.args = mode, seq_length, rank, args
        self.device = device = default_device()
        self.clean_shards, P = run.clean_shards, run.block_parallel_size
        if not parallel_state.is_initialized():
            parallel_state.initialize_model_parallel(
                context_block_parallel_size=P, clean_shards=self.clean_shards,
                expert_model_parallel_size=args.expert_model_parallel_size,
                expert_tensor_parallel_size=args.expert_tensor_parallel_size)
        elif parallel_state.get_clean_shards() != self.clean_shards:  # this mode's rings, in Megatron's CP groups
            parallel_state.initialize_block_parallel_groups(self.clean_shards)
        self.group = parallel_state.get_block_parallel_groups()
        self.layout = layout = run.layout(mpu.get_context_parallel_rank())
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
            if args.recompute_granularity == "full" else dict(recompute_granularity=args.recompute_granularity)
        self.config = config = TransformerConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
            context_parallel_size=P, normalization="RMSNorm", use_cpu_initialization=True,
            calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0, **recompute,
            **moe_config(args))
        mask_token = args.vocab_size - 1

        def build_model(transport, logits_tile_rows=run.logits_tile_rows):
            torch.manual_seed(1234)
            model_parallel_cuda_manual_seed(1234)
            return model_provider(config=config, layout=layout, vocab_size=args.vocab_size,
                                  mask_token_id=mask_token, group=self.group, transport=transport,
                                  logits_tile_rows=logits_tile_rows).to(device)

        self.build_model = build_model
        self.model = build_model(run.transport)
        self.transport = run.transport
        self.routing = MoERouting(self.model, args) if args.num_experts else None
        self.forward_step = BDLMForwardStep(BDLMObjective(block_size=args.block_size, mask_token_id=mask_token,
                                                          seed=7), layout)
        generator = torch.Generator().manual_seed(42)
        self.batch = {"tokens": torch.randint(0, mask_token, (args.micro_batch_size, seq_length),
                                              generator=generator),
                      "sample_index": torch.arange(args.micro_batch_size)}
        self.work = kernel_work(layout, run.transport)
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
            with memory.saved_bytes_hooks(self.saved if not self.saved[0] else [0]):  # not what recompute re-saves
                output, loss_func = self.forward_step(iter([self.batch]), self.model)
                loss_sum, num_tokens, _ = loss_func(output)
            (loss_sum / num_tokens.clamp(min=1)).backward()
        if self.device.type != "cpu":
            torch.accelerator.synchronize()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        self.model.zero_grad(set_to_none=True)
        counter.all_to_all_bytes, counter.all_to_all_calls = exchanged.bytes_sent, exchanged.calls
        return elapsed, cpu, counter

    def record(self, times, cpu_times, waits, counter, peak_memory_bytes, condition) -> RankRecord:
        """The record of this mode's measured steps under one condition (the last step's byte counters)."""
        args, config = self.args, self.config
        return RankRecord(
            rank=self.rank, condition=condition, bytes_sent=counter.bytes_sent,
            step_times_s=tuple(times), cpu_times_s=tuple(cpu_times), waits_s=tuple(waits),
            peak_memory_bytes=peak_memory_bytes, saved_activation_bytes=self.saved[0], rows=self.layout.num_rows,
            attention_pairs=rank_attention_pairs(self.layout) * config.num_attention_heads * config.num_layers
            * args.micro_batch_size, kernel_work=self.work, all_to_all_bytes=counter.all_to_all_bytes,
            all_to_all_calls=counter.all_to_all_calls, routing=self.routing.record() if self.routing else None)

    def optimizer_state(self):
        """The distributed optimizer's state of this rank (a MoE model; else None)."""
        return optimizer_state(self.model, self.config) if self.routing else None


def measure(rank, args, mode, seq_length) -> list[RankRecord]:
    """This rank's records of `mode` at `seq_length`, one per condition (`conditions`)."""
    import psutil

    from megatron_csbp.core import comm
    from megatron_csbp.mcore import parallel_state

    baseline_rss = psutil.Process().memory_info().rss
    run = ModeRun(rank, args, mode, seq_length)
    if run.device.type != "cpu":
        torch.get_device_module(run.device).reset_peak_memory_stats(run.device)
    for _ in range(args.warmup):
        run.step()
    records = []
    for condition in conditions(args):
        times, cpu_times, waits = [], [], []
        gbps = condition.link_gbps
        link = comm.simulated_link(gbps, args.link_latency_us) if gbps else contextlib.nullcontext()
        with link, contextlib.nullcontext() if condition.overlap else comm.serialised():
            for _ in range(args.steps):
                elapsed, cpu, counter = run.step()
                times.append(elapsed)
                cpu_times.append(cpu)
                waits.append(counter.wait_s)
        records.append(run.record(times, cpu_times, waits, counter, memory.peak_memory(run.device, baseline_rss),
                                  condition))
    state = run.optimizer_state()  # once, after every condition's steps
    records = [dataclasses.replace(record, optimizer_state=state) for record in records]
    if args.transport_memory and run.clean_shards > 1:
        del run.model
        peaks = memory.transport_memory(run.build_model, run.forward_step, run.batch, run.layout, run.group,
                                        run.config, args.micro_batch_size, run.device)
        records = [dataclasses.replace(record, transport_memory=peaks) for record in records]
    if args.logits_memory:
        run.model = None
        logits = memory.logits_memory(lambda tile: run.build_model(run.transport, tile), run.forward_step, run.batch,
                                      args.micro_batch_size, run.device, args.cross_entropy_tile_rows)
        records = [dataclasses.replace(record, logits_memory=logits) for record in records]
    parallel_state.destroy_model_parallel()
    return records


def rank_run(rank, world_size, args, mode, seq_length) -> list[RankRecord]:
    """One (mode, length) on this rank, inside the CPU backend (a no-op on accelerators); with `--predict` the
    machine's rates calibrated before and after the steps, the faster kept (`RankCalibration.least_disturbed`)."""
    from megatron_csbp.mcore import cpu_backend

    with cpu_backend.active():
        before = calibration.calibrate(world_size, args, seq_length) if args.predict else None
        records = measure(rank, args, mode, seq_length)
        rates = before.least_disturbed(calibration.calibrate(world_size, args, seq_length)) if before else None
    return [dataclasses.replace(record, calibration=rates) for record in records]


def spawn_run(args, mode, seq_length) -> list[list[RankRecord]]:
    """Every rank's records of one (mode, length) run in freshly spawned ranks (by rank, then condition)."""
    from megatron_csbp.training.launch import run_ranks

    return run_ranks(rank_run, args.nproc, args, mode, seq_length, timeout=args.run_timeout)
