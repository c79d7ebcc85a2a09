"""Runs a function on N spawned local ranks with a deadline, and returns what each rank returned.

Used by the benchmark and the tests: one rank per process, gloo on the CPU (NCCL with one device per
rank on GPUs), one thread per rank. Spawning (and importing megatron) is expensive, so callers group
their work per topology. The first failing rank's traceback is re-raised in the caller. No rank outlives
the call, however it ends (a result, a failed rank, the deadline, Ctrl-C): the ranks still running are
killed with every process under them (their own helpers, e.g. dist_checkpointing's writer queue manager,
which a rank's death alone would orphan), and a rank dies with its caller (`supervision.die_with_parent`).
"""

import io
import os
import queue
import socket
import time
import traceback

import torch

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank, world_size, port, fn, args, results):
    from megatron_csbp.core import supervision

    supervision.die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        from megatron_csbp.core.device import default_backend

        if torch.accelerator.is_available():
            torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
        dist.init_process_group(default_backend(), rank=rank, world_size=world_size)
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)  # plain bytes: no shared-memory handles to outlive us
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size, *args, timeout=300):
    """Runs `fn(rank, world_size, *args)` on `world_size` ranks; returns the list of results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # Not daemonic: dist_checkpointing's writers are child processes of the ranks.
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results), daemon=False)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    collected, errors = {}, {}
    try:
        for _ in range(world_size):
            rank, status, payload = results.get(timeout=timeout)
            if status == "ok":
                collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
                break  # the other ranks may now be stuck in a collective; do not wait for them
    except queue.Empty as exc:
        missing = sorted(set(range(world_size)) - set(collected))
        raise TimeoutError(f"ranks {missing} produced no result within {timeout}s") from exc
    finally:
        _end(procs, grace=5.0 if len(collected) == world_size else 0.0)
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [collected[r] for r in range(world_size)]


def _end(procs, grace: float) -> None:
    """Lets the ranks exit by themselves for `grace` seconds (those that returned a result tear down), then kills
    the rest together with every process under them, collected before the kill, which would orphan them."""
    import psutil

    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    helpers = []
    for proc in procs:
        if proc.is_alive():
            try:
                helpers += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            proc.kill()
    for helper in helpers:
        try:
            helper.kill()
        except psutil.NoSuchProcess:
            pass
    for proc in procs:
        proc.join()
    psutil.wait_procs(helpers, timeout=30)
