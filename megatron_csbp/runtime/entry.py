"""How every command of ours starts and ends: its input checked before any work, a refusal as one line with
exit status 2, Ctrl-C as one line with exit status 130, and, once the input is accepted, the start-up note
(`quiet.start_up_note`) on rank 0; then the work on every rank (`run`), where a guard that stopped the run
(`GuardStop`) is one line with exit status 17 and a failure is one named rank and exit status 1. Pretraining,
generation and evaluation start through `accepted` and run through `run`, so the rules are written once; under
torchrun, ranks that refuse or stop leave together (`leave_together`). A command never leaves its own helper
processes behind (`supervision.end_helper_processes` before every `os._exit`)."""

import datetime
import os
import sys
import time
import traceback

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.runtime import quiet


def accepted(name: str, prepare, rank: int, on_refusal=None):
    """`(prepare(), None)`, or `(None, exit status)` when `prepare` refuses (`ConfigError`: one line on rank 0,
    then `on_refusal()`, e.g. to let the other ranks leave) or is interrupted."""
    try:
        prepared = prepare()
    except ConfigError as error:
        if rank == 0:
            print(f"{name}: error: {error}", file=sys.stderr, flush=True)
        if on_refusal is not None:
            on_refusal()
        return None, 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr, flush=True)
        return None, 130
    note = quiet.start_up_note()
    if note and rank == 0:
        print(note, flush=True)
    return prepared, None


def leave_together(world: int, status: int = 2, timeout_seconds: float = 30.0) -> None:
    """Under torchrun, makes the ranks that refused (every rank refuses the same input) or that a guard stopped
    (at the same iteration) exit at one instant, with `status`; returns only where there is nothing to wait for
    (one rank, or no torchrun store: srun).

    The launcher checks its ranks every 0.1 s and stops those still running once one has failed: a rank that
    refused a moment later than the first would be reported as killed (and the launch as a failure, exit 1)
    instead of as a refusal (exit 2). So each rank announces itself in the launcher's store, the last one sets
    an exit time a little ahead, and all leave then, at once (`os._exit`: no interpreter teardown to differ)."""
    if world == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    import torch.distributed as dist

    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_seconds))
        key = f"megatron_csbp/refused/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        if store.add(key + "/ranks", 1) == world:
            store.set(key + "/at", str(time.time() + 0.2))
        store.wait([key + "/at"])
        time.sleep(max(0.0, float(store.get(key + "/at")) - time.time()))
    except Exception:  # noqa: BLE001 - a rank that never comes (or no store): leave now
        pass
    leave(status)


def leave(status: int) -> None:
    """Ends this process now with `status` (no interpreter teardown, which could wait on a dead peer), its output
    flushed and its helper processes ended first: `os._exit` would orphan them."""
    from megatron_csbp.core import supervision

    sys.stdout.flush()
    sys.stderr.flush()
    supervision.end_helper_processes()
    os._exit(status)


class RankRefusal(ConfigError):
    """A refusal one rank alone meets (e.g. publishing the output file the last rank writes): that rank says it,
    and leaves without waiting for the others, which have finished."""


GUARD_STOP = 17  # Megatron-LM's status for a run stopped on a rejected result (EXIT_CODE_FAILED_ON_RESULT_VALIDATION)


class GuardStop(Exception):
    """A guard stopped the run (e.g. `--max-consecutive-bad-steps` non-finite steps in a row): the program did
    what it promises, so this is no crash; its message says why and names the last good checkpoint. Every rank
    raises it at the same iteration (the ranks decide together), says nothing more than rank 0's one line, and
    leaves with `GUARD_STOP`: not 2, which says the input was refused before any work, and not 1, a failure
    (a scheduler may requeue a failure; a stop like this one repeats until someone changes the run)."""


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
    except Exception:  # noqa: BLE001 - no store (rank 0 gone, or no process group): say what this rank knows
        pass
    return mine


def run(name: str, rank: int, world: int, work) -> int:
    """Runs `work()` on this rank once its input was accepted; the command's exit status.

    0 done (a stop the user asked for, e.g. `--exit-interval`, is done: the loop saved and returned). 2 a refusal
    found only now (`ConfigError`: a checkpoint or data every rank reads alike, so rank 0 says it and the ranks
    leave together; a `RankRefusal` is said by its rank). 17 a guard stopped the run (`GuardStop`: rank 0 says
    it, the ranks leave together). A `SystemExit` (Megatron-LM's own exits, e.g. its rerun state machine's 16 and
    17) keeps its status, without a traceback. 130 Ctrl-C. 1 any other failure: the traceback, then
    `rank R failed: ...` (or, on a rank caught waiting for it, `rank R stopping:` naming the first rank that
    failed, announced through the rendezvous store), the helper processes ended, and an immediate exit, so the
    launcher (torchrun, `srun --kill-on-bad-exit`) stops the others and no rank is left hanging in a collective."""
    try:
        work()
    except ConfigError as error:
        if rank == 0 or isinstance(error, RankRefusal):
            print(f"{name}: error: {error}", file=sys.stderr, flush=True)
        if not isinstance(error, RankRefusal):
            leave_together(world)
        leave(2)
    except GuardStop as stop:
        if rank == 0:
            print(f"{name}: {stop}", file=sys.stderr, flush=True)
        leave_together(world, GUARD_STOP)
        leave(GUARD_STOP)
    except KeyboardInterrupt:
        print(f"{name}: interrupted (rank {rank})", file=sys.stderr, flush=True)
        leave(130)
    except SystemExit as stop:
        if stop.code in (0, None):
            raise
        if not isinstance(stop.code, int):  # sys.exit("why"): Python would print it
            print(stop.code, file=sys.stderr, flush=True)
        leave(stop.code if isinstance(stop.code, int) else 1)
    except BaseException as error:  # noqa: BLE001 - a failed rank must never leave the others hanging
        traceback.print_exc()
        print(_announce_failure(rank, error), file=sys.stderr, flush=True)
        leave(1)
    return 0
