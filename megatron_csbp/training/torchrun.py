"""`torchrun`, with the training script's refusals kept to their one line and exit status 2.

    python -m megatron_csbp.torchrun --standalone --nproc-per-node 2 scripts/pretrain_bdlm.py --config X.yaml

Takes torchrun's own options (it is `torch.distributed.run`'s elastic agent underneath). Why: under plain
torchrun a refused argument comes out as every rank's refusal, then exit status 1 and torchrun's 30-line
`ChildFailedError` traceback. Here the training arguments are validated once, with the world size the
launch will have, before any rank starts (a refusal: one line, exit 2); a refusal a rank finds later
(a checkpoint, the data) still exits 2, a run a guard stopped (`entry.GuardStop`, e.g.
`--max-consecutive-bad-steps`) exits 17 after its one line, a status every rank chose alike (Megatron-LM's
16) is kept, and a failed rank is summed up in one line per rank (exit 1) after its own `rank R failed: ...`
line, without the agent's traceback.
"""

import logging
import os
import signal
import sys


def _world_size(args) -> int | None:
    """Ranks this launch starts in all, or None when elastic (a range of node counts)."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if min_nodes != max_nodes:
        return None
    return max_nodes * determine_local_world_size(args.nproc_per_node)


def _refusal(args) -> str | None:
    """The training script's refusal of its arguments, by the loop it will take (our script only)."""
    if os.path.basename(args.training_script) != "pretrain_bdlm.py" or args.no_python or args.module:
        return None
    from megatron_csbp.training import loops
    from megatron_csbp.core.rules import ConfigError

    world = _world_size(args)
    if world is None:
        return None
    try:
        loops.prepare(list(args.training_script_args), world)
    except ConfigError as error:
        return str(error)
    return None


def _summary(failure_error) -> int:
    """The launch's exit status, and one line per rank that ended badly, except where the ranks said it already.

    Every rank that ended did so with one status: a refusal (2) or a guard's stop (17), whose line the ranks
    printed, is that status alone; another one (e.g. Megatron-LM's 16, resume to check a result) is that status,
    after the lines. Otherwise (a failure, a signal, mixed statuses) the lines, and 1."""
    from megatron_csbp.runtime.entry import GUARD_STOP

    failures = failure_error.failures
    statuses = {failure.exitcode for failure in failures.values()}
    if len(statuses) == 1 and statuses <= {2, GUARD_STOP}:
        return statuses.pop()
    for rank, failure in sorted(failures.items()):
        how = (f"signal {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0 else
               f"exit status {failure.exitcode}")
        print(f"torchrun: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) ended with {how}",
              file=sys.stderr, flush=True)
    return statuses.pop() if len(statuses) == 1 and min(statuses) > 1 else 1


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what Slurm and schedulers send to ask a job to stop


def _forward_stop_signals(args) -> None:
    """A stop signal sent to the launcher is passed on to its ranks, and the launcher waits for them as usual.

    torchrun's agent instead raises `SignalException` on SIGTERM: it kills the ranks (giving them
    `--shutdown-timeout`) and exits 1 with a traceback, even when every rank saved and stopped cleanly under
    `--exit-signal-handler`. Forwarded, a rank that handles the signal saves and exits 0, and so does the
    launcher; a rank that does not dies of it and is reported as such (exit 1). SIGUSR1 (whose default action
    would kill the launcher alone) is forwarded alike. SIGINT, SIGHUP and SIGQUIT keep torchrun's handling."""
    import psutil

    args.signals_to_handle = ",".join(name for name in args.signals_to_handle.split(",")
                                      if name.strip() not in {stop.name for stop in STOP_SIGNALS})

    def forward(signum, frame):
        for child in psutil.Process().children():
            try:
                child.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    for stop in STOP_SIGNALS:
        signal.signal(stop, forward)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    for name in list(logging.Logger.manager.loggerDict):  # the agent's failure logs: our summary replaces them
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    refusal = _refusal(args)
    if refusal is not None:
        print(f"{os.path.basename(args.training_script)}: error: {refusal}", file=sys.stderr, flush=True)
        return 2
    _forward_stop_signals(args)
    try:
        run(args)
    except ChildFailedError as failed:
        return _summary(failed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
