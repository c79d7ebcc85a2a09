"""How every command of ours starts: its input checked before any work, a refusal as one line with exit
status 2, Ctrl-C as one line with exit status 130, and, once the input is accepted, the start-up note
(`quiet.start_up_note`) on rank 0. Pretraining, generation and evaluation start through `accepted`, so
the rule is written once; under torchrun, ranks that refuse leave together (`leave_together`)."""

import os
import sys
import time

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.training import quiet


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
    """Under torchrun, makes the ranks that refused (every rank refuses the same input) exit at one instant,
    with `status`; returns only where there is nothing to wait for (one rank, or no torchrun store: srun).

    The launcher checks its ranks every 0.1 s and stops those still running once one has failed: a rank that
    refused a moment later than the first would be reported as killed (and the launch as a failure, exit 1)
    instead of as a refusal (exit 2). So each rank announces itself in the launcher's store, the last one sets
    an exit time a little ahead, and all leave then, at once (`os._exit`: no interpreter teardown to differ)."""
    if world == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    import datetime

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
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
