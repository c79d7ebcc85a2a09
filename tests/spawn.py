"""Tests spawn ranks with the package's launcher."""

from megatron_csbp.launch import free_port, run_ranks  # noqa: F401
