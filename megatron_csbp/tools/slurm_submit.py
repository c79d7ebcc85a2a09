"""Submit a BDLM pretraining run to Slurm, refusing a topology that does not fit before anything is queued.

    submit.py --config configs/X.yaml --nodes N --gpus-per-node G [--ntasks-per-node K] [...] [-- key=value ...]

The config and overrides are checked exactly as the training script will check them
(`megatron_csbp.training.config.parse_args` + `megatron_csbp.training.arguments.validate_args`), with the world size this
allocation will have: N x G ranks, or N x K on CPU-only nodes (G = 0, gloo). A misfit prints one line
with the numbers and exits 2; nothing is written or submitted.

Every submission keeps what it ran in `<output-dir>/<job-name>/`: `submit_<time>.sbatch` (the batch script),
`config_<time>.yaml` (the config as given; the overrides are in the script), `slurm-<jobid>.out` (the log,
appended to across requeues) and `checkpoints/` (`--save` and `--load`: an empty directory is a fresh start,
otherwise the run resumes, which is what makes requeueing safe; `save`/`load` in the YAML are replaced).

Preemption: the batch shell is sent SIGUSR1 `--signal-seconds` before the time limit (`--signal=B:USR1@S`;
`scancel --batch --signal=USR1 JOB` does the same by hand). It forwards the signal to the ranks through
`srun`, which save a checkpoint at the next iteration boundary and exit; the shell then requeues the job,
which resumes from the checkpoint. The shell keeps waiting on SIGTERM (scancel, `scontrol requeue`, a
PreemptMode=REQUEUE preemption), so the ranks get the whole KillWait to react to the SIGTERM Slurm sends them.

`main(argv)` is the command of `scripts/slurm/submit.py`.
"""

import argparse
import datetime
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout this package runs from: the job runs its scripts/
DEFAULT_TRAIN_SCRIPT = "scripts/pretrain_bdlm.py"


class Refused(Exception):
    """A submission refused before sbatch: one line, exit code 2."""


def parse_cli(argv: list[str]) -> argparse.Namespace:
    overrides = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, help="Training YAML (flag names, as scripts/pretrain_bdlm.py).")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True, help="0 for CPU-only nodes (gloo).")
    parser.add_argument("--ntasks-per-node", type=int, default=None,
                        help="Ranks per node: G on GPU nodes (one per GPU, the default), K >= 1 on CPU nodes.")
    parser.add_argument("--cpus-per-task", type=int, default=None)
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--qos")
    parser.add_argument("--time", help="Slurm time limit, e.g. 04:00:00.")
    parser.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=None,
                        help="Whole nodes. Default: on for GPU nodes, off for CPU nodes.")
    parser.add_argument("--signal-seconds", type=int, default=120,
                        help="Seconds before the time limit at which the run is told to save and requeue.")
    parser.add_argument("--container-image", help="pyxis/enroot image for srun.")
    parser.add_argument("--container-mounts", help="pyxis mounts, SRC:DST[,...]; the repository must be visible.")
    parser.add_argument("--job-name", help="Default: the config's file name without .yaml.")
    parser.add_argument("--output-dir", default="runs", help="Runs live in OUTPUT_DIR/JOB_NAME (default runs).")
    parser.add_argument("--python", help="Interpreter on the nodes. Default: this one, or 'python' in a container.")
    parser.add_argument("--train-script", default=DEFAULT_TRAIN_SCRIPT,
                        help=f"Training entry point, relative to the repository (default {DEFAULT_TRAIN_SCRIPT}).")
    parser.add_argument("--dry-run", action="store_true", help="Print the batch script; write and submit nothing.")
    args = parser.parse_args(argv)
    args.overrides = overrides
    return args


def ranks_per_node(cli: argparse.Namespace) -> int:
    nodes, gpus, tasks = cli.nodes, cli.gpus_per_node, cli.ntasks_per_node
    if nodes < 1:
        raise Refused(f"--nodes {nodes}: need at least 1 node")
    if gpus < 0:
        raise Refused(f"--gpus-per-node {gpus}: give the GPUs per node, or 0 for CPU-only nodes")
    if gpus > 0:
        if tasks not in (None, gpus):
            raise Refused(f"--ntasks-per-node {tasks} with --gpus-per-node {gpus}: GPU runs use one rank per GPU; "
                          f"drop --ntasks-per-node")
        return gpus
    tasks = 1 if tasks is None else tasks
    if tasks < 1:
        raise Refused(f"--ntasks-per-node {tasks}: CPU nodes need at least 1 rank per node")
    return tasks


def training_argv(config: str, checkpoints: str, overrides: list[str]) -> list[str]:
    """The training script's arguments: `--load` == `--save` (requeue pattern), signal handler on."""
    return ["--config", config, "--save", checkpoints, "--load", checkpoints, "--exit-signal-handler", *overrides]


def refuse_own_checkpoint_flags(overrides: list[str]) -> None:
    for token in overrides:
        name = token.split("=", 1)[0].lstrip("-").replace("_", "-")
        if name in ("save", "load"):
            raise Refused(f"'{token}': submit.py sets --save and --load to the run's own checkpoints/ (the requeue "
                          f"pattern); choose the run with --output-dir and --job-name instead")


