"""How tests start processes: ranks with the package's launcher (`run_ranks`; `on_cpu_backend` runs a rank's
function inside the CPU backend), and commands whose whole process tree ends with the test (`start`,
`kill_tree`, `run_command`): a command's helpers (megatron-core's checkpoint-writer queue manager, a launcher's
ranks) outlive a kill of the command alone, orphaned, so a test that stops a command stops its tree."""

import functools
import os
import signal
import subprocess

import psutil

from megatron_csbp.runtime.launch import free_port, run_ranks  # noqa: F401


def on_cpu_backend(function):
    """A rank function run inside `cpu_backend.active()` (a no-op where an accelerator exists)."""
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        from megatron_csbp.mcore import cpu_backend

        with cpu_backend.active():
            return function(*args, **kwargs)
    return wrapped


def start(args, **options) -> subprocess.Popen:
    """`subprocess.Popen` in a session (so a process group) of its own: `kill_tree` then also reaches the
    processes it orphaned, which keep its group."""
    return subprocess.Popen(args, start_new_session=True, **options)


def kill_tree(process: subprocess.Popen) -> None:
    """Kills `process` and every process under it (collected before the kill, which would orphan them), and its
    process group where `start` gave it one; then reaps it. A process that has ended already is no error."""
    try:
        root = psutil.Process(process.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    if process.poll() is None or tree:
        try:
            if os.getpgid(process.pid) == process.pid:
                os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for member in tree:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()
    psutil.wait_procs(tree[1:], timeout=30)


def run_command(args, *, timeout: float, input=None, capture_output: bool = False, check: bool = False,
                **options) -> subprocess.CompletedProcess:
    """`subprocess.run`, except that a timeout (or an interrupt) kills the command's whole tree, not its first
    process only, before `subprocess.TimeoutExpired` is raised."""
    if capture_output:
        options.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        options["stdin"] = subprocess.PIPE
    with start(args, **options) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except BaseException:
            kill_tree(process)
            raise
    done = subprocess.CompletedProcess(args, process.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done
