"""Failures never hang and never cost more than one iteration: preemption signals, NaN steps, dead ranks."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from pretrain_runs import (FAULTS, K, OUR_TORCHRUN, REPO, SCRIPT, TINY, Run, base, command, environment, flags,
                           lines_until_iteration, run)
from spawn import kill_tree, run_command, start

pytest_plugins = ["pretrain_runs"]


def _worker(launcher_pid: int, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and {SCRIPT, FAULTS} & set(child.cmdline()):
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
    launched = start(command(2, settings), cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, text=True)
    try:
        lines = lines_until_iteration(launched)
        _worker(launched.pid, 1).send_signal(stop_signal)
        lines.append(launched.communicate(timeout=180)[0])
    finally:
        kill_tree(launched)
    first = Run(launched.returncode, "".join(lines), 0.0)
    assert first.returncode == 0, first.output[-4000:]
    assert f"no checkpoint in {checkpoints} yet" in first.output
    saved = int(re.search(r"saved checkpoint at iteration\s+(\d+)", first.output).group(1))
    assert 2 <= saved < 2 * K and "Traceback" not in first.output
    assert f"exiting at iteration {saved} on a stop signal (SIGUSR1/SIGTERM); last good checkpoint: iteration " \
           f"{saved} in {checkpoints}" in first.output
    assert max(first.losses) == saved
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text() == str(saved)

    second = run(2, settings)
    assert f"loaded checkpoint from {checkpoints} at iteration {saved}" in second.output
    assert min(second.losses) == saved + 1
    reference = reference_runs["csbp"]
    assert {**first.losses, **second.losses} == reference.losses  # every printed digit, every iteration
    assert second.validation[2 * K] == reference.validation[2 * K]


def test_nan_steps_are_skipped_counted_and_a_run_of_them_stops_training(corpus, tmp_path):
    """A run of non-finite steps is a guard's stop, not a crash: one line naming the last good checkpoint, exit 17
    (through our torchrun), no traceback, no rank reported failed."""
    save = tmp_path / "checkpoints"
    settings = dict(base(corpus, context_block_parallel=2, save=save, save_interval=4, eval_iters=0),
                    max_consecutive_bad_steps=3)
    result = run(2, settings, faults={"MEGATRON_CSBP_TEST_NAN_ITERATIONS": "3,9,10,11"}, expect=17,
                 torchrun=OUR_TORCHRUN)
    output = result.output
    assert "Traceback" not in output and not re.search(r"rank \d+ (failed|stopping)|torchrun:", output), output[-4000:]
    stops = [line for line in output.splitlines() if line.startswith("pretrain_bdlm.py: ")]
    assert stops == [f"pretrain_bdlm.py: stopping at iteration 11: 3 consecutive steps with a non-finite loss or grad "
                     f"norm (--max-consecutive-bad-steps 3); last good checkpoint: iteration 8 in {save}"], stops
    assert "iteration 3: non-finite loss" in output and "step skipped (1 in a row, limit 3)" in output
    counts = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"iteration\s+(\d+)/.*number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+)", output)}
    assert counts[2] == (0, 0) and counts[3] == (1, 1) and counts[8] == (1, 1) and counts[10] == (3, 3)
    losses = result.losses
    assert math.isnan(losses[3]), losses  # the poisoned step is logged as what it was
    assert all(math.isfinite(losses[i]) for i in (4, 5, 6, 7, 8)), losses  # and left no NaN behind
    assert not (save / "csbp_writer.lock").exists()  # released on the way out
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "8"
    assert sorted(os.listdir(save)) == ["iter_0000004", "iter_0000008", "latest_checkpointed_iteration.txt"]
    from megatron_csbp.training.checkpointing import check_complete
    check_complete(str(save / "iter_0000008"))


def _srun_like(settings: dict, faults: dict, world: int = 2):
    """One plain process per rank with RANK/WORLD_SIZE/MASTER_* in the environment, as `srun` starts them;
    tests/faults.py's entry, injecting `faults`."""
    from spawn import free_port

    port = free_port()
    args = [sys.executable, FAULTS, *flags({**TINY, **settings})]
    return [start(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                  env=environment({**faults, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}))
            for rank in range(world)]


