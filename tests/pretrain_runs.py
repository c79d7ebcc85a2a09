"""Runs scripts/pretrain_bdlm.py as users do (python for one rank, torchrun for several) on a tiny model, or
tests/faults.py (the same command with faults injected) where a test injects faults.

Shared by the training, checkpointing and reliability tests. Each run costs ~10-15 s of start-up, so
tests share runs through module-scoped fixtures and check many things per run.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from spawn import run_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "pretrain_bdlm.py")
FAULTS = os.path.join(REPO, "tests", "faults.py")  # the script's command with the faults its environment names
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
OUR_TORCHRUN = (sys.executable, "-m", "megatron_csbp.torchrun")
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|.*?lm loss:\s*([-+0-9.eE]+|[-+]?(?:nan|NAN|inf|INF))")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([-+0-9.eE]+)")

# A ~60K-parameter BDLM on 64-token byte sequences, 8 blocks of 8: a training step takes ~0.1 s.
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=True,
            num_query_groups=2, normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
            untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0, seq_length=64,
            bdlm_block_size=8, split="90,10,0", micro_batch_size=2, global_batch_size=4, lr=3e-3, min_lr=3e-4,
            lr_decay_style="cosine", lr_warmup_iters=2, weight_decay=0.1, clip_grad=1.0, seed=1234,
            use_cpu_initialization=True, log_interval=1, distributed_timeout_minutes=1)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """A small default-like dataset: byte-tokenized standard-library sources, ~100K tokens."""
    prefix = str(tmp_path_factory.mktemp("corpus") / "stdlib")
    from megatron_csbp.tools import prepare_data

    assert prepare_data.main(["--output-prefix", prefix, "--max-bytes", "300000"]) == 0
    return prefix


def flags(settings: dict) -> list[str]:
    """`key=value` overrides (the CLI form `--config` files and users share); True switches on, None skips."""
    out = []
    for key, value in settings.items():
        if value is None or value is False:
            continue
        out.append(f"{key.replace('_', '-')}={'true' if value is True else value}")
    return out


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float

    @property
    def losses(self) -> dict[int, float]:
        found = {}
        for match in ITERATION.finditer(self.output):
            iteration = int(match.group(1))
            assert iteration not in found, f"iteration {iteration} logged twice:\n{self.output}"
            found[iteration] = float(match.group(3))
        return found

    @property
    def validation(self) -> dict[int, float]:
        return {int(m.group(1)): float(m.group(2)) for m in VALIDATION.finditer(self.output)}


def command(nproc: int, settings: dict, *extra: str, entry: str = SCRIPT,
            torchrun: tuple[str, ...] = (TORCHRUN,)) -> list[str]:
    """The command line of a run: python for one rank, else `torchrun` (plain torchrun, or e.g. `OUR_TORCHRUN`)."""
    launcher = [sys.executable] if nproc == 1 else [*torchrun, "--standalone", "--nproc-per-node", str(nproc)]
    return [*launcher, entry, *flags({**TINY, **settings}), *extra]


def environment(extra: dict | None = None) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MEGATRON_CSBP_TEST")}
    # megatron-core's "Transformer Engine and Apex are not installed" warnings would bury a failure's output.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore::UserWarning", **(extra or {}))
    return env


def run(nproc: int, settings: dict, *extra: str, env: dict | None = None, faults: dict | None = None,
        timeout: float = 300, expect: int | None = 0, torchrun: tuple[str, ...] = (TORCHRUN,)) -> Run:
    """Runs the script to completion; `expect` is the exit status required (None: any). `faults`: the
    tests/faults.py variables to inject (the run then takes that entry)."""
    started = time.time()
    done = run_command(command(nproc, settings, *extra, entry=FAULTS if faults else SCRIPT, torchrun=torchrun),
                       cwd=REPO, env=environment({**(env or {}), **(faults or {})}), timeout=timeout,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = Run(done.returncode, done.stdout, time.time() - started)
    if expect is not None:
        assert done.returncode == expect, f"exit status {done.returncode}, expected {expect}:\n{done.stdout[-6000:]}"
    return result


def lines_until_iteration(launched: subprocess.Popen, iteration: int = 2) -> list[str]:
    """The output lines of a running `launched` (stdout piped as text) up to the one logging `iteration`: the
    moment the stop, signal and fault tests act on a live run."""
    lines = []
    for line in launched.stdout:
        lines.append(line)
        if re.search(rf"iteration\s+{iteration}/", line):
            break
    return lines


def copy_checkpoint(source_root: str, iteration: int, target_root: str) -> str:
    """A `--load` directory holding only `iteration` of `source_root` (as if it were the latest)."""
    name = f"iter_{iteration:07d}"
    os.makedirs(target_root, exist_ok=True)
    shutil.copytree(os.path.join(source_root, name), os.path.join(target_root, name))
    with open(os.path.join(target_root, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write(str(iteration))
    return target_root


def significant(value: float, digits: int = 5) -> str:
    return f"{value:.{digits - 1}e}"


K = 6  # the reference runs train 2K iterations, evaluate and checkpoint every K


def base(corpus: str, **settings) -> dict:
    return {"data_path": corpus, "train_iters": 2 * K, "eval_interval": K, "eval_iters": 2, **settings}


@pytest.fixture(scope="session")
def reference_runs(corpus, tmp_path_factory) -> dict:
    """The tiny config, uninterrupted, on 1 rank and with CSBP over 2 ranks; both save at K and 2K."""
    root = tmp_path_factory.mktemp("reference")
    return {"root": root,
            "1 rank": run(1, base(corpus, save=root / "one", save_interval=K)),
            "csbp": run(2, base(corpus, context_block_parallel=2, save=root / "csbp", save_interval=K,
                                tensorboard_dir=root / "tb"))}


def validated_args(corpus: str, world: int = 1, **settings):
    """Validated arguments of the tiny config, as the script would build them (for in-process runs)."""
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.config import parse_args

    return validate_args(parse_args(flags({**TINY, "data_path": corpus, "train_iters": 4, **settings})), world)
