"""Megatron-LM's real `pretrain()` drives the plugin: the same numbers as our own loop, its flags in a YAML,
and the plugin's refusals before any work.

Needs Megatron-LM (not on PyPI): a checkout of tag core_v0.16.1 and `MEGATRON_LM_PATH` pointing at it; the
tests skip, saying so, where it is absent (e.g. CI on a fresh machine).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import megatron_lm_path
from pretrain_runs import FAULTS, ITERATION, REPO, SCRIPT, TORCHRUN, Run, environment, lines_until_iteration
from spawn import kill_tree, run_command, start

pytest_plugins = ["pretrain_runs"]
MEGATRON_LM = megatron_lm_path()
pytestmark = pytest.mark.skipif(MEGATRON_LM is None, reason="Megatron-LM is absent: set MEGATRON_LM_PATH to a "
                                                            "Megatron-LM checkout of tag core_v0.16.1")
CONFIG = os.path.join(REPO, "configs", "tiny_cpu.yaml")
GRAD_NORM = re.compile(r"iteration\s+(\d+)/.*?grad norm:\s*([0-9.]+)")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([-+0-9.eE]+)")
ITERS = 4


def _overrides(corpus, **settings):
    """The demo config, made small: 128-token samples, 4 iterations, validation at 2 and 4."""
    base = {"data-path": corpus, "save": None, "load": None, "tensorboard-dir": None, "seq-length": 128,
            "train-iters": ITERS, "log-interval": 1, "eval-interval": 2, "eval-iters": 1, "split": "90,10,0",
            "lr-warmup-fraction": 0.25}
    base.update({key.replace("_", "-"): value for key, value in settings.items()})
    return [f"{key}={'null' if value is None else 'true' if value is True else value}" for key, value in base.items()]


def _launch(loop, nproc, overrides, *extra, config=CONFIG, expect=0):
    command = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), SCRIPT, "--config", config,
               "--training-loop", loop, *overrides, *extra]
    done = subprocess.run(command, cwd=REPO, env=environment({"MEGATRON_LM_PATH": MEGATRON_LM}), timeout=900,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == expect, f"{loop}: exit {done.returncode}\n{done.stdout[-5000:]}"
    return Run(done.returncode, done.stdout, 0.0)


def _logged(run: Run) -> dict:
    """{iteration: (lm loss, grad norm)} as printed, and the validation losses."""
    losses = {int(m.group(1)): float(m.group(3)) for m in ITERATION.finditer(run.output)}
    norms = {int(m.group(1)): m.group(2) for m in GRAD_NORM.finditer(run.output)}
    return {i: (losses[i], norms[i]) for i in losses}, {int(m.group(1)): m.group(2)
                                                        for m in VALIDATION.finditer(run.output)}


def _assert_same_numbers(ours: Run, megatron: Run, first: int = 1):
    """Every logged iteration agrees: grad norms to every printed digit, losses to the last of their seven
    printed digits (Megatron-LM sums the micro-batch losses and token counts in fp32, our loop in fp64, so the
    seventh digit may round the other way). Megatron-LM's line for the second iteration of a run is the mean
    of its first two (its accumulators are not reset after the first log line)."""
    (our_steps, our_validation), (their_steps, their_validation) = _logged(ours), _logged(megatron)
    assert sorted(our_steps) == sorted(their_steps) == list(range(first, ITERS + 1)), (our_steps, their_steps)
    for iteration, (loss, norm) in our_steps.items():
        their_loss, their_norm = their_steps[iteration]
        assert their_norm == norm, (iteration, norm, their_norm)
        if iteration == first + 1:
            loss = (our_steps[first][0] + loss) / 2
        assert their_loss == pytest.approx(loss, rel=2e-6, abs=0), (iteration, loss, their_loss)
    assert our_validation and sorted(our_validation) == sorted(i for i in their_validation if i in our_validation)
    for iteration, value in our_validation.items():
        assert float(their_validation[iteration]) == pytest.approx(float(value), rel=2e-6, abs=0), iteration


TOPOLOGIES = {
    "csbp2": (2, {"context-block-parallel": 2}),
    "tp2xcsbp2+sp": (4, {"context-block-parallel": 2, "tensor-model-parallel-size": 2, "sequence-parallel": True}),
    "tp2xcsbp2+sp, tiled cross-entropy": (4, {"context-block-parallel": 2, "tensor-model-parallel-size": 2,
                                              "sequence-parallel": True, "cross-entropy-loss-fusion": True,
                                              "cross-entropy-tile-rows": 5}),
    "pp2xcsbp2": (4, {"context-block-parallel": 2, "pipeline-model-parallel-size": 2}),
    "dp2xcsbp2": (4, {"context-block-parallel": 2}),
    "cp2": (2, {"context-block-parallel": 2, "bdlm-parallel-mode": "cp"}),
    "cp-traffic2": (2, {"context-block-parallel": 2, "bdlm-parallel-mode": "cp-traffic"}),
    "bp2": (2, {"context-block-parallel": 2, "bdlm-parallel-mode": "bp"}),
    "fast-dllm-v2": (2, {"context-block-parallel": 2, "bdlm-objective": "fast-dllm-v2"}),
    "packed": (2, {"context-block-parallel": 2, "reset-position-ids": True, "reset-attention-mask": True,
                   "eod-mask-loss": True}),
}


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """The demo's corpus of short documents (runs of well-known sequences), for packing."""
    prefix = str(tmp_path_factory.mktemp("short") / "sequences")
    from megatron_csbp.tools import prepare_data

    assert prepare_data.main(["--corpus", "sequences", "--output-prefix", prefix]) == 0
    return prefix


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_both_loops_print_the_same_losses_and_grad_norms(corpus, name, request):
    nproc, settings = TOPOLOGIES[name]
    if name == "packed":  # documents of 50-250 bytes: every 128-token sample holds EODs
        corpus = request.getfixturevalue("short_documents")
    overrides = _overrides(corpus, **settings)
    ours = _launch("megatron-core", nproc, overrides)
    megatron = _launch("megatron-lm", nproc, overrides)
    assert "[after megatron is initialized]" in megatron.output and "[after megatron" not in ours.output
    _assert_same_numbers(ours, megatron)
    if name == "packed":  # the flags act: the same data unpacked (documents seeing each other) logs other losses
        unpacked = _launch("megatron-core", nproc, _overrides(corpus, **{"context-block-parallel": 2}))
        assert _logged(unpacked)[0][1][0] != _logged(ours)[0][1][0]


