"""One writer per `--save` directory: a lock file naming its holder, taken before training starts.

Two runs saving into one folder would interleave their files into checkpoints that pass every check
(each file intact, but from different runs). So rank 0 creates `<save>/csbp_writer.lock` (`O_EXCL`: exactly
one creator wins) holding its host, pid, process start time and Slurm job, and a second run refuses at
once, naming the first. A lock outlives a killed run; it is stale, and taken over, when its holder is
provably gone: on this host, no process with that pid and start time; under Slurm, the same job id with
another restart count (a requeued job, whose earlier incarnation Slurm has ended). A lock held from
another host by a live-looking run is never taken: the message says which file to delete if that run is
gone.
"""

import datetime
import json
import os
import socket

from megatron_csbp.core.rules import ConfigError

LOCK = "csbp_writer.lock"


def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def this_holder() -> dict:
    """Who this process is, as recorded in a lock."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0"),
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def stale_reason(holder: dict, me: dict) -> str | None:
    """Why the lock's holder is certainly gone, or None when it may still be writing."""
    if holder.get("slurm_job_id") and holder["slurm_job_id"] == me["slurm_job_id"] and \
            holder.get("slurm_restart_count") != me["slurm_restart_count"]:
        return f"Slurm job {holder['slurm_job_id']} was requeued"
    if holder.get("host") == me["host"]:
        start = _process_start(int(holder.get("pid", -1)))
        if start is None:
            return f"process {holder.get('pid')} is gone"
        if holder.get("process_start") is not None and abs(start - holder["process_start"]) > 1.0:
            return f"process {holder.get('pid')} is gone (its pid now belongs to another process)"
    return None


def describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {holder.get('since')}"


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _take_over(path: str, stale: dict) -> bool:
    """Removes the lock at `path` if it is still the `stale` one we judged; False when it was not.

    Between reading the stale lock and removing it, another run may have taken it over and written its own:
    renaming blindly would delete that run's live lock and let two runs write. So the lock is renamed to a
    private name (atomic: one run gets each file), read there, and removed only if it is the stale holder's;
    a live lock caught this way is linked back (`link` never replaces a lock a third run made meanwhile)."""
    private = f"{path}.stale.{os.getpid()}"
    try:
        os.rename(path, private)
    except FileNotFoundError:
        return False
    if _read(private) == stale:
        os.remove(private)
        return True
    try:
        os.link(private, path)
    except FileExistsError:
        pass
    os.remove(private)
    return False


def acquire(save: str, log=print) -> str:
    """Takes `<save>/csbp_writer.lock` for this process (rank 0); returns its path. Refuses with
    `ConfigError` naming the holder when another live run has it."""
    os.makedirs(save, exist_ok=True)
    path = os.path.join(save, LOCK)
    me = this_holder()
    for _ in range(5):  # a lock replaced under us, or one just being written, is looked at again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None:
                continue
            if not holder:  # created but not yet written by its holder, or damaged
                import time
                time.sleep(0.5)
                holder = _read(path)
                if holder is None:
                    continue
                if not holder:
                    raise ConfigError(f"--save {save}: {path} is unreadable (another run starting, or a damaged "
                                      f"lock); if no other run uses --save {save}, delete {path}")
            reason = stale_reason(holder, me)
            if reason is None:
                raise ConfigError(f"--save {save} is in use by another run ({describe(holder)}): wait for it to "
                                  f"end or give another --save; if that run is gone, delete {path}")
            if _take_over(path, holder):
                log(f" taking over the stale lock {path} ({describe(holder)}: {reason})")
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(me, handle)
            handle.flush()
            os.fsync(handle.fileno())
        return path
    raise ConfigError(f"--save {save}: could not take {path} (other runs keep replacing it); make sure only one "
                      f"run uses --save {save}")


def release(path: str) -> None:
    """Removes the lock if this process still holds it."""
    holder = _read(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        os.remove(path)


def take_for_run(save: str | None) -> str | None:
    """Rank 0 takes `--save`'s lock (`acquire`) and every rank refuses alike when it is held (collective, on the
    initialised default group); returns the lock's path on rank 0, else None. Used by both training loops."""
    import torch.distributed as dist

    if not save:
        return None
    path, refusal = None, None
    if dist.get_rank() == 0:
        try:
            path = acquire(save)
        except ConfigError as error:
            refusal = str(error)
        except OSError as error:  # every rank must hear of it, or the others wait at the broadcast
            refusal = f"--save {save}: cannot take its writer lock ({error}); give a writable directory"
    verdict = [refusal]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ConfigError(verdict[0])
    return path
