"""Tests spawn ranks with the package's launcher; `on_cpu_backend` runs a rank's function inside the CPU backend."""

import functools

from megatron_csbp.training.launch import free_port, run_ranks  # noqa: F401


def on_cpu_backend(function):
    """A rank function run inside `cpu_backend.active()` (a no-op where an accelerator exists)."""
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        from megatron_csbp.mcore import cpu_backend

        with cpu_backend.active():
            return function(*args, **kwargs)
    return wrapped