def test_a_rank_that_raises_stops_every_rank_naming_it(corpus):
    """No launcher to tear the job down: the surviving rank must leave by itself, and say who failed."""
    ranks = _srun_like(base(corpus, context_block_parallel=2, eval_iters=0),
                       {"MEGATRON_CSBP_TEST_FAIL": "1:3"})
    try:
        outputs = [rank.communicate(timeout=150)[0] for rank in ranks]  # a hang fails here, naming the test
    finally:
        for rank in ranks:
            kill_tree(rank)
    assert [rank.returncode for rank in ranks] == [1, 1], outputs
    assert "rank 1 failed: RuntimeError: injected failure at iteration 3" in outputs[1]
    assert "Traceback" in outputs[1]  # a real failure keeps its traceback
    assert "rank 0 stopping: rank 1 failed: RuntimeError: injected failure at iteration 3" in outputs[0], outputs[0]


def test_a_killed_rank_stops_the_job_within_the_timeout(corpus):
    """A rank killed mid-step (SIGKILL: no goodbye): torchrun names it and no rank is left behind."""
    result = run(2, base(corpus, context_block_parallel=2, eval_iters=0),
                 faults={"MEGATRON_CSBP_TEST_FAIL": "1:3:kill"}, expect=None, timeout=150)  # a hang fails here
    assert result.returncode != 0
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", result.output) and "Signal 9 (SIGKILL)" in result.output, \
        result.output[-3000:]


def test_a_non_finite_grad_norm_skips_the_step_with_a_finite_loss(corpus):
    """An infinite gradient with a finite loss (e.g. an overflow in backward) is caught by the grad norm."""
    result = run(2, base(corpus, context_block_parallel=2, eval_iters=0, train_iters=6),
                 faults={"MEGATRON_CSBP_TEST_INF_GRAD_ITERATIONS": "4"})
    output, losses = result.output, result.losses
    assert re.search(r"iteration 4: non-finite grad norm \(loss [0-9.]+, grad norm (inf|nan)\); step skipped "
                     r"\(1 in a row, limit 3\)", output), output[-3000:]
    assert all(math.isfinite(loss) for loss in losses.values()) and sorted(losses) == list(range(1, 7))
    counts = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"iteration\s+(\d+)/.*number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+)", output)}
    assert counts[3] == (0, 0) and counts[4] == (1, 1) and counts[6] == (1, 1)


