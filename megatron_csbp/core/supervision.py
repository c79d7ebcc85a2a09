"""Ranks that never outlive their launcher, and never wait silently on a dead or stopped peer.

`Watchdog` (below): a thread per rank that ends the run when an operation of the training loop or a CSBP
collective has not completed within `--distributed-timeout-minutes`, naming the rank, the operation and
the ranks whose heartbeats went silent.

`die_with_launcher`: torchrun and srun start each rank in its own session, so a launcher killed with
SIGKILL (an OOM killer, a lost node agent) would leave its ranks training, and writing checkpoints,
unsupervised, beside a requeued job. On Linux each rank asks the kernel for SIGKILL when its parent dies
(`prctl(PR_SET_PDEATHSIG)`); only under a launcher (torchrun's or Slurm's environment), so a plain
`python scripts/pretrain_bdlm.py` under `nohup` is not tied to its shell. A rank's own helpers die with
it too: forked ones re-arm the request after `fork` (the kernel clears it), and spawned ones (megatron-core's
checkpoint-writer queue manager) arm it when they import the entry script, which calls this at import.
`die_with_parent` asks the same unconditionally, for a rank whose parent is its launcher (`launch.run_ranks`),
and for a helper of any of our commands, launched or not.
"""

import contextlib
import json
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def launched_by_launcher() -> bool:
    """True under torchrun (its elastic agent's environment) or srun (a Slurm step)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_STEP_ID" in os.environ


def _arm() -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() == 1:  # the parent died before the request was in place
        os._exit(1)
    return True


_armed = False


def die_with_launcher() -> bool:
    """Under a launcher, makes this process (and every process it forks) receive SIGKILL when its parent dies;
    True when armed."""
    return launched_by_launcher() and die_with_parent()


def die_with_parent() -> bool:
    """Makes this process (and every process it forks) receive SIGKILL when its parent dies; True when armed
    (Linux only). For a process whose parent is its launcher (a rank) or its owner (a helper, e.g. the checkpoint
    writer's manager: `checkpointing.writer_helpers_die_with_us`), never for a command a user starts."""
    global _armed
    if not sys.platform.startswith("linux"):
        return False
    if not _armed:
        _armed = _arm()
        if _armed:
            os.register_at_fork(after_in_child=_arm)
    return _armed


# ------------------------------------------------------------------------------------------------ watchdog
def distributed_timeout_seconds(args) -> float:
    """`--distributed-timeout-minutes` in seconds: the watchdog's and the model-parallel groups' timeout."""
    return float(args.distributed_timeout_minutes) * 60


def _describe(stack: tuple) -> str:
    """The innermost operation, and the outermost one it is part of."""
    inner = _label(stack[-1])
    return inner if len(stack) == 1 else f"{inner} (in {_label(stack[0])})"


def _label(operation) -> str:
    """An operation is a string, or (what, process group): the group's ranks are named when reported."""
    if isinstance(operation, tuple):
        what, group = operation
        try:
            import torch.distributed as dist
            return f"{what} over ranks {dist.get_process_group_ranks(group)}"
        except Exception:  # noqa: BLE001 - a report must not fail on a group it cannot describe
            return what
    return str(operation)


class Watchdog:
    """Ends the run when this rank's main thread makes no progress inside an operation for the timeout.

    Why: a stopped or wedged peer (SIGSTOP, a hung NIC, a deadlocked kernel) never fails, so without it
    the others wait in their collective as long as the backend lets them, silently (gloo's waits, a CSBP
    ring shift, a pipeline receive). The training loop and the CSBP collectives mark what they are doing
    (`watch`); when one operation has not completed within the timeout (a little before the process
    groups' own timeout, so this report, not a backend's bare "timed out", is what the user reads), the
    rank prints one line naming itself, the operation and the ranks whose heartbeats went silent, and
    leaves with status 1, so the launcher stops the rest. Heartbeats: each rank's thread writes its time
    and operation to the rendezvous TCPStore every few seconds; a stopped rank's thread stops too.
    """

    def __init__(self, timeout_seconds: float, rank: int, world_size: int):
        self.timeout = timeout_seconds
        self.limit = timeout_seconds - min(10.0, 0.1 * timeout_seconds)
        self.rank, self.world_size = rank, world_size
        self.interval = max(0.5, min(5.0, self.limit / 6))
        self._stack, self._last = [], time.monotonic()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._store = None
        self._key = f"megatron_csbp/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._thread = threading.Thread(target=self._run, name="megatron_csbp-watchdog", daemon=True)

    # -------------------------------------------------------------------------------- main thread side
    @contextlib.contextmanager
    def watch(self, operation):
        with self._lock:
            self._stack.append(operation)
            self._last = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._stack.pop()
                self._last = time.monotonic()

    def progress(self) -> None:
        self._last = time.monotonic()

    def start(self) -> "Watchdog":
        self._store = _heartbeat_store()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    # ---------------------------------------------------------------------------------- thread side
    def _run(self) -> None:
        next_beat = 0.0
        while not self._stopped.is_set():
            now = time.monotonic()
            with self._lock:
                operation = tuple(self._stack) or None
                since = self._last
            if operation is not None and now - since >= self.limit:
                self._fire(operation, now - since)
                return
            if now >= next_beat:
                self._beat(operation)
                next_beat = now + self.interval
            deadline = next_beat if operation is None else min(next_beat, since + self.limit)
            self._stopped.wait(max(0.01, deadline - time.monotonic()))

    def _beat(self, operation) -> None:
        if self._store is None:
            return
        try:
            self._store.set(self._key + str(self.rank),
                            json.dumps({"time": time.time(), "operation": _describe(operation) if operation else None}))
        except Exception:  # noqa: BLE001 - the store's host may be the stopped rank; heartbeats are best effort
            self._store = None

    def _heartbeats(self) -> str:
        """Which ranks went silent (no heartbeat for 3 intervals), from the store; or why that is unknown."""
        if self._store is None:
            return "heartbeats unavailable (the rendezvous store cannot be reached)"
        silent, now = [], time.time()
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                beat = json.loads(self._store.get(self._key + str(rank)))
            except Exception:  # noqa: BLE001
                silent.append(f"rank {rank} (no heartbeat)")
                continue
            age = now - beat["time"]
            if age > 3 * self.interval:
                silent.append(f"rank {rank} (last heartbeat {age:.1f} s ago, in {beat['operation']})")
            if len(silent) >= 8:
                silent.append("...")
                break
        if not silent:
            return "every other rank's heartbeat is fresh (a rank waiting on another, or a slow collective)"
        return "silent (stopped or dead): " + ", ".join(silent)

    def _fire(self, operation, elapsed: float) -> None:
        print(f"rank {self.rank} watchdog: {_describe(operation)} has not completed in {elapsed:.0f} s (distributed "
              f"timeout {self.timeout:g} s, --distributed-timeout-minutes); {self._heartbeats()}; ending the run",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        end_helper_processes()
        os._exit(1)


def end_helper_processes() -> None:
    """Ends this process's own helper processes (e.g. dist_checkpointing's writer queue manager) before an
    `os._exit`, which would orphan them, holding the launcher's output pipes open. Never raises: it runs on
    the way out of a failed run."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001
        return
    for child in children:
        try:
            child.kill()
        except Exception:  # noqa: BLE001  (gone already, or not ours to kill)
            pass


def _heartbeat_store():
    """A client of the rendezvous TCPStore (MASTER_ADDR:MASTER_PORT), or None when it cannot be reached."""
    import datetime

    import torch.distributed as dist

    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=5))
    except Exception:  # noqa: BLE001
        return None


_active: Watchdog | None = None


def start_watchdog(timeout_seconds: float, rank: int, world_size: int) -> Watchdog:
    global _active
    _active = Watchdog(timeout_seconds, rank, world_size).start()
    return _active


def stop_watchdog() -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None


def watch(operation):
    """`with watch("what"):` or `with watch(("what", group)):`: marks an operation the watchdog times."""
    return _active.watch(operation) if _active is not None else contextlib.nullcontext()


def progress() -> None:
    """Marks progress inside a long operation (e.g. each micro-batch's forward)."""
    if _active is not None:
        _active.progress()