def check_topology(cli: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """The training script's own parsing and validation, run here with the allocation's world size."""
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.flags import build_parser
    from megatron_csbp.training.config import parse_args

    parser = build_parser()

    def refuse(message):
        raise ConfigError(message)

    parser.error = refuse
    try:
        args = parse_args(training_argv(cli.config, "checkpoints", cli.overrides), parser)
        return validate_args(args, world_size, on_accelerator=cli.gpus_per_node > 0, check_paths=False)
    except ConfigError as error:
        where = (f"{cli.nodes} node(s) x {cli.gpus_per_node} GPU(s)" if cli.gpus_per_node
                 else f"{cli.nodes} node(s) x {ranks_per_node(cli)} CPU rank(s)")
        raise Refused(f"world size {world_size} ({where}), {cli.config}: {error}") from None


def batch_script(cli: argparse.Namespace, run_dir: Path, config_copy: Path, tasks: int) -> str:
    gpus = cli.gpus_per_node
    exclusive = gpus > 0 if cli.exclusive is None else cli.exclusive
    directives = [f"--job-name={cli.job_name}", f"--nodes={cli.nodes}", f"--ntasks-per-node={tasks}"]
    directives += [f"--gpus-per-node={gpus}"] if gpus > 0 else []
    directives += ["--exclusive"] if exclusive else []
    directives += [f"--cpus-per-task={cli.cpus_per_task}"] if cli.cpus_per_task else []
    directives += [f"--{name}={getattr(cli, name)}" for name in ("partition", "account", "qos", "time")
                   if getattr(cli, name)]
    directives += [f"--output={run_dir}/slurm-%j.out", "--open-mode=append", "--requeue",
                   f"--signal=B:USR1@{cli.signal_seconds}", f"--chdir={REPO_ROOT}"]

    python = cli.python or ("python" if cli.container_image else sys.executable)
    command = [python, cli.train_script, *training_argv(str(config_copy), str(run_dir / "checkpoints"),
                                                        cli.overrides)]
    container = []
    if cli.container_image:
        container.append(f"--container-image={cli.container_image}")
    if cli.container_mounts:
        container.append(f"--container-mounts={cli.container_mounts}")
    srun = ["srun", "--kill-on-bad-exit=1", *container, "bash", "-c",
            'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID; exec "$@"', "rank",
            *command]
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH {directive}" for directive in directives),
        f"# Written by scripts/slurm/submit.py: {shlex.join(sys.argv)}",
        "set -uo pipefail",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 2500 * 16 + ${SLURM_RESTART_COUNT:-0} % 16))",
        'echo "submit.py: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST,'
        ' $SLURM_NTASKS ranks, master $MASTER_ADDR:$MASTER_PORT, $(date -u +%FT%TZ)"',
        "",
        "# USR1: tell the ranks to save and exit, then requeue. TERM: Slurm signals the ranks itself; keep waiting.",
        "preempted=0 srun_pid=",
        'trap \'preempted=1; [[ -n $srun_pid ]] && kill -USR1 "$srun_pid" 2>/dev/null\' USR1',
        "trap 'echo \"submit.py: SIGTERM, waiting for the ranks to finish\"' TERM",
        shlex.join(srun) + " &",
        "srun_pid=$!",
        '(( preempted )) && kill -USR1 "$srun_pid"',
        'while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid"; done',
        'wait "$srun_pid"; status=$?',
        "if (( preempted )); then",
        '    echo "submit.py: preempted (ranks exited $status); requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID" || echo "submit.py: requeue refused; resubmit with the same'
        ' --job-name and --output-dir to resume"',
        "fi",
        'echo "submit.py: ranks exited $status, $(date -u +%FT%TZ)"',
        "exit $status",
        "",
    ])


def fresh_stamp(run_dir: Path) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate, n = stamp, 1
    while (run_dir / f"submit_{candidate}.sbatch").exists():
        candidate, n = f"{stamp}-{n}", n + 1
    return candidate


def submit(cli: argparse.Namespace) -> int:
    if not os.path.isfile(cli.config):
        raise Refused(f"--config {cli.config}: no such file")
    if cli.signal_seconds < 1:
        raise Refused(f"--signal-seconds {cli.signal_seconds}: must be >= 1")
    if cli.cpus_per_task is not None and cli.cpus_per_task < 1:
        raise Refused(f"--cpus-per-task {cli.cpus_per_task}: must be >= 1 (or drop it for Slurm's default)")
    tasks = ranks_per_node(cli)
    refuse_own_checkpoint_flags(cli.overrides)
    check_topology(cli, cli.nodes * tasks)
    cli.job_name = cli.job_name or Path(cli.config).stem
    run_dir = Path(cli.output_dir).resolve() / cli.job_name
    stamp = fresh_stamp(run_dir)
    config_copy, script_path = run_dir / f"config_{stamp}.yaml", run_dir / f"submit_{stamp}.sbatch"
    script = batch_script(cli, run_dir, config_copy, tasks)
    if cli.dry_run:
        sys.stdout.write(script)
        return 0
    if not (REPO_ROOT / cli.train_script).is_file():
        raise Refused(f"--train-script {cli.train_script}: no such file under {REPO_ROOT}")
    if shutil.which("sbatch") is None:
        raise Refused("sbatch not found on PATH: submit from a Slurm login node (or use --dry-run)")
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cli.config, config_copy)
    script_path.write_text(script)
    result = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True, text=True)
    if result.returncode != 0:
        print(f"submit.py: sbatch failed ({result.returncode}): {result.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = result.stdout.strip().split(";")[0]
    print(job_id)
    print(f"submit.py: job {job_id}: script {script_path}, log {run_dir}/slurm-{job_id}.out", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    cli = parse_cli(sys.argv[1:] if argv is None else argv)
    try:
        return submit(cli)
    except Refused as error:
        print(f"submit.py: refused: {error}", file=sys.stderr)
        return 2