MOE_LINE = re.compile(r"iteration\s+(\d+)/.*?lm loss:\s*\S+ \| load_balancing_loss:\s*([-+0-9.eE]+) \|")
MOE = {"num-experts": 4, "moe-router-topk": 2, "moe-ffn-hidden-size": 48, "moe-aux-loss-coeff": 0.01,
       "moe-token-dispatcher-type": "alltoall", "moe-shared-expert-intermediate-size": 32, "moe-layer-freq": "[0,1,0,1]",
       "context-block-parallel": 2, "expert-model-parallel-size": 2, "transformer-impl": "local"}


def test_both_loops_print_the_same_mixture_of_experts_numbers(corpus):
    """A mixture-of-experts BDLM under EP2 x CSBP2: the same lm loss, grad norm and load_balancing_loss (Megatron-LM's
    MoE line) in both loops, its second line the mean of its first two as for the lm loss."""
    overrides = _overrides(corpus, **MOE)
    ours, megatron = _launch("megatron-core", 2, overrides), _launch("megatron-lm", 2, overrides)
    _assert_same_numbers(ours, megatron)
    our_aux, their_aux = ({int(m.group(1)): float(m.group(2)) for m in MOE_LINE.finditer(run.output)}
                          for run in (ours, megatron))
    assert sorted(our_aux) == sorted(their_aux) == list(range(1, ITERS + 1)), (our_aux, their_aux)
    for iteration, value in our_aux.items():
        expected = (our_aux[1] + value) / 2 if iteration == 2 else value
        assert their_aux[iteration] == pytest.approx(expected, rel=2e-6, abs=0), (iteration, value, their_aux)