def test_a_second_run_on_the_same_save_is_refused_naming_the_first(corpus, tmp_path):
    """Two runs writing one --save would mix their files into checkpoints that pass every check."""
    import json

    save = tmp_path / "shared"
    first = start(command(1, base(corpus, save=save, save_interval=4, train_iters=400, eval_iters=0)),
                  cwd=REPO, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:
            if re.search(r"iteration\s+1/", line):
                break
        holder = json.loads((save / "csbp_writer.lock").read_text())
        assert holder["pid"] == first.pid
        second = run(1, base(corpus, save=save, eval_iters=0), expect=2, timeout=120)
    finally:
        kill_tree(first)
    assert "Traceback" not in second.output and "iteration" not in second.output
    assert second.output.strip().splitlines()[-1] == (
        f"pretrain_bdlm.py: error: --save {save} is in use by another run (host {holder['host']}, pid {first.pid}, "
        f"since {holder['since']}): wait for it to end or give another --save; if that run is gone, delete "
        f"{save}/csbp_writer.lock")


def test_a_stale_lock_is_taken_over_and_a_live_one_refused(tmp_path, monkeypatch):
    from megatron_csbp.runtime import save_lock
    from megatron_csbp.core.rules import ConfigError

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    me = save_lock.this_holder()
    cases = {"dead": dict(me, pid=dead_pid), "reused pid": dict(me, pid=os.getppid(), process_start=1.0),
             "live": dict(me, pid=os.getppid(), process_start=psutil.Process(os.getppid()).create_time()),
             "other host": dict(me, host="elsewhere", pid=dead_pid),
             "requeued": dict(me, host="elsewhere", slurm_job_id="77", slurm_restart_count="0"),
             "same job step": dict(me, host="elsewhere", slurm_job_id="77", slurm_restart_count="1")}
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    outcomes = {}
    for name, holder in cases.items():
        save = tmp_path / name.replace(" ", "_")
        save.mkdir()
        (save / "csbp_writer.lock").write_text(json.dumps(holder))
        lines = []
        try:
            path = save_lock.acquire(str(save), log=lines.append)
            assert json.loads(open(path).read())["pid"] == os.getpid()
            save_lock.release(path)
            assert not os.path.exists(path)
            outcomes[name] = lines[0]
        except ConfigError as error:
            outcomes[name] = str(error)
    lock = lambda name: f"{tmp_path}/{name}/csbp_writer.lock"  # noqa: E731
    assert outcomes["dead"] == f" taking over the stale lock {lock('dead')} ({save_lock.describe(cases['dead'])}: " \
                               f"process {dead_pid} is gone)"
    assert outcomes["reused pid"].endswith("(its pid now belongs to another process))")
    assert outcomes["requeued"].endswith(": Slurm job 77 was requeued)")
    for refused in ("live", "other host", "same job step"):
        assert outcomes[refused].startswith(f"--save {tmp_path}/{refused.replace(' ', '_')} is in use by another "
                                            f"run ({save_lock.describe(cases[refused])})"), outcomes[refused]


def test_a_take_over_never_removes_the_lock_another_run_just_took(tmp_path, monkeypatch):
    """Two runs find the same stale lock; the other one takes it over first and writes its own lock between our
    read and our rename. We must then refuse, naming that run, and leave its lock in place."""
    from megatron_csbp.runtime import save_lock
    from megatron_csbp.core.rules import ConfigError

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    me = save_lock.this_holder()
    stale = dict(me, pid=int(gone.stdout))
    winner = dict(me, pid=os.getppid(), process_start=psutil.Process(os.getppid()).create_time())
    lock = tmp_path / "csbp_writer.lock"
    lock.write_text(json.dumps(stale))
    rename = os.rename

    def the_other_run_wins_first(source, target):
        if source == str(lock) and json.loads(lock.read_text()) == stale:
            lock.write_text(json.dumps(winner))  # it took the stale lock over and wrote its own
        rename(source, target)

    monkeypatch.setattr(save_lock.os, "rename", the_other_run_wins_first)
    with pytest.raises(ConfigError, match=r"is in use by another run \(" + re.escape(save_lock.describe(winner))):
        save_lock.acquire(str(tmp_path), log=lambda line: None)
    assert json.loads(lock.read_text()) == winner
    assert sorted(os.listdir(tmp_path)) == ["csbp_writer.lock"]
    monkeypatch.setattr(save_lock.os, "rename", rename)  # control: without the race, the stale lock is taken over
    lock.write_text(json.dumps(stale))
    save_lock.release(save_lock.acquire(str(tmp_path), log=lambda line: None))
    assert os.listdir(tmp_path) == []


def test_killing_torchrun_takes_its_ranks_with_it(corpus, tmp_path):
    """torchrun's ranks live in their own sessions: without a parent-death signal they would train on."""
    settings = base(corpus, context_block_parallel=2, train_iters=400, eval_iters=0, save=tmp_path / "save",
                    save_interval=1)  # saving: the ranks then have checkpoint-writer helpers too
    launched = subprocess.Popen(command(2, settings),
                                cwd=REPO, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    try:
        for line in launched.stdout:
            if re.search(r"saved checkpoint at iteration\s+2 ", line):
                break
        ranks = [_worker(launched.pid, rank) for rank in (0, 1)]
        descendants = psutil.Process(launched.pid).children(recursive=True)
        launched.kill()
        launched.wait()
        _, alive = psutil.wait_procs(descendants, timeout=20)
    finally:
        launched.kill()
        for process in descendants:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        launched.communicate()
    assert {p.pid for p in ranks} <= {p.pid for p in descendants} and len(descendants) > 2, descendants
    assert alive == [], f"left running after torchrun was killed: pids {[p.pid for p in alive]}"


def test_a_run_killed_outright_leaves_no_helper_behind(corpus, tmp_path):
    """`kill -9` of a one-process run (no launcher) once it saved: megatron-core's checkpoint-writer manager, and
    the resource tracker it holds open, die with it (they stayed, orphaned, for good)."""
    settings = base(corpus, save=tmp_path / "save", save_interval=1, train_iters=400, eval_iters=0)
    launched = start(command(1, settings), cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, text=True)
    helpers, commands = [], []
    try:
        for line in launched.stdout:
            if re.search(r"saved checkpoint at iteration\s+1 ", line):
                break
        helpers = psutil.Process(launched.pid).children(recursive=True)
        commands = [" ".join(helper.cmdline()) for helper in helpers]
        launched.kill()
        launched.wait()
        _, alive = psutil.wait_procs(helpers, timeout=20)
    finally:
        kill_tree(launched)
        for helper in helpers:
            try:
                helper.kill()
            except psutil.NoSuchProcess:
                pass
    assert any("spawn_main" in line for line in commands), commands  # the writer's manager was there to die
    assert alive == [], f"left running after the run was killed: {[helper.pid for helper in alive]}"


def test_a_stopped_rank_ends_the_job_within_the_timeout_naming_it(corpus):
    """SIGSTOP on one rank: it never fails, so only the watchdog can end the job; the other rank names it."""
    timeout = 15
    launched = start(command(2, base(corpus, context_block_parallel=2, train_iters=400, eval_iters=0), entry=FAULTS),
                     cwd=REPO, env=environment({"MEGATRON_CSBP_TEST_TIMEOUT_SECONDS": str(timeout)}),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = lines_until_iteration(launched)
        stopped = _worker(launched.pid, 1)
        stopped.suspend()
        started = time.time()
        lines.append(launched.communicate(timeout=timeout + 90)[0])
        elapsed = time.time() - started
    finally:
        kill_tree(launched)
    output = "".join(lines)
    assert launched.returncode != 0
    match = re.search(r"rank 0 watchdog: (.*) has not completed in (\d+) s \(distributed timeout 15 s, "
                      r"--distributed-timeout-minutes\); silent \(stopped or dead\): rank 1 \(last heartbeat "
                      r"([0-9.]+) s ago, in (.*)\); ending the run", output)
    assert match, output[-4000:]
    assert re.fullmatch(r"(.* over ranks \[0, 1\] \(in )?iteration \d+: .*", match.group(1)), match.group(1)
    assert int(match.group(2)) <= timeout and float(match.group(3)) <= timeout + 5
    assert elapsed < timeout + 60, elapsed  # the watchdog, then torchrun's teardown of the stopped rank


def test_under_ci_a_skip_the_suite_could_run_is_a_failure(tmp_path):
    """Under CI=true the suite's conftest turns a skip into a failure unless the skip says the machine is not
    the one the test is for (Megatron-LM absent, ...); outside CI both stay skips (the negative control)."""
    import shutil

    shutil.copy(os.path.join(REPO, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture\n"
        "def cluster():\n"
        "    pytest.skip('Slurm binaries absent (sbatch)')\n\n"
        "def test_needs_a_cluster(cluster):\n"
        "    pass\n\n"
        "@pytest.mark.skipif(True, reason='Megatron-LM is absent: set MEGATRON_LM_PATH')\n"
        "def test_needs_megatron_lm():\n"
        "    pass\n\n"
        "def test_skips_itself():\n"
        "    pytest.skip('cannot mount a small tmpfs here')\n")
    outcomes = {}
    for ci in ("true", ""):
        done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", str(tmp_path)],
                              cwd=tmp_path, env={**environment(), "CI": ci}, capture_output=True, text=True,
                              timeout=120)
        outcomes[ci] = dict(re.findall(r"::(test_\w+) (PASSED|FAILED|ERROR|SKIPPED)", done.stdout))
        outcomes[ci]["exit"] = done.returncode
        if ci:
            assert "skipped under CI=true, where the suite must run it: Slurm binaries absent (sbatch)" in \
                done.stdout, done.stdout
    assert outcomes["true"] == {"test_needs_a_cluster": "ERROR", "test_needs_megatron_lm": "SKIPPED",
                                "test_skips_itself": "FAILED", "exit": 1}, outcomes
    assert outcomes[""]["exit"] == 0 and "FAILED" not in outcomes[""].values(), outcomes


def _stopped_through_the_launcher(launcher: list[str], settings: dict) -> tuple[int, str]:
    """Starts 2 ranks under `launcher`, sends SIGTERM to the launcher itself (as Slurm does to a job step) once
    iteration 2 is logged; returns (exit status, output)."""
    launched = start([*launcher, SCRIPT, *flags({**TINY, **settings})], cwd=REPO, env=environment(),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = lines_until_iteration(launched)
        launched.send_signal(signal.SIGTERM)
        lines.append(launched.communicate(timeout=180)[0])
    finally:
        kill_tree(launched)
    return launched.returncode, "".join(lines)


def test_sigterm_to_our_launcher_is_a_requested_stop_exit_0_without_a_traceback(corpus, tmp_path):
    """Under --exit-signal-handler, SIGTERM to `python -m megatron_csbp.torchrun` reaches the ranks, which save
    and stop; the launcher exits 0 with no traceback. Plain torchrun (the negative control) kills the ranks and
    exits 1 with its SignalException traceback."""
    from pretrain_runs import TORCHRUN

    outcomes = {}
    for name, launcher in (("ours", [sys.executable, "-m", "megatron_csbp.torchrun"]), ("torchrun", [TORCHRUN])):
        save = tmp_path / name
        settings = base(corpus, context_block_parallel=2, save=save, exit_signal_handler=True, train_iters=200,
                        eval_iters=0)
        outcomes[name] = _stopped_through_the_launcher([*launcher, "--standalone", "--nproc-per-node", "2"],
                                                       settings)
    status, output = outcomes["ours"]
    assert status == 0 and "Traceback" not in output, output[-4000:]
    saved = int(re.search(r"exiting at iteration (\d+) on a stop signal", output).group(1))
    assert (tmp_path / "ours" / "latest_checkpointed_iteration.txt").read_text() == str(saved)
    status, output = outcomes["torchrun"]
    assert status == 1 and "SignalException" in output, output[-4000:]


_LEAKS = '''
import os, subprocess, sys

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_leaves_a_child():
    child = subprocess.Popen(SLEEPER)
    open("child.pid", "w").write(str(child.pid))


def test_leaves_an_orphan():  # its parent exits at once: it is re-parented out of the run's process tree
    subprocess.run(["sh", "-c", '"$@" >/dev/null 2>&1 & echo $! > orphan.pid', "sh", *SLEEPER], check=True)


def test_ends_what_it_starts():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


def test_a_process_that_outlives_the_test_run_fails_it_naming_the_test(tmp_path):
    """The suite's conftest fails a run that leaves a process behind, a child or an orphan, names the test after
    which each was first seen, and kills it; a run that ends what it starts passes (the negative control)."""
    import shutil

    shutil.copy(os.path.join(REPO, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_leaks.py").write_text(_LEAKS)
    outcomes = {}
    for name, selection in (("leaks", []), ("clean", ["-k", "ends_what_it_starts"])):
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection,
                               "test_leaks.py"], cwd=tmp_path, env=environment(), capture_output=True, text=True,
                              timeout=120)
        outcomes[name] = done
    leaked, clean = outcomes["leaks"], outcomes["clean"]
    assert clean.returncode == 0 and "left behind" not in clean.stdout, clean.stdout[-3000:]
    assert leaked.returncode == 1, leaked.stdout[-3000:]
    assert "3 passed" in leaked.stdout and "processes the test run left behind (killed now)" in leaked.stdout
    named = [line for line in leaked.stdout.splitlines() if line.startswith("pid ")]
    assert len(named) == 2, leaked.stdout[-3000:]
    for test, pid_file in (("test_leaves_a_child", "child.pid"), ("test_leaves_an_orphan", "orphan.pid")):
        pid = int((tmp_path / pid_file).read_text())
        [line] = [line for line in named if line.startswith(f"pid {pid} ")]
        assert line.endswith(f"first seen after test_leaks.py::{test}") and "time.sleep(600)" in line, line
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, line
    assert "test_ends_what_it_starts" not in "\n".join(named)


_ENDING = '''
import subprocess, sys
from megatron_csbp.core.rules import ConfigError
from megatron_csbp.runtime import entry


def work():
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    open(sys.argv[1], "w").write(str(helper.pid))
    exec(sys.argv[2])


sys.exit(entry.run("command.py", 0, 1, work))
'''
ENDINGS = {  # what the work does: (exit status, the last line on stderr, a traceback printed)
    "pass": (0, None, False),
    "raise ConfigError('--x 3 is refused; give 2')": (2, "command.py: error: --x 3 is refused; give 2", False),
    "raise entry.GuardStop('stopping at iteration 4: it diverged; last good checkpoint: iteration 2 in s')":
        (17, "command.py: stopping at iteration 4: it diverged; last good checkpoint: iteration 2 in s", False),
    "sys.exit(16)": (16, None, False),  # Megatron-LM's rerun state machine: "resume to disambiguate"
    "sys.exit(0)": (0, None, False),
    "raise KeyboardInterrupt": (130, "command.py: interrupted (rank 0)", False),
    "raise RuntimeError('boom')": (1, "rank 0 failed: RuntimeError: boom", True),
}


def test_each_way_a_command_ends_has_its_status_and_line_and_ends_its_helpers(tmp_path):
    """`entry.run`: a refusal, a guard's stop, a deliberate exit and Ctrl-C are their one line (or none) and their
    status, without a traceback; only a real failure prints one. However it ends, its helpers end with it."""
    script = tmp_path / "command.py"
    script.write_text(_ENDING)
    for work, (status, last_line, traceback) in ENDINGS.items():
        pid_file = tmp_path / "helper.pid"
        done = run_command([sys.executable, str(script), str(pid_file), work], cwd=REPO, env=environment(),
                           capture_output=True, text=True, timeout=120)
        errors = done.stderr.strip().splitlines()
        assert done.returncode == status, (work, done.stderr[-3000:])
        assert (errors[-1] if errors else None) == last_line and ("Traceback" in done.stderr) == traceback, \
            (work, done.stderr[-3000:])
        try:
            helper = psutil.Process(int(pid_file.read_text()))
        except psutil.NoSuchProcess:
            continue
        if status == 0:  # a normal exit leaves the work's own processes to it: end this one here
            helper.kill()
        _, alive = psutil.wait_procs([helper], timeout=10)  # a SIGKILL takes a moment on a busy machine
        assert all(process.status() == psutil.STATUS_ZOMBIE for process in alive), (work, "its helper outlived it")
