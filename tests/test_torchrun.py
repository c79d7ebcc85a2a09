"""torchrun users see a refusal as its one line and exit status 2, not a launcher traceback."""

import subprocess
import sys

from pretrain_runs import FAULTS, REPO, SCRIPT, TINY, base, environment, flags

pytest_plugins = ["pretrain_runs"]


def _launch(settings: dict, faults: dict | None = None, timeout: float = 200):
    """Our torchrun over the script, or over tests/faults.py injecting `faults`."""
    command = [sys.executable, "-m", "megatron_csbp.training.torchrun", "--standalone", "--nproc-per-node", "2",
               FAULTS if faults else SCRIPT, *flags({**TINY, **settings})]
    return subprocess.run(command, cwd=REPO, env=environment(faults), capture_output=True, text=True, timeout=timeout)


def test_a_refused_argument_is_one_line_exit_2_before_any_rank_starts(corpus):
    done = _launch(base(corpus, context_block_parallel=2, adam_beta1=1.5))
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == ["pretrain_bdlm.py: error: --adam-beta1 must be in [0, 1); got 1.5"]
    assert done.stdout == ""  # no rank ran: nothing was logged
    # the world size counts: 2 ranks cannot hold --context-block-parallel 4
    done = _launch(base(corpus, context_block_parallel=4))
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(
        "pretrain_bdlm.py: error: --tensor-model-parallel-size 1 x --pipeline-model-parallel-size 1 x "
        "--context-block-parallel 4 = 4 does not divide the world size 2"), done.stderr


def test_a_refusal_found_by_the_ranks_and_a_failed_rank(corpus, tmp_path):
    empty = tmp_path / "nothing_here"
    empty.mkdir()
    refused = _launch(base(corpus, context_block_parallel=2, load=empty, eval_iters=0))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr and "ChildFailedError" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"pretrain_bdlm.py: error: --load {empty}: no checkpoint there (no latest_checkpointed_iteration.txt); "
        f"give the --save directory of an earlier run, or drop --load to start from scratch")
    failed = _launch(base(corpus, context_block_parallel=2, eval_iters=0), faults={"MEGATRON_CSBP_TEST_FAIL": "1:2"})
    assert failed.returncode == 1
    assert "ChildFailedError" not in failed.stderr
    assert "rank 1 failed: RuntimeError: injected failure at iteration 2" in failed.stderr
    assert "torchrun: rank 1 (local rank 1, pid " in failed.stderr and ") ended with exit status 1" in failed.stderr
