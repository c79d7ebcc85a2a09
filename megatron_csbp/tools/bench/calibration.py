"""The planner against the bench (`--predict`, `--calibrate-from`): the machine's rates, timed in each run's own
ranks just before and just after its steps (under the same load, the faster of the two kept), and the planner's
prediction of every measured step on the machine so calibrated."""

import sys
import time

import torch

from megatron_csbp.core import rules
from megatron_csbp.tools.bench.cli import calibration_run
from megatron_csbp.tools.bench.records import RankCalibration


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


def calibrate(world_size, args, seq_length, repeats=4) -> RankCalibration:
    """This rank's rates at `seq_length`: the model's linear layers (forward+backward, FLOP/s), the attention kernel
    on a one-rank BDLM mask with as many rows as a CSBP rank holds (the run `cli.calibration_run` checks), and the
    backend's all-gather of CSBP's forward K/V alone."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core import comm
    from megatron_csbp.core.ops import context_sharded_block_attention

    run = calibration_run(args, seq_length)
    h, heads, groups = args.hidden_size, args.num_attention_heads, args.num_query_groups
    d, ffn, rows = run.shape.kv_channels, run.shape.ffn_hidden_size, seq_length
    shapes = [(h, (heads + 2 * groups) * d), (heads * d, h), (h, ffn), (ffn, h)]
    weights = [torch.randn(n_out, n_in, requires_grad=True) for n_in, n_out in shapes]
    inputs = [torch.randn(rows, n_in, requires_grad=True) for n_in, _ in shapes]

    def linear():
        sum(torch.nn.functional.linear(x, w).sum() for x, w in zip(inputs, weights)).backward()

    linear_flops = rules.step_passes() * rows * flops.linear_flops_per_row(run.shape)
    linear_s = _timed(linear, repeats)

    layout = run.layout(0)
    q = torch.randn(layout.num_rows, 1, heads, d, requires_grad=True)
    k, v = (torch.randn(layout.num_rows, 1, groups, d, requires_grad=True) for _ in range(2))
    attention_flops = rules.step_passes() * flops.bdlm_attention_pairs(run.seq_length, run.block_size,
                                                                        run.clean_attention) \
        * flops.attention_flops_per_pair(heads, d)
    attention_s = _timed(lambda: context_sharded_block_attention(q, k, v, layout).sum().backward(), repeats)

    shard = torch.randn(seq_length // (2 * world_size), 2, args.micro_batch_size, groups, d)
    tiny = torch.zeros(1)
    with comm.count_bytes() as counter:
        gather_s = _timed(lambda: comm.all_gather_start(shard, None)[1].wait(), repeats)
    gather_bytes = counter.bytes_sent // (repeats + 1)  # the warm-up's call counts too
    latency_s = _timed(lambda: comm.all_gather_start(tiny, None)[1].wait(), 4 * repeats)
    return RankCalibration(linear_flops / linear_s / 1e9, attention_flops / attention_s / 1e9, gather_bytes,
                           gather_s, latency_s)


def machine(calibration, link_gbps=None, link_latency_us=0.0):
    """A `plan.GPU` for this machine at one length: measured rates, and the simulated link where it is
    slower than the backend's own (a collective lasts the longer of the two)."""
    from megatron_csbp.tools import plan

    link_gb_s, latency_us = calibration.backend_gb_s, calibration.latency_s * 1e6
    if link_gbps:
        link_gb_s, latency_us = min(link_gb_s, link_gbps / 8), max(latency_us, link_latency_us)
    return plan.GPU("this machine", bf16_tflops=calibration.linear_gflops / 1e3, achievable_fraction=1.0,
                    attention_fraction=calibration.attention_gflops / calibration.linear_gflops,
                    hbm_gb=1e6, nvlink_gb_s=link_gb_s, internode_gb_s=link_gb_s, link_latency_us=latency_us,
                    tile=1)  # the calibration's rate is per real pair


def predict_record(args, record, calibration):
    """The planner's step (`plan.Prediction`) for a bench `RunRecord`, on this machine as `calibration` measured it."""
    from megatron_csbp.tools import plan

    model = plan.Model(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                       ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.vocab_size,
                       seq_length=record.seq_length, block_size=args.block_size, bytes_per_elem=4,
                       recompute=args.recompute_granularity, micro_batch_size=args.micro_batch_size,
                       transport=record.transport)
    nproc, mode, condition = record.nproc, record.mode, record.condition
    cluster = plan.Cluster(nproc, nproc, machine(calibration, condition.link_gbps, condition.link_latency_us or 0))
    return plan.predict(model, cluster, plan.Topology(mode, 1, 1, nproc, mode.clean_shards(nproc), 1))


def print_calibrations(records, out=None):
    """Each spawned run's calibration (measured in its ranks before and after its steps, the faster kept)."""
    out = out or sys.stdout
    print("\ncalibration (in each run's ranks, best of 4): linear GFLOP/s, attention kernel GFLOP/s, backend "
          "all-gather GB/s + latency", file=out)
    for r in records:
        c = r.calibration
        if c and r.condition.is_main:
            print(f"  {r.mode.name:<10} L={r.seq_length:<6} {c.linear_gflops:6.1f} {c.attention_gflops:6.1f} "
                  f"{c.backend_gb_s:6.2f} + {c.latency_s * 1e6:.0f} us", file=out)


def print_predictions(records, predictions, out=None):
    """The calibrated planner beside every measured step (its fastest: the planner models an undisturbed
    machine, and the calibration takes the best of its runs too); returns the largest relative error."""
    out = out or sys.stdout
    print("\nplanner (calibrated on this machine) vs bench: fastest measured step s", file=out)
    print(f"  {'mode':<10} {'L':>7} {'link':>20} {'measured':>9} {'predicted':>9} {'error':>7}   "
          f"{'exposed meas.':>13} {'pred.':>7}", file=out)
    worst = 0.0
    for r, q in zip(records, predictions):
        error = q.step_time_s / r.best_step_time_s - 1
        worst = max(worst, abs(error))
        print(f"  {r.mode.name:<10} {r.seq_length:>7} {r.condition.label:>20} {r.best_step_time_s:>9.3f} "
              f"{q.step_time_s:>9.3f} {error:>+7.1%}   {r.best_exposed_comm_s:>13.3f} {q.exposed_attention_s:>7.3f}",
              file=out)
    print(f"  largest |error| {worst:.1%}", file=out)
    return worst
