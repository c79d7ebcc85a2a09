"""Slurm submission (scripts/slurm/submit.py), tested against a real Slurm cluster.

CI starts a single-node cluster with `scripts/slurm/local_cluster.sh start` and exports SLURM_CONF; when
none answers, the `slurm` fixture starts one itself (and stops it afterwards). Tests that need Slurm (through
that fixture) skip only where its binaries are absent, and fail instead under CI=true. The requeue mechanics
are proven with `tests/slurm_standin_trainer.py` (same command line, environment and checkpoint contract as
the training script); the end-to-end tests run `scripts/pretrain_bdlm.py` with `configs/tiny_cpu.yaml`.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SUBMIT = REPO / "scripts" / "slurm" / "submit.py"
LOCAL_CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"
STANDIN = "tests/slurm_standin_trainer.py"
SLURM_BINARIES = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "slurmctld", "slurmd", "munged")


def missing_binaries() -> list[str]:
    """The Slurm binaries not on PATH now: asked when the cluster tests start, not when the module is
    collected (in a full run, up to half an hour earlier: a probe cached then answers for then)."""
    return [name for name in SLURM_BINARIES if shutil.which(name) is None]

ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|.*?lm loss:\s*([-+0-9.eE]+)")

STANDIN_CONFIG = {  # valid for the training script's validate_args; CSBP over the 2 ranks
    "num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq_length": 64, "micro-batch-size": 1,
    "global-batch-size": 4, "train-iters": 30, "lr": 1.0e-3, "log-interval": 1,
    "data-path": "data/unused_text_document", "context-block-parallel": 2, "bdlm": {"block-size": 16},
}


def run_submit(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, str(SUBMIT), *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)


@pytest.fixture
def standin_config(tmp_path):
    path = tmp_path / "standin.yaml"
    path.write_text(yaml.safe_dump(STANDIN_CONFIG))
    return path


# --- before sbatch: no cluster needed ------------------------------------------------------------------------

def test_misfits_are_refused_with_the_numbers_and_nothing_is_submitted(tmp_path, standin_config):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    calls = tmp_path / "sbatch_calls"
    (fake_bin / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho 4242\n")
    (fake_bin / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    out = tmp_path / "runs"
    base = ["--config", standin_config, "--nodes", 1, "--gpus-per-node", 0, "--output-dir", out,
            "--train-script", STANDIN]
    misfits = {  # (ranks per node, overrides) -> the numbers the one-line refusal must give
        (3, ()): ["world size 3", "--context-block-parallel 2", "= 2 does not divide the world size 3"],
        (2, ("seq-length=72",)): ["--seq-length 72", "--bdlm-block-size 16"],
        (2, ("seq-length=16",)): ["--seq-length 16", "1 blocks", "--context-block-parallel 2"],
        (4, ("global-batch-size=3",)): ["--global-batch-size 3", "data-parallel size 2"],
        (2, ("context-block-parallel-clean-shards=3",)): ["--context-block-parallel 2",
                                                          "--context-block-parallel-clean-shards 3"],
        (2, ("save=/elsewhere",)): ["'save=/elsewhere'", "--output-dir and --job-name"],
    }
    for (tasks, overrides), numbers in misfits.items():
        result = run_submit(*base, "--ntasks-per-node", tasks, "--", *overrides, env=env)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("submit.py: refused: "), result.stderr
        for number in numbers:
            assert number in lines[0], (number, lines[0])
        assert result.stdout == ""
    assert not calls.exists() and not out.exists()

    # Positive control: the same fake sbatch does see a topology that fits.
    result = run_submit(*base, "--ntasks-per-node", 2, "--", "train-iters=5", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4242"
    scripts = list((out / "standin").glob("submit_*.sbatch"))
    assert len(scripts) == 1 and calls.read_text().split() == ["--parsable", str(scripts[0])]
    assert list((out / "standin").glob("config_*.yaml"))[0].read_text() == standin_config.read_text()


def _directives(script: str) -> list[str]:
    return [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_dry_run_cpu_script(tmp_path, standin_config):
    result = run_submit("--config", standin_config, "--nodes", 1, "--gpus-per-node", 0, "--ntasks-per-node", 2,
                        "--output-dir", tmp_path / "runs", "--job-name", "cpu", "--signal-seconds", 90,
                        "--train-script", STANDIN,
                        "--dry-run", "--", "train-iters=7", "log-interval=1")
    assert result.returncode == 0, result.stderr
    script, run_dir = result.stdout, tmp_path / "runs" / "cpu"
    assert not (tmp_path / "runs").exists()
    directives = _directives(script)
    for wanted in ("--job-name=cpu", "--nodes=1", "--ntasks-per-node=2", f"--output={run_dir}/slurm-%j.out",
                   "--open-mode=append", "--requeue", "--signal=B:USR1@90", f"--chdir={REPO}"):
        assert wanted in directives, (wanted, directives)
    assert not any(d.startswith(("--gpus", "--exclusive")) for d in directives), directives
    for wanted in ("export CUDA_DEVICE_MAX_CONNECTIONS=1",
                   'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                   "export MASTER_PORT=$((",
                   "export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID; exec",
                   "trap 'preempted=1;", 'scontrol requeue "$SLURM_JOB_ID"'):
        assert wanted in script, wanted
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--container" not in srun and srun.endswith(" &")
    command = srun.split(" rank ", 1)[1].split()
    assert command[:2] == [sys.executable, STANDIN]
    assert command[2] == "--config" and re.fullmatch(rf"{run_dir}/config_[0-9-]+\.yaml", command[3])
    assert command[4:9] == ["--save", f"{run_dir}/checkpoints", "--load", f"{run_dir}/checkpoints",
                            "--exit-signal-handler"]
    assert command[9:] == ["train-iters=7", "log-interval=1", "&"]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_dry_run_gpu_script_with_container(tmp_path, standin_config):
    result = run_submit("--config", standin_config, "--nodes", 2, "--gpus-per-node", 4, "--partition", "gpu",
                        "--account", "proj", "--qos", "high", "--time", "04:00:00", "--output-dir", tmp_path,
                        "--container-image", "nvcr.io/nvidia/pytorch:25.01-py3",
                        "--container-mounts", "/lustre:/lustre", "--dry-run", "--", "tensor-model-parallel-size=2")
    assert result.returncode == 0, result.stderr
    directives = _directives(result.stdout)
    for wanted in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--exclusive", "--partition=gpu",
                   "--account=proj", "--qos=high", "--time=04:00:00", "--signal=B:USR1@120", "--requeue"):
        assert wanted in directives, (wanted, directives)
    srun = next(line for line in result.stdout.splitlines() if line.startswith("srun "))
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3 --container-mounts=/lustre:/lustre bash -c" in srun
    assert " rank python scripts/pretrain_bdlm.py --config " in srun
    # 2 x 4 GPUs = 8 ranks, not a multiple of TP 2 x CSBP 2 x PP 3 = 12.
    result = run_submit("--config", standin_config, "--nodes", 2, "--gpus-per-node", 4, "--dry-run", "--",
                        "tensor-model-parallel-size=2", "pipeline-model-parallel-size=3", "num-layers=3")
    assert result.returncode == 2 and "world size 8 (2 node(s) x 4 GPU(s))" in result.stderr, result.stderr
    assert "= 12 does not divide the world size 8" in result.stderr and result.stdout == ""


# --- a real cluster -----------------------------------------------------------------------------------------

def _slurm_answers(env) -> bool:
    try:
        result = subprocess.run(["sinfo", "--noheader", "--format=%T"], env=env, capture_output=True, text=True,
                                timeout=15)
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0 and any(s.startswith(("idle", "mix", "alloc")) for s in result.stdout.split())


@pytest.fixture(scope="session")
def slurm():
    """Environment for the Slurm client commands: the running cluster, or a local one started here."""
    missing = missing_binaries()
    if missing:  # a failure under CI=true (conftest): CI installs Slurm
        pytest.skip(f"Slurm binaries absent ({', '.join(missing)} not on PATH={os.environ.get('PATH', '')}): "
                    f"apt-get install -y slurm-wlm munge")
    local_dir = os.environ.get("SLURM_LOCAL_DIR", "/tmp/megatron-csbp-slurm")
    env = {**os.environ, "SLURM_CONF": os.environ.get("SLURM_CONF", f"{local_dir}/slurm.conf")}
    started = False
    if not _slurm_answers(env):
        result = subprocess.run([str(LOCAL_CLUSTER), "start"], env=env, capture_output=True, text=True,
                                timeout=180)
        assert result.returncode == 0, f"could not start a local Slurm cluster:\n{result.stdout}{result.stderr}"
        started = True
    yield env
    if started:
        subprocess.run([str(LOCAL_CLUSTER), "stop"], env=env, capture_output=True, timeout=60)


def job_fields(job: str, env) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    return dict(token.split("=", 1) for token in out.split() if "=" in token)


def wait_for_job(job: str, env, states=("COMPLETED",), timeout=180) -> dict:
    """Polls until the job is in one of `states`; fails at once if it ended otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job_fields(job, env)
        state = fields.get("JobState")
        if state in states:
            return fields
        if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"):
            pytest.fail(f"job {job} ended {state}: {fields}")
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env, timeout=30)
    pytest.fail(f"job {job} not {'/'.join(states)} within {timeout}s: {job_fields(job, env)}")


