"""The pretraining command (`scripts/pretrain_bdlm.py`, one process per rank): its refusals and its failures.

    torchrun --nproc-per-node 2 scripts/pretrain_bdlm.py --config configs/tiny_cpu.yaml [key=value ...]

`main(argv)` prepares the run with `loops.prepare` (the loop, the validated arguments) and runs it.
Exit status: 0 done (or saved and stopped on a signal / exit condition), 2 refused input (one line, before
any work), 1 a failure: that rank prints `rank R failed: ...` and leaves at once, so the launcher (torchrun,
`srun --kill-on-bad-exit`) stops the others, and any rank caught in a collective with it gives up within
`--distributed-timeout-minutes`, naming the failed rank when it could announce itself.

The script calls `supervision.die_with_launcher()` when imported, before this runs: the ranks' spawned
helpers import the script, not this module.
"""

import datetime
import os
import sys
import traceback

from megatron_csbp.core import supervision

_FAILED_RANK_KEY = "megatron_csbp/failed_rank"


def _announce_failure(rank: int, error: BaseException) -> str:
    """Tells the other ranks (through the rendezvous store) who failed; returns who failed first."""
    import torch.distributed as dist

    mine = f"rank {rank} failed: {type(error).__name__}: {' '.join(str(error).split())}"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=5))
        first = store.compare_set(_FAILED_RANK_KEY, "", mine).decode()
        if first != mine and f"rank {rank} " not in first:
            return f"rank {rank} stopping: {first} (this rank then saw {type(error).__name__}: " \
                   f"{' '.join(str(error).split())[:300]})"
    except Exception:  # no store (rank 0 gone, or no process group): say what this rank knows
        pass
    return mine


def main(argv: list[str] | None = None) -> int:
    from megatron_csbp.training import entry, quiet

    argv = sys.argv[1:] if argv is None else list(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    quiet.quiet_start_up()  # before megatron is imported

    from megatron_csbp.training import loops
    from megatron_csbp.core.rules import ConfigError

    run, status = entry.accepted("pretrain_bdlm.py", lambda: loops.prepare(argv, world), rank)
    if status is not None:
        return status

    import torch.distributed as dist

    try:
        run()
    except ConfigError as error:  # refused input found later (data vocabulary, checkpoints): every rank agrees
        if rank == 0:
            print(f"pretrain_bdlm.py: error: {error}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(2)
    except BaseException as error:  # noqa: BLE001 - a failed rank must never leave the others hanging
        if isinstance(error, SystemExit) and error.code in (0, None):
            raise
        traceback.print_exc()
        print(_announce_failure(rank, error), file=sys.stderr, flush=True)
        sys.stdout.flush()
        supervision.end_helper_processes()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0