def test_a_yaml_with_megatron_lm_only_flags_runs_under_megatron_lm(corpus, tmp_path):
    config = tmp_path / "megatron_lm.yaml"
    text = open(CONFIG, encoding="utf-8").read().replace("tokenizer-type: ByteLevelTokenizer",
                                                        "tokenizer-type: NullTokenizer\nvocab-size: 256")
    config.write_text(text + "\ntransformer-impl: local\nlog-throughput: true\ntiming-log-level: 0\n"
                             "no-masked-softmax-fusion: true\n")
    overrides = _overrides(corpus, train_iters=2)
    run = _launch("megatron-lm", 2, overrides, config=str(config))
    assert "throughput per GPU (TFLOP/s/GPU)" in run.output and re.search(r"iteration\s+2/\s*2", run.output)
    # Our own loop takes the neutral ones, saying so; a flag only Megatron-LM's loop acts on is refused, naming it
    # (as rank 0 of 2 would, before any work).
    config.write_text(config.read_text() + "lr-warmup-init: 0.0001\n")
    refused = subprocess.run([sys.executable, SCRIPT, "--config", str(config), "--training-loop", "megatron-core",
                              *overrides], cwd=REPO, env=environment({"WORLD_SIZE": "2", "RANK": "0"}), timeout=300,
                             capture_output=True, text=True)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "WARNING: --log-throughput: logging" in refused.stderr, refused.stderr[-2000:]
    assert ("error: --lr-warmup-init is taken under --training-loop megatron-lm only" in refused.stderr
            and "Traceback" not in refused.stderr), refused.stderr[-2000:]


def _megatron_lm_refusal(argv, world=2):
    sys.path.append(MEGATRON_LM)
    from megatron_csbp.training import megatron_lm
    from megatron_csbp.core.rules import ConfigError

    assert megatron_lm.import_pretrain() is not None
    with pytest.raises(ConfigError) as refused:
        megatron_lm.parse_args(["--config", CONFIG, *argv], world)
    return str(refused.value)


@pytest.mark.parametrize("argv,message", [
    (["bdlm-block-size=24"], "--seq-length 512 is not a multiple of --bdlm-block-size 24"),
    (["context-block-parallel=3"], "does not divide the world size 2"),
    (["--attention-dropout", "0.1"], "--attention-dropout must be 0"),
    (["--cp-comm-type", "a2a"], "--cp-comm-type selects a ring-CP transport"),
    (["--multi-latent-attention"], "--multi-latent-attention is not supported with CSBP"),
    (["--mtp-num-layers", "1"], "--mtp-num-layers (multi-token prediction) is not supported"),
    (["--hierarchical-context-parallel-sizes", "1", "2"], "--hierarchical-context-parallel-sizes is a ring-CP"),
    (["--position-embedding-type", "learned_absolute"], "BDLM needs rope"),
    (["--transformer-impl", "transformer_engine"], "needs Transformer Engine"),
    (["bdlm-noise-range=[0, 1]"], "--bdlm-noise-range 0.0 1.0 must satisfy 0 < T_MIN"),
    (["context-block-parallel-clean-shards=3"], "is not a multiple of --context-block-parallel-clean-shards 3"),
])
def test_the_plugins_refusals_fire_under_megatron_lm(argv, message):
    assert message in _megatron_lm_refusal(argv)


def test_a_refusal_under_megatron_lm_is_one_line_and_exit_2_before_any_work(corpus):
    done = subprocess.run([sys.executable, SCRIPT, "--config", CONFIG, "--training-loop", "megatron-lm",
                           *_overrides(corpus), "--attention-dropout", "0.1"], cwd=REPO, timeout=300,
                          env=environment({"MEGATRON_LM_PATH": MEGATRON_LM, "WORLD_SIZE": "2", "RANK": "0"}),
                          capture_output=True, text=True)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() and "warn" not in line.lower()]
    assert errors == ["pretrain_bdlm.py: error: --attention-dropout must be 0: the CSBP attention kernel has no "
                      "attention-probability dropout (hidden dropout is unaffected)"], done.stderr[-3000:]
    assert "initializ" not in done.stdout  # Megatron-LM never started