def wait_for_log(path: Path, pattern: str, timeout=120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if re.search(pattern, text):
            return text
        time.sleep(0.2)
    pytest.fail(f"{path}: no '{pattern}' within {timeout}s:\n{text}")


def submit_jobs(env, config, out_dir, runs: dict[str, list[str]], script=STANDIN) -> dict[str, tuple[str, Path]]:
    """Submits one 2-rank CPU job per run name ({name: overrides}), all at once; {name: (job id, log)}."""
    procs = {name: subprocess.Popen(
        [sys.executable, str(SUBMIT), "--config", str(config), "--nodes", "1", "--gpus-per-node", "0",
         "--ntasks-per-node", "2", "--output-dir", str(out_dir), "--job-name", name, "--train-script", script,
         "--", *overrides], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, overrides in runs.items()}
    jobs = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0 and stdout.strip().isdigit(), stderr
        jobs[name] = stdout.strip(), out_dir / name / f"slurm-{stdout.strip()}.out"
    return jobs


def cancel(jobs: dict, env) -> None:
    """Leaves no job of a failed test behind (a finished job ignores it)."""
    subprocess.run(["scancel", *(job for job, _ in jobs.values())], env=env, capture_output=True, timeout=30)


def iteration_losses(log: str) -> dict[int, str]:
    """{iteration: lm loss text}; an iteration logged twice (repeated after a resume) is an error."""
    losses = {}
    for match in ITERATION.finditer(log):
        iteration = int(match.group(1))
        assert iteration not in losses, f"iteration {iteration} logged twice:\n{log}"
        losses[iteration] = match.group(3)
    return losses


def assert_final_checkpoint(checkpoints: Path, iteration: int):
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == str(iteration)
    assert (checkpoints / f"iter_{iteration:07d}").is_dir()


STANDIN_ITERS = 30
PREEMPTIONS = {  # how each stand-in run is interrupted once it logs iteration 5
    "plain": None,
    # What Slurm does --signal-seconds before the time limit: USR1 to the batch shell only.
    "usr1": ["scancel", "--batch", "--signal=USR1"],
    # Like a PreemptMode=REQUEUE preemption: SIGTERM to the batch shell and every rank, SIGKILL after KillWait.
    "requeue": ["scontrol", "requeue"],
}


@pytest.fixture(scope="module")
def standin_runs(slurm, tmp_path_factory, request):
    """The three stand-in runs of PREEMPTIONS, side by side: {name: (job fields, log text, run directory)}."""
    root = tmp_path_factory.mktemp("slurm_standin")
    config = root / "standin.yaml"
    config.write_text(yaml.safe_dump(STANDIN_CONFIG))
    env = {**slurm, "STANDIN_ITER_SECONDS": "0.2"}
    jobs = submit_jobs(env, config, root / "runs", {name: [f"train-iters={STANDIN_ITERS}"] for name in PREEMPTIONS})
    request.addfinalizer(lambda: cancel(jobs, env))
    for name, preempt in PREEMPTIONS.items():
        if preempt:
            job, log = jobs[name]
            wait_for_log(log, r"iteration\s+5/")
            subprocess.run(preempt + [job], env=env, check=True, timeout=30)
    return {name: (wait_for_job(job, env), log.read_text(), root / "runs" / name)
            for name, (job, log) in jobs.items()}


def test_submitted_job_completes(standin_runs):
    fields, log, run_dir = standin_runs["plain"]
    assert fields["ExitCode"] == "0:0" and fields["Restarts"] == "0", fields
    assert sorted(iteration_losses(log)) == list(range(1, STANDIN_ITERS + 1)), log
    assert_final_checkpoint(run_dir / "checkpoints", STANDIN_ITERS)
    assert len(list(run_dir.glob("submit_*.sbatch"))) == 1 and len(list(run_dir.glob("config_*.yaml"))) == 1
    # The exports reached every rank: one environment line per rank.
    ranks = {}
    for line in re.findall(r"environment (\{.*\})", log):
        env = yaml.safe_load(line)
        ranks[env["RANK"]] = env
    assert sorted(ranks) == ["0", "1"], log
    port = 20000 + int(fields["JobId"]) % 2500 * 16
    for rank, env in ranks.items():
        assert env["LOCAL_RANK"] == rank and env["WORLD_SIZE"] == "2", env
        assert env["MASTER_ADDR"] == fields["BatchHost"] and env["MASTER_PORT"] == str(port), env
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1", env


def assert_saved_requeued_resumed(run, plain_log, expect_in_log):
    fields, log, run_dir = run
    assert fields["ExitCode"] == "0:0" and fields["Restarts"] == "1", fields
    assert expect_in_log in log, log
    saved = int(re.search(r"saved checkpoint at iteration\s+(\d+)", log).group(1))
    assert 5 <= saved < STANDIN_ITERS, log
    first_run, second_run = log.split("submit.py: job ")[1:3]
    assert f"loaded checkpoint from {run_dir}/checkpoints at iteration {saved}" in second_run, log
    assert max(iteration_losses(first_run)) == saved and min(iteration_losses(second_run)) == saved + 1
    # Not a single iteration lost or repeated, and every loss (so the final one) as without the preemption.
    assert iteration_losses(log) == iteration_losses(plain_log)
    assert_final_checkpoint(run_dir / "checkpoints", STANDIN_ITERS)


def test_usr1_saves_requeues_and_resumes(standin_runs):
    assert_saved_requeued_resumed(standin_runs["usr1"], standin_runs["plain"][1],
                                  "submit.py: preempted (ranks exited 0); requeueing job")


def test_scontrol_requeue_saves_and_resumes(standin_runs):
    """The batch shell keeps waiting on SIGTERM while the ranks save within KillWait."""
    assert_saved_requeued_resumed(standin_runs["requeue"], standin_runs["plain"][1],
                                  "submit.py: SIGTERM, waiting for the ranks to finish")


# --- end to end: the real training script ------------------------------------------------------------------

TINY_CPU = REPO / "configs" / "tiny_cpu.yaml"
PRETRAIN = REPO / "scripts" / "pretrain_bdlm.py"
E2E_ITERS = 16


@pytest.fixture(scope="module")
def tiny_cpu_runs(slurm, tmp_path_factory, request):
    """configs/tiny_cpu.yaml through submit.py, twice side by side: uninterrupted, and sent USR1 (as at the
    time limit) once it logs iteration 3. Shortened context (L = 128) so it stays a few minutes on 2 cores."""
    if not (PRETRAIN.is_file() and TINY_CPU.is_file()):
        pytest.skip("scripts/pretrain_bdlm.py or configs/tiny_cpu.yaml not there yet")
    data_path = yaml.safe_load(TINY_CPU.read_text())["data-path"]
    if not (REPO / f"{data_path}.bin").is_file():
        subprocess.run([sys.executable, "scripts/prepare_data.py"], cwd=REPO, check=True, timeout=600)
    root = tmp_path_factory.mktemp("slurm_tiny_cpu")
    runs = {name: [f"train-iters={E2E_ITERS}", "seq-length=128", "log-interval=1",
                   "eval-interval=1000", "tensorboard-dir=null", f"data-cache-path={root}/cache_{name}"]
            for name in ("plain", "preempted")}
    jobs = submit_jobs(slurm, TINY_CPU, root / "runs", runs, script="scripts/pretrain_bdlm.py")
    request.addfinalizer(lambda: cancel(jobs, slurm))
    job, log = jobs["preempted"]
    wait_for_log(log, r"iteration\s+3/", timeout=600)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True, timeout=30)
    return {name: (wait_for_job(job, slurm, timeout=900), log.read_text(), root / "runs" / name)
            for name, (job, log) in jobs.items()}


def test_tiny_cpu_job_completes(tiny_cpu_runs):
    fields, log, run_dir = tiny_cpu_runs["plain"]
    assert fields["ExitCode"] == "0:0" and fields["Restarts"] == "0", fields
    assert sorted(iteration_losses(log)) == list(range(1, E2E_ITERS + 1)), log
    assert_final_checkpoint(run_dir / "checkpoints", E2E_ITERS)


def test_tiny_cpu_job_preempted_saves_requeues_resumes_and_matches(tiny_cpu_runs):
    fields, log, run_dir = tiny_cpu_runs["preempted"]
    assert fields["ExitCode"] == "0:0" and fields["Restarts"] == "1", fields
    assert "submit.py: preempted (ranks exited 0); requeueing job" in log, log
    saved = int(re.search(r"saved checkpoint at iteration\s+(\d+)", log).group(1))
    assert 3 <= saved < E2E_ITERS, log
    first_run, second_run = log.split("submit.py: job ")[1:3]
    assert f"loaded checkpoint from {run_dir}/checkpoints at iteration {saved}" in second_run, log
    assert max(iteration_losses(first_run)) == saved and min(iteration_losses(second_run)) == saved + 1
    assert_final_checkpoint(run_dir / "checkpoints", E2E_ITERS)
    # Every logged loss, so the final one, as in the uninterrupted run (exact resumption).
    assert iteration_losses(log) == iteration_losses(tiny_cpu_runs["plain"][1])
