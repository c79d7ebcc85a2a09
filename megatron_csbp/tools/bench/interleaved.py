"""`--interleave`: every mode at one length in the same spawned ranks, their steps alternating (paired), so a slow
spell of a shared host slows every mode alike and the step ratios keep what the modes do."""

import dataclasses

from megatron_csbp.tools.bench.memory import peak_tensor_memory
from megatron_csbp.tools.bench.mode_run import ModeRun
from megatron_csbp.tools.bench.records import Condition, RankRecord

CONDITION = Condition(interleaved=True)  # the backend's own link, overlapped


def rank_interleaved(rank, world_size, args, seq_length) -> list[RankRecord]:
    """Every mode at `seq_length` on this rank, one record per mode (`args.modes`' order). Round r starts at mode r,
    so no mode always follows the same one. Peak memory: each mode's exact tensor bytes in one more step
    (`peak_tensor_memory`), as the process's RSS would mix the modes."""
    from megatron_csbp.mcore import cpu_backend, parallel_state

    with cpu_backend.active():
        runs = [ModeRun(rank, args, mode, seq_length) for mode in args.modes]
        for _ in range(args.warmup):
            for run in runs:
                run.step()
        times, cpu_times, waits, counters = ([[] for _ in runs] for _ in range(4))
        for round_index in range(args.steps):
            start = round_index % len(runs)
            for index in list(range(start, len(runs))) + list(range(start)):
                elapsed, cpu, counter = runs[index].step()
                times[index].append(elapsed)
                cpu_times[index].append(cpu)
                waits[index].append(counter.wait_s)
                counters[index] = counter
        records = []
        for index, run in enumerate(runs):
            with peak_tensor_memory(run.device) as peak:
                run.step()
            state = run.optimizer_state()
            record = run.record(times[index], cpu_times[index], waits[index], counters[index], peak.bytes, CONDITION)
            records.append(dataclasses.replace(record, optimizer_state=state))
        parallel_state.destroy_model_parallel()
    return records


def spawn_interleaved(args, seq_length) -> list[list[RankRecord]]:
    """Every rank's records of every mode at `seq_length` in freshly spawned ranks (by rank, then mode)."""
    from megatron_csbp.runtime.launch import run_ranks

    return run_ranks(rank_interleaved, args.nproc, args, seq_length, timeout=args.run_timeout * len(args.modes))
