"""Which training loop a run takes, and its arguments checked before any rank does work.

`prepare(argv, world_size)` reads `--training-loop` (auto: Megatron-LM's `pretrain()` where
`megatron.training` imports, else our megatron-core loop), parses and validates the arguments with that
loop's parser and the plugin's rules, and returns the run as a function to call on each rank. Refused input
raises `ConfigError` here, before any process group exists: the training script and our torchrun launcher
(which validates once, before starting ranks) call the same function.
"""

import datetime
import os
from typing import Callable

from megatron_csbp.core.rules import ConfigError


def uses_megatron_lm(loop: str) -> bool:
    """Megatron-LM's `pretrain()` or our loop, as `--training-loop` asks (auto: Megatron-LM where importable)."""
    from megatron_csbp.training import megatron_lm

    if loop == "megatron-core":
        return False
    found = megatron_lm.import_pretrain() is not None
    if loop == "megatron-lm" and not found:
        raise ConfigError("--training-loop megatron-lm: megatron.training cannot be imported; point MEGATRON_LM_PATH "
                          "at a Megatron-LM checkout (tag core_v0.16.1) or use --training-loop megatron-core")
    return found


def lone_process_rendezvous() -> None:
    """A command started without a launcher is one rank: it meets itself on this machine (either loop's
    process group reads MASTER_ADDR and MASTER_PORT from the environment)."""
    from megatron_csbp.runtime.launch import free_port

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))


def init_distributed(timeout_minutes: float) -> tuple[int, int]:
    """The default process group from the launcher's environment (torchrun or srun); (rank, world size)."""
    import torch
    import torch.distributed as dist

    from megatron_csbp.core.device import default_backend

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    lone_process_rendezvous()
    if torch.accelerator.is_available():
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")) % torch.accelerator.device_count())
    dist.init_process_group(default_backend(), rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    return rank, world


def _megatron_core_loop(argv: list[str], world_size: int) -> Callable[[], None]:
    from megatron_csbp.training.arguments import validate
    from megatron_csbp.training.config import parse_args

    args = parse_args(argv)
    settings = validate(args, world_size)

    def run():
        from megatron_csbp.mcore import cpu_backend
        from megatron_csbp.training import loop as training

        init_distributed(args.distributed_timeout_minutes)
        with cpu_backend.active():
            training.train(args, settings)
    return run


def _megatron_lm_loop(argv: list[str], world_size: int) -> Callable[[], None]:
    from megatron_csbp.training import megatron_lm

    expanded, args = megatron_lm.parse_args(argv, world_size)

    def run():
        lone_process_rendezvous()
        megatron_lm.pretrain(expanded, args)
    return run


def prepare(argv: list[str], world_size: int) -> Callable[[], None]:
    """The run `argv` asks for, validated for `world_size` ranks (`ConfigError` if refused)."""
    from megatron_csbp.training.config import training_loop

    loop = _megatron_lm_loop if uses_megatron_lm(training_loop(argv)) else _megatron_core_loop
    return loop(argv, world_size)
