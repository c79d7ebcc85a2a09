"""A command's start-up says once what is missing, instead of megatron-core's seven fallback warnings per rank.

Run as users run it (no PYTHONWARNINGS): no warning line, the note once. The control: with the user's own
`PYTHONWARNINGS=default` the same run shows megatron-core's fallback warnings (the filter is what hid them,
and a user's choice wins). In-process: the filter takes exactly the listed messages, any other warning shows.
"""

import os
import subprocess
import sys
import warnings

import pytest

from megatron_csbp.runtime import quiet

pytest_plugins = ["pretrain_runs"]  # the corpus fixture
from pretrain_runs import SCRIPT, TINY, flags  # noqa: E402


def _run(corpus, tmp_path, **env):
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, SCRIPT, *flags({**TINY, "data_path": corpus, "train_iters": 1,
                                                           "lr_warmup_iters": 0, "eval_iters": 0, "data_cache_path": tmp_path / "cache"})],
                          env={**environment, "OMP_NUM_THREADS": "1", **env}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


@pytest.mark.skipif(not quiet.missing_accelerations(), reason="Transformer Engine and Apex are both installed")
def test_a_run_prints_one_note_and_no_warnings(corpus, tmp_path):
    output = _run(corpus, tmp_path)
    assert "Warning" not in output, output[-4000:]
    assert output.count(quiet.start_up_note()) == 1
    assert "iteration        1/       1" in output
    unfiltered = _run(corpus, tmp_path, PYTHONWARNINGS="default")
    assert "UserWarning: Transformer Engine and Apex are not installed" in unfiltered  # the control


def test_the_filter_takes_only_the_listed_messages(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", [])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.quiet_start_up()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("`torch.jit.script_method` is deprecated. Please switch", DeprecationWarning)
        warnings.warn("something the user should see", UserWarning)
        warnings.warn("Apex is not installed, said as a FutureWarning", FutureWarning)
    assert [str(warning.message) for warning in seen] == ["something the user should see",
                                                          "Apex is not installed, said as a FutureWarning"]


def test_the_note_names_what_is_missing():
    assert quiet.start_up_line([]) is None
    assert "Transformer Engine and Apex not installed" in quiet.start_up_line(["transformer_engine", "apex"])
    assert "Apex not installed" in quiet.start_up_line(["apex"])


def test_a_refusal_stays_one_line(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--seq-length", "0"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stdout.strip().splitlines()) == 1, done.stdout


def test_the_users_warning_options_win(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", ["default"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.quiet_start_up()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
    assert len(seen) == 1
