"""`python -m megatron_csbp.bench`: the runs the command line asks for, their tables and plots, and the JSON."""

import dataclasses
import json
import os
import sys

from megatron_csbp.tools.bench import calibration, cli, document_balance, kernel_check, plots, report
from megatron_csbp.tools.bench.experts import print_experts
from megatron_csbp.tools.bench.interleaved import spawn_interleaved
from megatron_csbp.tools.bench.mode_run import spawn_run
from megatron_csbp.tools.bench.records import PlannerStep, summarise


def write_json(path, records):
    with open(path, "w") as handle:
        json.dump([record.record() for record in records], handle, indent=2)


def measured_runs(args, seq_length, mode=None) -> list:
    """The `RunRecord`s of `mode` at `seq_length` (one per condition), or of every mode interleaved (`mode` None)."""
    if mode is None:
        per_rank = spawn_interleaved(args, seq_length)
        return [summarise(list(of_ranks), name, seq_length, args) for name, of_ranks in zip(args.modes, zip(*per_rank))]
    return [summarise(list(of_ranks), mode, seq_length, args) for of_ranks in zip(*spawn_run(args, mode, seq_length))]


def main(argv=None):
    args = cli.parse_args(argv)
    if args.document_balance:
        records = document_balance.document_balance(args)
        document_balance.print_document_balance(records)
        if args.json:
            write_json(args.json, records)
        return [record.record() for record in records]
    records = []
    runs = [(seq_length, None) for seq_length in args.seq_lengths] if args.interleave else \
        [(seq_length, mode) for seq_length in args.seq_lengths for mode in args.modes]
    for seq_length, mode in runs:
        what = f"{mode or ','.join(args.modes)} L={seq_length}"
        load_before = os.getloadavg()[0]
        run = measured_runs(args, seq_length, mode)
        load = max(load_before, os.getloadavg()[0])  # the 1-minute average, before and at the end of the run
        records += [dataclasses.replace(r, load_average=load) for r in run]
        warning = report.load_warning(load)
        if warning:
            print(f"{what}: {warning}", file=sys.stderr)
        if args.json:  # kept up to date, so a long sweep cut short keeps what it measured
            write_json(args.json, records)
        print(f"measured {what}: " + ", ".join(
            f"{r.mode.name} {r.condition.label} {r.step_time_s:.3f} s/step" for r in run), file=sys.stderr)
    records = report.versus_cp(records)
    main_records = [r for r in records if r.condition.is_main]
    report.print_table(main_records)
    report.print_versus_cp(main_records, args.seq_lengths)
    report.print_scaling(main_records)
    print_experts(args, main_records)
    report.print_transport_memory(main_records)
    report.print_logits_memory(main_records)
    report.print_link_sweep(records)
    report.print_overlap(records)
    if args.predict or args.calibrate_from:
        records = predicted(args, records)
    checks = []
    if args.kernel_check:
        efficiency = kernel_check.kernel_efficiency(max(args.seq_lengths), args.block_size)
        kernel_check.print_efficiency(efficiency)
        plans = kernel_check.kernel_plans_check(cli.kernel_check_runs(args), args.num_attention_heads,
                                                args.num_query_groups, args.hidden_size // args.num_attention_heads)
        kernel_check.print_kernel_plans(plans)
        checks = [efficiency, *plans]
    if args.json:
        write_json(args.json, records + checks)
    if args.plot:
        plots.plot([r for r in records if r.condition.is_main], args.plot)
        print(f"plot written to {args.plot}")
    if args.link_plot:
        if not args.link_gbps:
            print("--link-plot needs --link-gbps; no link plot written", file=sys.stderr)
        else:
            plots.plot_links(records, args.link_plot)
            print(f"link plot written to {args.link_plot}")
    return [record.record() for record in records + checks]


def predicted(args, records) -> list:
    """`records`, each overlapped one with the calibrated planner's step beside it (`--predict`: its own run's
    calibration; `--calibrate-from`: the one recorded in an earlier run), both tables printed."""
    held_out = args.held_out_calibration
    if held_out:
        print(f"held-out prediction: every step predicted from the calibration of {held_out.origin}")
    # the planner models the overlapped ops
    predictions = [calibration.predict_record(args, r, held_out or r.calibration) if r.condition.overlap else None
                   for r in records]
    calibration.print_calibrations(records)
    measured = [(r, q) for r, q in zip(records, predictions) if q]
    calibration.print_predictions([r for r, _ in measured], [q for _, q in measured])
    return [dataclasses.replace(r, predicted=PlannerStep(q.step_time_s, q.exposed_attention_s)) if q else r
            for r, q in zip(records, predictions)]
