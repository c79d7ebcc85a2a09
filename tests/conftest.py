"""The suite's markers, in one place, so it can be run in parts.

* `slow`: a test that trains, spawns a launcher or runs a whole script (seconds to minutes each);
  `make test-quick` runs everything else (layouts, kernels, the op on 2 ranks, the objective, configs,
  refusals) in a few minutes.
* `spawn`: starts processes (gloo ranks, torchrun, scripts).
* `slurm`: needs the local Slurm cluster `.ci/run` starts (skipped without it).
* `megatron_lm`: needs Megatron-LM (`MEGATRON_LM_PATH`, tag core_v0.16.1; skipped without it).

Each module's markers are listed here rather than in the module, so this file is the whole map. A hung
test fails after the per-test timeout of pytest.ini, naming itself, instead of eating CI's time. A process
the test run started that outlives it fails the run, naming the test after which it was first seen
(`processes_left`, below).
"""

import os
import time
import uuid

import psutil
import pytest

MARKERS = {
    "slow": "trains, spawns a launcher or runs a whole script",
    "spawn": "starts processes (gloo ranks, torchrun, scripts)",
    "slurm": "needs the local Slurm cluster (.ci/run starts one)",
    "megatron_lm": "needs Megatron-LM: MEGATRON_LM_PATH pointing at a core_v0.16.1 checkout",
}

MODULE_MARKERS = {
    "test_arguments": (),
    "test_bdlm": (),
    "test_config": (),
    "test_cpu_backend": (),
    "test_flops": (),
    "test_comm": (),
    "test_kernels": (),
    "test_layout": (),
    "test_plan": (),
    "test_rules": (),
    "test_publish": (),
    "test_attention": ("spawn",),
    "test_documents": ("spawn",),
    "test_clean_stream": ("spawn",),
    "test_gated_delta": ("spawn",),
    "test_gated_delta_training": ("spawn", "slow"),
    "test_sliding_window": ("spawn",),
    "test_clean_stream_training": ("spawn", "slow"),
    "test_diffusion_gemma": ("spawn", "slow"),
    "test_sliding_window_training": ("spawn", "slow"),
    "test_packing": ("spawn", "slow"),
    "test_sft_data": ("spawn", "slow"),
    "test_sft_parallel": ("spawn", "slow"),
    "test_transport_memory": ("spawn",),
    "test_bdlm_forward_step": ("spawn",),
    "test_data": ("spawn",),
    "test_spec_model": ("spawn",),
    "test_parallel_state": ("spawn", "slow"),
    "test_megatron_composition": ("spawn", "slow"),
    "test_moe": ("spawn", "slow"),
    "test_gemma4_moe": ("spawn", "slow"),
    "test_hf_diffusion_gemma": ("spawn", "slow"),
    "test_gemma4_attention": ("spawn", "slow"),
    "test_bench": ("spawn", "slow"),
    "test_bench_windows": ("spawn",),
    "test_recompute": ("spawn", "slow"),
    "test_ddp_overlap": ("spawn", "slow"),
    "test_gpu_check": ("spawn", "slow"),
    "test_training": ("spawn", "slow"),
    "test_checkpointing": ("spawn", "slow"),
    "test_reliability": ("spawn", "slow"),
    "test_slurm": ("spawn", "slow", "slurm"),
    "test_megatron_lm": ("spawn", "slow", "megatron_lm"),
    "test_flag_table": (),
    "test_flag_table_megatron_lm": ("spawn", "slow", "megatron_lm"),
    "test_megatron_lm_recipes": ("megatron_lm",),
    "test_sampling": ("spawn", "slow"),
    "test_sampling_windows": ("spawn", "slow"),
    "test_sampling_diffusion_gemma": ("spawn", "slow"),
    "test_hf": ("spawn", "slow"),
    "test_hf_windows": ("spawn",),
    "test_hf_qwen35": ("spawn",),
    "test_hf_moe": ("spawn", "slow"),
    "test_export_formats": ("spawn", "slow"),
    "test_vocabulary_padding": ("spawn", "slow"),
    "test_start_up_output": ("spawn", "slow"),
    "test_demo": ("spawn", "slow"),
    "test_suite_rules": (),
    "test_refusals": (),
    "test_torchrun": ("spawn", "slow"),
    "test_evaluate": ("spawn", "slow"),
    "test_harness": ("spawn", "slow"),
    "test_linear_cross_entropy": ("spawn", "slow"),
}