def test_a_command_without_eval_interval_runs_under_both_loops(corpus):
    """Megatron-LM's --eval-interval defaults to None, which its count of validation samples divides by (a TypeError
    once the process group is up); the plugin gives Megatron-LM our loop's default, so the command runs in both."""
    from pretrain_runs import run

    for loop in ("megatron-lm", "megatron-core"):
        done = run(1, {"data_path": corpus, "train_iters": 3, "eval_iters": 0}, "--training-loop", loop,
                   env={"MEGATRON_LM_PATH": MEGATRON_LM}, expect=None)
        assert done.returncode == 0 and "Traceback" not in done.output, (loop, done.output[-3000:])
        assert set(_logged(done)[0]) == {1, 2, 3}, loop


def _resume_from(root, iteration, target):
    """A --load directory holding `root`'s checkpoint of `iteration` only, as if it were the latest."""
    from pretrain_runs import copy_checkpoint

    return copy_checkpoint(str(root), iteration, str(target))


def test_a_checkpoint_of_either_loop_resumes_in_the_other(corpus, tmp_path):
    """Saved at iteration 2 by one loop, resumed to 4 by the other: the same next losses, grad norms and
    validation as the uninterrupted run (Megatron-LM's second line after its start is, as always, the mean of
    its first two)."""
    overrides = _overrides(corpus, context_block_parallel=2, save_interval=2)
    ours = _launch("megatron-core", 2, overrides + [f"save={tmp_path / 'ours'}"])
    megatron = _launch("megatron-lm", 2, overrides + [f"save={tmp_path / 'megatron'}"])
    _assert_same_numbers(ours, megatron)
    ours_steps, ours_validation = _logged(ours)

    load = _resume_from(tmp_path / 'megatron', 2, tmp_path / 'load_megatron')
    ours_from_megatron = _launch("megatron-core", 2, overrides + [f"load={load}"])
    # Megatron-LM's save recorded our manifest (its hook): the checkpoint is verified with checksums
    assert f"verified {load}/iter_0000002 (sizes, sha256, .metadata, common state)" in ours_from_megatron.output
    assert "loaded checkpoint from" in ours_from_megatron.output and "without csbp_manifest.json" not in \
        ours_from_megatron.output
    steps, validation = _logged(ours_from_megatron)
    assert sorted(steps) == [3, 4]
    for iteration in (3, 4):
        assert steps[iteration][1] == ours_steps[iteration][1], iteration
        assert steps[iteration][0] == pytest.approx(ours_steps[iteration][0], rel=2e-6, abs=0), iteration
    assert float(validation[4]) == pytest.approx(float(ours_validation[4]), rel=2e-6, abs=0)

    megatron_from_ours = _launch("megatron-lm", 2, overrides + [
        f"load={_resume_from(tmp_path / 'ours', 2, tmp_path / 'load_ours')}"])
    assert "successfully loaded checkpoint from" in megatron_from_ours.output
    steps, validation = _logged(megatron_from_ours)
    assert sorted(steps) == [3, 4] and [steps[i][1] for i in (3, 4)] == [ours_steps[i][1] for i in (3, 4)]
    assert steps[3][0] == pytest.approx(ours_steps[3][0], rel=2e-6, abs=0)
    assert steps[4][0] == pytest.approx((ours_steps[3][0] + ours_steps[4][0]) / 2, rel=2e-6, abs=0)
    assert float(validation[4]) == pytest.approx(float(ours_validation[4]), rel=2e-6, abs=0)


