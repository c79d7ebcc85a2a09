"""`make demo`'s run: the generated sequences corpus, configs/demo_sequences.yaml with CSBP over 2 ranks, then
greedy samples that continue each prompt's sequence, which only a model that learned them does (an untrained
one continues none: its logits are near uniform over 258 ids). Also: the corpus is the same on every machine.
"""

import os
import re
import subprocess
import sys

import pytest

from pretrain_runs import REPO, SCRIPT, TORCHRUN, environment

PREPARE = os.path.join(REPO, "scripts", "prepare_data.py")
GENERATE = os.path.join(REPO, "scripts", "generate_bdlm.py")
PROMPTS = {"january february ": "march april may", "monday tuesday ": "wednesday thursday friday",
           "mercury venus ": "earth mars jupiter", "red orange ": "yellow green blue"}


def test_the_sequences_corpus_is_deterministic():
    from megatron_csbp.tools.prepare_data import sequence_documents

    documents = sequence_documents()
    assert documents == sequence_documents() and len(documents) == 4000
    assert documents[0].endswith("\n") and all(8 <= len(text.split()) <= 40 for text in documents)


def _run(command, timeout):
    done = subprocess.run(command, cwd=REPO, env=environment(), timeout=timeout, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout[-6000:]
    return done.stdout


def test_the_demo_learns_its_sequences(tmp_path):
    prefix = str(tmp_path / "sequences")
    _run([sys.executable, PREPARE, "--corpus", "sequences", "--output-prefix", prefix], 300)
    save = str(tmp_path / "run")
    training = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, "--config",
                     os.path.join(REPO, "configs", "demo_sequences.yaml"), f"data-path={prefix}", f"save={save}",
                     f"load={save}", f"tensorboard-dir={tmp_path / 'tb'}"], 900)
    assert "iteration      250/     250" in training
    prompts = [argument for prompt in PROMPTS for argument in ("--prompt", prompt)]
    sampled = _run([sys.executable, GENERATE, "--load", save, *prompts, "--max-new-tokens", "40",
                    "--temperature", "0"], 300)
    samples = dict(zip(re.findall(r"prompt \d+: '(.*)'", sampled), re.findall(r"sample \d+: '(.*)'", sampled)))
    learned = [prompt for prompt, expected in PROMPTS.items() if samples[prompt].startswith(expected)]
    print("\n".join(f"{prompt!r} -> {samples[prompt]!r}" for prompt in PROMPTS))
    assert len(learned) >= 3, samples
