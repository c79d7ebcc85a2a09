"""What megatron-core and torch say at start-up that a user cannot act on, said once instead.

Without Transformer Engine and Apex (every CPU machine, many GPU ones), megatron-core warns at the import of
each module that falls back to torch (norms, optimizers, grad clipping, FSDP's mixed precision): seven
warnings per rank, the same fact seven times. torch and megatron-core also warn about their own internals
(deprecated calls inside distributed checkpointing and tensor parallelism, a megatron default, a cyclic
import), and megatron-core gives GPU advice on machines without a GPU. `quiet_start_up()`
filters exactly those messages, by text, and `start_up_note()` names once what is absent and what runs
instead. Every other warning, and every error, still shows; a user who sets `PYTHONWARNINGS` (or `-W`)
gets everything, unfiltered. Call it at an entry point, before megatron is imported: a library import
changes no warning filter.
"""

import importlib.util
import sys
import warnings

# (category, message regex): megatron-core's fallbacks, then internals of torch and megatron-core.
_START_UP_NOISE = (
    (UserWarning, r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed"),
    (UserWarning, r"full scope is deprecated"),  # megatron's own cuda_graph_scope default
    (FutureWarning, r"`load_state_dict` is deprecated"),  # dist_checkpointing's call into torch.distributed
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),  # the same reader
    (DeprecationWarning, r"`torch\.jit\.script_method` is deprecated"),
    (DeprecationWarning, r"The following imports from `dynamic_context\.py` will be removed"),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),  # megatron-core's TP gathers
)
# Advice for accelerators, noise on a machine without one.
_ACCELERATOR_ADVICE = ((UserWarning, r"When using async grad allreduce it is recommended to set the environment "
                                     r"variable CUDA_DEVICE_MAX_CONNECTIONS"),)
ACCELERATIONS = ("transformer_engine", "apex")


def missing_accelerations() -> list[str]:
    """The optional GPU accelerations (Transformer Engine, Apex) this environment lacks."""
    return [name for name in ACCELERATIONS if importlib.util.find_spec(name) is None]


def start_up_line(missing: list[str]) -> str | None:
    """One line naming what is absent and what runs instead (None: nothing is missing)."""
    if not missing:
        return None
    names = " and ".join({"transformer_engine": "Transformer Engine", "apex": "Apex"}[name] for name in missing)
    return (f" note: {names} not installed: megatron-core's torch layers, norms and optimizers run instead "
            f"(exact, slower on GPUs)")


def quiet_start_up() -> None:
    """Filters the start-up noise, unless the user chose their own warning filters."""
    if sys.warnoptions:  # -W or PYTHONWARNINGS: the user's filters, untouched
        return
    import torch

    noise = _START_UP_NOISE + (() if torch.accelerator.is_available() else _ACCELERATOR_ADVICE)
    for category, message in noise:
        warnings.filterwarnings("ignore", message=message, category=category)


def start_up_note() -> str | None:
    """What an entry point prints once, on rank 0, when the run starts (after its input was accepted, so a
    refusal stays one line)."""
    return start_up_line(missing_accelerations())