def test_yarn_and_the_query_scaling_train_alike_in_both_loops_and_a_resume_without_them_is_refused(corpus, tmp_path):
    """YaRN and Llama 4's query scaling (an original context of 32 of the 128 positions) under CSBP2: the same
    losses, grad norms and validation in both loops. Either loop's checkpoint, resumed by the other without them,
    is refused in one line, exit 2, before any iteration."""
    yarn = dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=4, yarn_original_max_position_embeddings=32,
                llama_4_scaling_beta=0.2)
    overrides = _overrides(corpus, context_block_parallel=2, save_interval=2, **yarn)
    ours = _launch("megatron-core", 2, overrides + [f"save={tmp_path / 'ours'}"])
    megatron = _launch("megatron-lm", 2, overrides + [f"save={tmp_path / 'megatron'}"])
    _assert_same_numbers(ours, megatron)
    for loop, saved in (("megatron-core", "megatron"), ("megatron-lm", "ours")):
        load = _resume_from(tmp_path / saved, 2, tmp_path / f"load_{saved}")
        done = subprocess.run([sys.executable, SCRIPT, "--config", CONFIG, "--training-loop", loop,
                               *_overrides(corpus, context_block_parallel=1), f"load={load}"], cwd=REPO, timeout=300,
                              capture_output=True, text=True, env=environment({"MEGATRON_LM_PATH": MEGATRON_LM}))
        errors = [line for line in done.stderr.splitlines() if "error" in line.lower() and "warn" not in line.lower()]
        assert done.returncode == 2 and errors == [
            f"pretrain_bdlm.py: error: checkpoint {load}/iter_0000002 was trained with --position-embedding-type "
            f"yarn, this run has --position-embedding-type rope: a run that continues it keeps its positions; give "
            f"its RoPE flags, or --finetune to train it on under new ones (e.g. to extend its context with YaRN)"], (
            loop, done.returncode, done.stderr[-3000:])
        assert not ITERATION.search(done.stdout), loop


def test_sliding_windows_train_alike_in_both_loops(corpus):
    """`--window-size 20,0 --window-attn-skip-freq 2` (layers 1 and 3 of 4 slide; megatron-core reads the flags in
    both loops) under CSBP2 with the windowed exchange: the same losses, grad norms and validation in both loops,
    and other losses than the same run with every layer global (a window masks; it adds no parameter: both runs
    load the same initial weights by the same seed)."""
    windows = {"context-block-parallel": 2, "window-size": "20,0", "window-attn-skip-freq": 2}
    ours = _launch("megatron-core", 2, _overrides(corpus, **windows))
    megatron = _launch("megatron-lm", 2, _overrides(corpus, **windows))
    _assert_same_numbers(ours, megatron)
    plain = _launch("megatron-core", 2, _overrides(corpus, **{"context-block-parallel": 2}))
    assert _logged(plain)[0][1][0] != _logged(ours)[0][1][0]


@pytest.mark.parametrize("loop", ["megatron-core", "megatron-lm"])
def test_a_right_window_is_refused_in_one_line_before_any_work(corpus, loop):
    done = subprocess.run([sys.executable, SCRIPT, "--config", CONFIG, "--training-loop", loop,
                           *_overrides(corpus, context_block_parallel=1), "--window-size", "20,4"], cwd=REPO,
                          timeout=300, capture_output=True, text=True,
                          env=environment({"MEGATRON_LM_PATH": MEGATRON_LM}))
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() and "warn" not in line.lower()]
    assert done.returncode == 2 and errors == [
        "pretrain_bdlm.py: error: --window-size 20,4: a right window (RIGHT != 0) would let a clean row see clean "
        "tokens after its own, whose noisy copies later blocks must predict; the kernels take a left window only: "
        "give --window-size 20,0"], (loop, done.returncode, done.stderr[-3000:])
    assert not ITERATION.search(done.stdout), loop