# The skips CI keeps (by how their reason starts): the machine is not the one a test is for (Megatron-LM
# absent, an accelerator or Transformer Engine present), or the case does not exist (one rank has no CP
# baseline). Under CI=true (`.ci/run`) every other skip is a failure, since CI sets up what the rest need
# (Slurm, the [hf] extra, root for the tmpfs): a test the suite can run must not pass unseen as a skip.
ALLOWED_SKIPS = ("Megatron-LM is absent", "this machine has an accelerator", "Transformer Engine is installed here",
                 "no CP baseline on one rank")


def _skip_reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report).removeprefix("Skipped: ")
    if not reason.startswith(ALLOWED_SKIPS):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where the suite must run it: {reason}"


def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        for name in MODULE_MARKERS.get(module, ()):
            item.add_marker(getattr(pytest.mark, name))


def megatron_lm_path() -> str | None:
    """The Megatron-LM checkout the `megatron_lm` tests use, or None (they skip, saying why)."""
    path = os.environ.get("MEGATRON_LM_PATH")
    return path if path and os.path.isdir(os.path.join(path, "megatron", "training")) else None


# ---------------------------------------------------------------------- processes the test run leaves behind
# Every process the run starts carries RUN_MARK in its environment (inherited from here), so one orphaned out of
# the run's process tree (its parent killed: it is re-parented to init) is still found as the run's. A run inside
# a run (a test of this conftest) adds its own mark to its parent's.
RUN_MARK = "MEGATRON_CSBP_SUITE_RUN"


def processes_left(marks: set[str], root: int | None = None) -> list[psutil.Process]:
    """The live processes of the test run whose marks are `marks` and whose process is `root` (this one by default):
    its descendants, and every process carrying one of `marks`; not `root`, its multiprocessing resource tracker
    (it ends with `root`), nor zombies (ended; their parent has not collected them yet)."""
    import multiprocessing.resource_tracker

    root = os.getpid() if root is None else root
    spared = {root, multiprocessing.resource_tracker._resource_tracker._pid if root == os.getpid() else None}
    try:
        found = {process.pid: process for process in psutil.Process(root).children(recursive=True)}
    except psutil.NoSuchProcess:
        found = {}
    for process in psutil.process_iter():
        if process.pid in found or process.pid in spared:
            continue
        try:
            if marks & set(process.environ().get(RUN_MARK, "").split(",")):
                found[process.pid] = process
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    alive = []
    for pid, process in sorted(found.items()):
        try:
            if pid not in spared and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid} (parent {process.ppid()}): {' '.join(process.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {process.pid} (gone)"


class _LeftBehind:
    """This run's mark, and for each process found alive after a test, the first test after which it was."""

    def __init__(self):
        self.mark = uuid.uuid4().hex
        os.environ[RUN_MARK] = ",".join(filter(None, [os.environ.get(RUN_MARK), self.mark]))
        self.first_seen = {}  # (pid, create time) -> test id

    def look(self, test: str) -> None:
        for process in processes_left({self.mark}):
            try:
                self.first_seen.setdefault((process.pid, process.create_time()), test)
            except psutil.NoSuchProcess:
                pass

    def seen_after(self, process: psutil.Process) -> str:
        try:
            key = (process.pid, process.create_time())
        except psutil.NoSuchProcess:
            return "?"
        return self.first_seen.get(key, "the last test or the session's teardown")


_left_behind: _LeftBehind | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    global _left_behind
    _left_behind = _LeftBehind()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    _left_behind.look(item.nodeid)  # cheap (one pass over /proc): names the test a leftover comes from


def pytest_sessionfinish(session, exitstatus):
    """Fails the run when a process it started is still alive at its end (after a short wait for those ending):
    they are named, with the test after which each was first seen, and killed."""
    if _left_behind is None:
        return
    deadline = time.monotonic() + 10
    left = processes_left({_left_behind.mark})
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = processes_left({_left_behind.mark})
    if not left:
        return
    lines = [f"{describe(process)}; first seen after {_left_behind.seen_after(process)}" for process in left]
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.section("processes the test run left behind (killed now)", sep="=", red=True)
        for line in lines:
            reporter.line(line, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
