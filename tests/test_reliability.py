"""Failures never hang and never cost more than one iteration: preemption signals, NaN steps, dead ranks."""

import math
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from pretrain_runs import K, REPO, SCRIPT, base, command, environment, flags, TINY, Run, run

pytest_plugins = ["pretrain_runs"]


def _worker(launcher_pid: int, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "pretrain_bdlm.py" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no rank {rank} under process {launcher_pid}")


@pytest.mark.parametrize("stop_signal", [signal.SIGUSR1, signal.SIGTERM])
def test_a_stop_signal_saves_at_the_next_iteration_and_the_requeued_run_matches(corpus, reference_runs, tmp_path,
                                                                                stop_signal):
    """Slurm's preemption signal (USR1 ahead of time, TERM at the deadline) reaches one rank only; both stop at
    the same iteration boundary, save and exit 0; the requeued job (--load == --save) resumes there and logs the
    uninterrupted run's losses."""
    checkpoints = tmp_path / "checkpoints"
    settings = base(corpus, context_block_parallel=2, save=checkpoints, load=checkpoints, exit_signal_handler=True)
    launched = subprocess.Popen(command(2, settings), cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in launched.stdout:
            lines.append(line)
            if re.search(r"iteration\s+2/", line):
                _worker(launched.pid, 1).send_signal(stop_signal)
                break
        lines.append(launched.communicate(timeout=180)[0])
    finally:
        launched.kill()
    first = Run(launched.returncode, "".join(lines), 0.0)
    assert first.returncode == 0, first.output[-4000:]
    assert f"no checkpoint in {checkpoints} yet" in first.output
    saved = int(re.search(r"saved checkpoint at iteration\s+(\d+)", first.output).group(1))
    assert 2 <= saved < 2 * K and f"exiting at iteration {saved} on a stop signal" in first.output
    assert max(first.losses) == saved
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text() == str(saved)

    second = run(2, settings)
    assert f"loaded checkpoint from {checkpoints} at iteration {saved}" in second.output
    assert min(second.losses) == saved + 1
    reference = reference_runs["csbp"]
    assert {**first.losses, **second.losses} == reference.losses  # every printed digit, every iteration
    assert second.validation[2 * K] == reference.validation[2 * K]


def test_nan_steps_are_skipped_counted_and_a_run_of_them_stops_training(corpus, tmp_path):
    save = tmp_path / "checkpoints"
    settings = dict(base(corpus, context_block_parallel=2, save=save, save_interval=4, eval_iters=0),
                    max_consecutive_bad_steps=3)
    result = run(2, settings, env={"MEGATRON_CSBP_TEST_NAN_ITERATIONS": "3,9,10,11"}, expect=1)
    output = result.output
    assert "iteration 3: non-finite loss" in output and "step skipped (1 in a row, limit 3)" in output
    counts = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"iteration\s+(\d+)/.*number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+)", output)}
    assert counts[2] == (0, 0) and counts[3] == (1, 1) and counts[8] == (1, 1) and counts[10] == (3, 3)
    losses = result.losses
    assert math.isnan(losses[3]), losses  # the poisoned step is logged as what it was
    assert all(math.isfinite(losses[i]) for i in (4, 5, 6, 7, 8)), losses  # and left no NaN behind
    assert "stopping at iteration 11: 3 consecutive steps with a non-finite loss or grad norm" in output
    assert f"last good checkpoint: iteration 8 in {save}" in output
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "8"
    assert sorted(os.listdir(save)) == ["iter_0000004", "iter_0000008", "latest_checkpointed_iteration.txt"]
    from megatron_csbp.checkpointing import check_complete
    check_complete(str(save / "iter_0000008"))


def _srun_like(settings: dict, env: dict, world: int = 2):
    """One plain process per rank with RANK/WORLD_SIZE/MASTER_* in the environment, as `srun` starts them."""
    from spawn import free_port

    port = free_port()
    args = [sys.executable, SCRIPT, *flags({**TINY, **settings})]
    return [subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=environment({**env, "RANK": str(rank), "WORLD_SIZE": str(world),
                                              "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(port)}))
            for rank in range(world)]


def test_a_rank_that_raises_stops_every_rank_naming_it(corpus):
    """No launcher to tear the job down: the surviving rank must leave by itself, and say who failed."""
    ranks = _srun_like(base(corpus, context_block_parallel=2, eval_iters=0),
                       {"MEGATRON_CSBP_TEST_FAIL": "1:3"})
    outputs = [rank.communicate(timeout=150)[0] for rank in ranks]  # a hang fails here, naming the test
    assert [rank.returncode for rank in ranks] == [1, 1], outputs
    assert "rank 1 failed: RuntimeError: injected failure at iteration 3" in outputs[1]
    assert "rank 0 stopping: rank 1 failed: RuntimeError: injected failure at iteration 3" in outputs[0], outputs[0]


def test_a_killed_rank_stops_the_job_within_the_timeout(corpus):
    """A rank killed mid-step (SIGKILL: no goodbye): torchrun names it and no rank is left behind."""
    result = run(2, base(corpus, context_block_parallel=2, eval_iters=0), env={"MEGATRON_CSBP_TEST_FAIL": "1:3:kill"},
                 expect=None, timeout=150)  # a hang fails here
    assert result.returncode != 0
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", result.output) and "Signal 9 (SIGKILL)" in result.output, \
        result.output[-3000:]


def test_a_non_finite_grad_norm_skips_the_step_with_a_finite_loss(corpus):
    """An infinite gradient with a finite loss (e.g. an overflow in backward) is caught by the grad norm."""
    result = run(2, base(corpus, context_block_parallel=2, eval_iters=0, train_iters=6),
                 env={"MEGATRON_CSBP_TEST_INF_GRAD_ITERATIONS": "4"})
    output, losses = result.output, result.losses
    assert re.search(r"iteration 4: non-finite grad norm \(loss [0-9.]+, grad norm (inf|nan)\); step skipped "
                     r"\(1 in a row, limit 3\)", output), output[-3000:]
    assert all(math.isfinite(loss) for loss in losses.values()) and sorted(losses) == list(range(1, 7))
    counts = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"iteration\s+(\d+)/.*number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+)", output)}
    assert counts[3] == (0, 0) and counts[4] == (1, 1) and counts[6] == (1, 1)
