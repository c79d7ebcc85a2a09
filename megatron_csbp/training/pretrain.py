"""The pretraining command (`scripts/pretrain_bdlm.py`, one process per rank): its refusals and its failures.

    torchrun --nproc-per-node 2 scripts/pretrain_bdlm.py --config configs/tiny_cpu.yaml [key=value ...]

`main(argv)` prepares the run with `loops.prepare` (the loop, the validated arguments) and runs it through
`entry.run`. Exit status: 0 done (or saved and stopped on a signal / exit condition), 2 refused input (one
line, before any work), 17 stopped by a guard (`--max-consecutive-bad-steps`: one line naming the last good
checkpoint), 130 Ctrl-C, 1 a failure: that rank prints `rank R failed: ...` and leaves at once, so
the launcher (torchrun, `srun --kill-on-bad-exit`) stops the others, and any rank caught in a collective with
it gives up within `--distributed-timeout-minutes`, naming the failed rank when it could announce itself.

The script calls `supervision.die_with_launcher()` when imported, before this runs: the ranks' spawned
helpers import the script, not this module.
"""

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from megatron_csbp.runtime import entry, quiet

    argv = sys.argv[1:] if argv is None else list(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    quiet.quiet_start_up()  # before megatron is imported

    from megatron_csbp.training import loops

    run, status = entry.accepted("pretrain_bdlm.py", lambda: loops.prepare(argv, world), rank)
    if status is not None:
        return status

    import torch.distributed as dist

    entry.run("pretrain_bdlm.py", rank, world, run)  # returns only when the run is done
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0

