"""How every command of ours starts: its input checked before any work, a refusal as one line with exit
status 2, Ctrl-C as one line with exit status 130, and, once the input is accepted, the start-up note
(`quiet.start_up_note`) on rank 0. Pretraining, generation and evaluation start through `accepted`, so
the rule is written once."""

import sys

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
