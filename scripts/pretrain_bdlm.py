#!/usr/bin/env python
"""Pretrain a block diffusion LM with context-sharded block parallelism (CSBP) on Megatron-Core.

    torchrun --nproc-per-node 2 scripts/pretrain_bdlm.py --config configs/tiny_cpu.yaml [key=value ...]

Launch it like any Megatron script: torchrun, or one `srun` task per rank exporting RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and LOCAL_RANK (`python scripts/pretrain_bdlm.py ...` alone is one rank).

Where Megatron-LM's `megatron.training` is importable (a GPU cluster with Megatron-LM on the path), its
`pretrain()` runs with the plugin's providers and flags (`add_csbp_args`). Otherwise, and always on CPU,
`megatron_csbp.training` runs the same providers in a loop built from megatron-core parts.

Exit status: 0 done (or saved and stopped on a signal / exit condition), 2 refused input (one line, before
any work), 1 a failure: that rank prints `rank R failed: ...` and leaves at once, so the launcher (torchrun,
`srun --kill-on-bad-exit`) stops the others, and any rank caught in a collective with it gives up within
`--distributed-timeout-minutes`, naming the failed rank when it could announce itself.
"""

import datetime
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_FAILED_RANK_KEY = "megatron_csbp/failed_rank"

from megatron_csbp.supervision import die_with_launcher  # noqa: E402

die_with_launcher()  # at import: a killed torchrun/srun takes its ranks, and their spawned helpers, with it


def megatron_lm_pretrain():
    """Megatron-LM's `pretrain`, or None where only megatron-core is installed."""
    try:
        from megatron.training import pretrain
    except ImportError:
        return None
    return pretrain


def run_megatron_lm(pretrain, argv: list[str]) -> int:
    """Hands the plugin's providers and flags to Megatron-LM's `pretrain()` (YAML and overrides expanded)."""
    from megatron.core.enums import ModelType

    from megatron_csbp import providers
    from megatron_csbp.arguments import add_csbp_args
    from megatron_csbp.config import expand_argv

    expanded = expand_argv(argv)
    for flag in ("--calculate-per-token-loss",):  # BDLM's loss is a per-token NELBO of the global batch
        if flag not in expanded:
            expanded.append(flag)
    sys.argv = [sys.argv[0], *expanded]
    pretrain(providers.train_valid_test_datasets_provider, providers.model_provider, ModelType.encoder_or_decoder,
             providers.forward_step, extra_args_provider=add_csbp_args)
    return 0


def init_distributed(timeout_minutes: int) -> tuple[int, int]:
    """The default process group from the launcher's environment (torchrun or srun); (rank, world size)."""
    import torch
    import torch.distributed as dist

    from megatron_csbp.device import default_backend
    from megatron_csbp.launch import free_port

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if torch.accelerator.is_available():
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")) % torch.accelerator.device_count())
    dist.init_process_group(default_backend(), rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    return rank, world


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


def _end_helper_processes() -> None:
    """Ends this rank's own helper processes (e.g. dist_checkpointing's writer queue manager): leaving
    with `os._exit` would orphan them, holding the launcher's output pipes open."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    pretrain = megatron_lm_pretrain()
    if pretrain is not None:
        return run_megatron_lm(pretrain, argv)

    from megatron_csbp.arguments import ConfigError, validate_args
    from megatron_csbp.config import parse_args

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args = validate_args(parse_args(argv), world)
    except ConfigError as error:
        if rank == 0:
            print(f"pretrain_bdlm.py: error: {error}", file=sys.stderr, flush=True)
        return 2

    import torch.distributed as dist

    from megatron_csbp import cpu_backend, training

    try:
        init_distributed(args.distributed_timeout_minutes)
        cpu_backend.enable()
        training.train(args)
    except ConfigError as error:  # refused input found later (data vocabulary, checkpoints): every rank agrees
        if rank == 0:
            print(f"pretrain_bdlm.py: error: {error}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(2)
    except BaseException as error:  # noqa: BLE001 - a failed rank must never leave the others hanging
        traceback.print_exc()
        print(_announce_failure(rank, error), file=sys.stderr, flush=True)
        sys.stdout.flush()
        _end_helper_processes()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
