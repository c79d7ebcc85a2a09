"""A stand-in for scripts/pretrain_bdlm.py that proves the Slurm mechanics without training a model.

Same command line (`--config`, `--save`, `--load`, `--exit-signal-handler`, `key=value` overrides), same
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, gloo), same contract: a state that depends on every
past iteration (a "loss" mixed across ranks with all_reduce), `iter_XXXXXXX/` checkpoints with
`latest_checkpointed_iteration.txt` written last, resume from `--load`, and on SIGUSR1 or SIGTERM a save at the
next iteration boundary (all ranks agree through an all_reduce, as Megatron's signal handler does) and exit 0.
Seconds per iteration: $STANDIN_ITER_SECONDS (default 0.1).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_csbp.training.config import parse_args  # noqa: E402

received = []


def checkpoint_iteration(directory: Path) -> int:
    tracker = directory / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text()) if tracker.is_file() else 0


def save(directory: Path, iteration: int, loss: float, rank: int) -> None:
    folder = directory / f"iter_{iteration:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank_{rank}.json").write_text(json.dumps({"iteration": iteration, "loss": loss}))
    dist.barrier()
    if rank == 0:
        (directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))
        print(f" saved checkpoint at iteration {iteration:7d} to {directory}", flush=True)
    dist.barrier()


def main() -> int:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.exit_signal_handler:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: received.append(signum))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    env = {k: os.environ.get(k) for k in ("RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK",
                                          "CUDA_DEVICE_MAX_CONNECTIONS", "SLURM_RESTART_COUNT")}
    print(f" environment {json.dumps(env, sort_keys=True)}", flush=True)
    save_dir, load_dir = Path(args.save), Path(args.load)
    start, loss = checkpoint_iteration(load_dir), 10.0
    if start:
        loss = json.loads((load_dir / f"iter_{start:07d}" / f"rank_{rank}.json").read_text())["loss"]
        if rank == 0:
            print(f" loaded checkpoint from {load_dir} at iteration {start}", flush=True)
    seconds = float(os.environ.get("STANDIN_ITER_SECONDS", "0.1"))
    for iteration in range(start + 1, args.train_iters + 1):
        time.sleep(seconds)
        mixed = torch.tensor([loss * (0.9 + 0.01 * rank) + 0.05 * iteration])
        dist.all_reduce(mixed)
        loss = mixed.item() / world
        if rank == 0 and iteration % args.log_interval == 0:
            print(f" iteration {iteration:8d}/{args.train_iters:8d} | lm loss: {loss:.6E} |", flush=True)
        stop = torch.tensor([len(received)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            save(save_dir, iteration, loss, rank)
            if rank == 0:
                print(f" exiting on signal at iteration {iteration}", flush=True)
            dist.destroy_process_group()
            return 0
    save(save_dir, args.train_iters, loss, rank)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