def test_a_hugging_face_tokenizer_gives_the_same_numbers_in_both_loops(corpus, tmp_path):
    """Megatron-LM's HuggingFaceTokenizer (a directory, through transformers) and ours (its tokenizer.json)
    number alike: same losses, grad norms and validation; GPTDataset never takes a real id as padding."""
    hf_dir, data = tmp_path / "hf", tmp_path / "data" / "text"
    for script, argv in (("make_tiny_hf_model.py", ["--family", "llama", "--output", str(hf_dir)]),
                         ("prepare_data.py", ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                              str(hf_dir / "tokenizer.json"), "--output-prefix", str(data),
                                              "--max-bytes", "300000"])):
        done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", script), *argv], cwd=REPO,
                              env=environment(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    overrides = _overrides(str(data), context_block_parallel=2, tokenizer_type="HuggingFaceTokenizer",
                           tokenizer_model=str(hf_dir), split="80,20,0")
    _assert_same_numbers(_launch("megatron-core", 2, overrides), _launch("megatron-lm", 2, overrides))


LAUNCHER = [sys.executable, "-m", "megatron_csbp.torchrun", "--standalone", "--nproc-per-node", "2"]


def _refused(loop, overrides, *extra):
    """A 2-rank launch through our torchrun that must be refused: exit 2, no traceback; returns its one error line."""
    done = subprocess.run([*LAUNCHER, SCRIPT, "--config", CONFIG, "--training-loop", loop, *overrides, *extra],
                          cwd=REPO, env=environment({"MEGATRON_LM_PATH": MEGATRON_LM}), timeout=600,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 2, f"{loop}: exit {done.returncode}\n{done.stdout[-5000:]}"
    assert "Traceback" not in done.stdout, done.stdout[-5000:]
    errors = [line for line in done.stdout.splitlines() if line.startswith("pretrain_bdlm.py: error:")]
    assert len(errors) == 1, done.stdout[-5000:]
    return errors[0].removeprefix("pretrain_bdlm.py: error: ")


@pytest.fixture(scope="module")
def both_loops_checkpoints(corpus, tmp_path_factory):
    """Iteration 2 saved by each loop (2 ranks, CSBP2)."""
    root = tmp_path_factory.mktemp("both_loops")
    overrides = _overrides(corpus, context_block_parallel=2, save_interval=2, train_iters=2, eval_interval=2)
    runs = {loop: _launch(loop, 2, overrides + [f"save={root / loop}"]) for loop in ("megatron-lm", "megatron-core")}
    return root, runs


def test_megatron_lms_save_records_our_manifest_and_its_load_verifies_it(both_loops_checkpoints, corpus, tmp_path):
    """Under both loops, a same-size overwrite of bytes in a weight shard is refused in one line (exit 2),
    whichever loop wrote the checkpoint; so are a damaged common.pt and a .metadata payload under Megatron-LM."""
    from megatron_csbp.training import checkpointing

    root, runs = both_loops_checkpoints
    assert re.search(r"checksummed 7 files \([0-9.]+ MiB\) in [0-9.]+ s \(sha256, 2 ranks sharing\)",
                     runs["megatron-lm"].output), runs["megatron-lm"].output[-3000:]
    written = root / "megatron-lm" / "iter_0000002"
    files = checkpointing.read_manifest(str(written), log=lambda line: None)
    assert sorted(files) == sorted(p.name for p in written.iterdir() if p.name != "csbp_manifest.json")
    overrides = _overrides(corpus, context_block_parallel=2, train_iters=4)
    for writer, reader in (("megatron-lm", "megatron-lm"), ("megatron-lm", "megatron-core"),
                           ("megatron-core", "megatron-lm")):
        load = pathlib.Path(_resume_from(root / writer, 2, tmp_path / f"{writer}_to_{reader}"))
        _damage_same_size(load / "iter_0000002" / "__0_1.distcp")
        fallback = ("; restore it, or pass --load-fallback-to-previous to load the newest complete older "
                    "checkpoint" if reader == "megatron-core" else "")  # our loop's flag
        assert _refused(reader, overrides, f"load={load}") == (
            f"checkpoint {load}/iter_0000002 is corrupt: __0_1.distcp does not match its sha256 in "
            f"csbp_manifest.json (damaged on disk or in transfer){fallback}"), (writer, reader)

    bare = pathlib.Path(_resume_from(root / "megatron-lm", 2, tmp_path / "bare"))  # as Megatron-LM alone writes it
    (bare / "iter_0000002" / "csbp_manifest.json").unlink()
    _damage_same_size(bare / "iter_0000002" / "common.pt")
    refusal = _refused("megatron-lm", overrides, f"load={bare}")
    assert refusal.startswith(f"checkpoint {bare}/iter_0000002 is corrupt: its common state cannot be read (") and \
        refusal.endswith("), and it has no csbp_manifest.json") and "did not finish" not in refusal, refusal

    import pickle

    from test_checkpointing import _Payload, _manifest_rebuilt

    marker = tmp_path / "payload_ran"
    forged = pathlib.Path(_resume_from(root / "megatron-lm", 2, tmp_path / "forged"))
    (forged / "iter_0000002" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _manifest_rebuilt(forged / "iter_0000002")
    assert _refused("megatron-lm", overrides, f"load={forged}").startswith(
        f"checkpoint {forged}/iter_0000002: {forged}/iter_0000002/.metadata is refused: it names io.open, which is "
        f"not checkpoint metadata")
    assert not marker.exists()


def _damage_same_size(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + 64)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_megatron_lm_takes_the_save_lock(corpus, tmp_path):
    """A --save another live run holds is refused under Megatron-LM's loop as under ours (the holder here: this
    test's own process, alive on this host)."""
    import json

    from megatron_csbp.training import save_lock

    save = tmp_path / "held"
    save.mkdir()
    holder = save_lock.this_holder()
    (save / save_lock.LOCK).write_text(json.dumps(holder))
    assert _refused("megatron-lm", _overrides(corpus, context_block_parallel=2, train_iters=2),
                    f"save={save}") == (
        f"--save {save} is in use by another run ({save_lock.describe(holder)}): wait for it to end or give another "
        f"--save; if that run is gone, delete {save}/{save_lock.LOCK}")
    assert json.loads((save / save_lock.LOCK).read_text()) == holder  # not taken over, not removed


def test_sigterm_to_the_launcher_saves_exits_0_without_a_traceback_and_resumes(corpus, tmp_path):
    """Slurm's stop (SIGTERM to the job step's launcher) under --exit-signal-handler: the ranks save at the next
    iteration and the launcher exits 0, no SignalException traceback; the requeued run resumes there."""
    import signal

    save = tmp_path / "checkpoints"
    overrides = _overrides(corpus, context_block_parallel=2, train_iters=12, eval_interval=100, save=save,
                           load=save, exit_signal_handler=True)
    command = [*LAUNCHER, SCRIPT, "--config", CONFIG, "--training-loop", "megatron-lm", *overrides]
    launched = start(command, cwd=REPO, env=environment({"MEGATRON_LM_PATH": MEGATRON_LM}),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = lines_until_iteration(launched)
        launched.send_signal(signal.SIGTERM)
        lines.append(launched.communicate(timeout=300)[0])
    finally:
        kill_tree(launched)
    output = "".join(lines)
    assert launched.returncode == 0, output[-5000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-5000:]
    assert "exiting program after receiving SIGTERM" in output
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= saved < 12 and (save / f"iter_{saved:07d}" / "csbp_manifest.json").is_file()
    assert not (save / "csbp_writer.lock").exists()  # released on the way out
    resumed = _launch("megatron-lm", 2, overrides[:-1])  # without --exit-signal-handler
    assert re.search(rf"successfully loaded checkpoint from {save} \[.*?\] at iteration\s+{saved}\b",
                     resumed.output), resumed.output[-3000:]
    steps, _ = _logged(resumed)
    assert min(steps) == saved + 1 and max(steps) == 12


def test_a_nan_loss_under_megatron_lm_is_its_own_exit_without_a_traceback(corpus, tmp_path):
    """A NaN loss under Megatron-LM's loop: its rerun state machine re-runs the step, saves and exits 16 ("resume
    to check the result"), and that is the command's status, with Megatron-LM's own lines and no traceback (the
    command used to print one and `rank 0 failed: SystemExit: 16`, exit 1). Our loop's answer: test_reliability's
    test_nan_steps_are_skipped_counted_and_a_run_of_them_stops_training."""
    save = tmp_path / "checkpoints"
    overrides = _overrides(corpus, context_block_parallel=2, train_iters=6, eval_interval=100, save=save,
                           save_interval=2)
    done = run_command([*LAUNCHER, FAULTS, "--config", CONFIG, "--training-loop", "megatron-lm", *overrides],
                       cwd=REPO, env=environment({"MEGATRON_LM_PATH": MEGATRON_LM,
                                                  "MEGATRON_CSBP_TEST_NAN_ITERATIONS": "3"}),
                       timeout=600, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = done.stdout
    assert done.returncode == 16, output[-5000:]
    assert "Traceback" not in output and not re.search(r"rank \d+ (failed|stopping)", output), output[-5000:]
    assert re.search(r"torchrun: rank \d \(local rank \d, pid \d+\) ended with exit status 16", output), output[-5000:]
    assert "Unexpected result nan" in output and "Saving a checkpoint and exiting now" in output, output[-5000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (save / "csbp_writer.lock").exists()
