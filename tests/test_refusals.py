"""Bad input never reaches a traceback: every numeric flag out of range, every unusable directory and a
--save too small for a checkpoint are one line naming the flag, exit status 2, before any work."""

import os
import subprocess
import sys

import pytest

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.training.arguments import checkpoint_bytes, validate, validate_args
from megatron_csbp.training.flags import build_parser
from spawn import on_cpu_backend

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--bdlm-block-size", "8",
        "--eval-iters", "0", "--attention-dropout", "0"]

# (extra flags, the refusal's exact text). `{prefix}`, `{file}` and `{tmp}` are filled in per test.
REFUSALS = [
    (["--kv-channels", "0"], "--kv-channels must be >= 1; got 0"),
    (["--ffn-hidden-size", "-1"], "--ffn-hidden-size must be >= 1; got -1"),
    (["--lr", "-1"], "--lr must be >= 0; got -1.0"),
    (["--lr", "nan"], "--lr must be >= 0; got nan"),
    (["--min-lr=-1e-4"], "--min-lr must be >= 0; got -0.0001"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], "--lr 0.0001 is below --min-lr 0.001: the schedule decays from --lr "
                                           "down to --min-lr; raise --lr or lower --min-lr"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0; got -0.1"),
    (["--adam-beta1", "1.5"], "--adam-beta1 must be in [0, 1); got 1.5"),
    (["--adam-beta1", "-0.1"], "--adam-beta1 must be in [0, 1); got -0.1"),
    (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1); got 1.0"),
    (["--adam-eps", "0"], "--adam-eps must be > 0; got 0.0"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0 (0: no clipping); got -1.0"),
    (["--attention-dropout", "1"], "--attention-dropout must be in [0, 1); got 1.0"),
    (["--hidden-dropout", "-0.1"], "--hidden-dropout must be in [0, 1); got -0.1"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout must be in [0, 1); got 1.5"),
    (["--init-method-std", "-0.02"], "--init-method-std must be >= 0; got -0.02"),
    (["--norm-epsilon", "0"], "--norm-epsilon must be > 0; got 0.0"),
    (["--rotary-percent", "0"], "--rotary-percent must be in (0, 1]; got 0.0"),
    (["--rotary-base", "0"], "--rotary-base must be >= 1; got 0"),
    (["--seed", "-1"], "--seed must be in [0, 2**32); got -1"),
    (["--seed", str(2 ** 32)], f"--seed must be in [0, 2**32); got {2 ** 32}"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by must be >= 1; got 0"),
    (["--vocab-size", "0"], "--vocab-size must be >= 1; got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1; got 0"),
    (["--global-batch-size", "-4"], "--global-batch-size must be >= 1; got -4"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters must be >= 0; got -1"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be >= 1; got 0"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters N (the final iterations over "
                                  "which the lr anneals; --lr-wsd-decay-style picks its shape)"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "20"],
     "--lr-wsd-decay-iters 20 exceeds --lr-decay-iters 10 (default: --train-iters); shorten the anneal"),
    (["--save-interval", "-1"], "--save-interval must be >= 1; got -1"),
    (["--save-interval", "0"], "--save-interval must be >= 1; got 0"),
    (["--exit-interval", "-5"], "--exit-interval must be >= 1; got -5"),
    (["--exit-duration-in-mins", "-1"], "--exit-duration-in-mins must be >= 0; got -1"),
    (["--num-workers", "-1"], "--num-workers must be >= 0; got -1"),
    (["--recompute-num-layers", "0"], "--recompute-num-layers must be >= 1; got 0"),
    (["--split", "100,0,0", "--eval-iters", "2"],
     "--split '100,0,0' gives validation no share, but --eval-iters 2 asks for it: give it a share (e.g. --split "
     "98,2,0) or set --eval-iters 0"),
    (["--data-path", "nan", "{prefix}", "1", "{prefix}"],
     "--data-path: weights must be finite, >= 0 and not all 0; got [nan, 1.0]"),
    (["--save", "{file}"], "--save {file} is a file, not a directory; give a directory (it is created when missing)"),
    (["--load", "{file}"], "--load {file} is a file, not a directory; give the --save directory of a run"),
    (["--tensorboard-dir", "{file}"],
     "--tensorboard-dir {file} is a file, not a directory; give a directory (it is created when missing)"),
    (["--data-cache-path", "{file}"],
     "--data-cache-path {file} is a file, not a directory; give a directory (it is created when missing)"),
    (["--save", "{file}/checkpoints"],
     "--save {file}/checkpoints: {file} is a file, so {file}/checkpoints cannot be created; give another directory"),
]


@pytest.fixture
def places(tmp_path):
    prefix = tmp_path / "corpus"
    for suffix in (".bin", ".idx"):
        (prefix.parent / (prefix.name + suffix)).write_bytes(b"")  # only their presence is checked up front
    file = tmp_path / "a_file"
    file.write_text("not a directory")
    return {"prefix": str(prefix), "file": str(file), "tmp": str(tmp_path)}


def _fill(values, places):
    return [value.format(**places) for value in values]


def test_every_out_of_range_flag_is_one_line_naming_it_exit_2(places, capsys):
    from megatron_csbp.training import pretrain

    for extra, message in REFUSALS:
        # Our loop, in this process: importing Megatron-LM's (where present) enables faulthandler on stderr,
        # which pytest's capture cannot give a file descriptor; tests/test_flag_table_megatron_lm.py runs its refusals.
        argv = BASE + ["--training-loop", "megatron-core", "--data-path", places["prefix"]] + _fill(extra, places)
        assert pretrain.main(argv) == 2, extra
        captured = capsys.readouterr()
        assert captured.err.strip().splitlines() == [f"pretrain_bdlm.py: error: {message.format(**places)}"], extra
        assert captured.out == "", extra
    # Negative control: the same base with no bad flag passes every check (and fills the batch size).
    args = validate_args(build_parser().parse_args(BASE + ["--data-path", places["prefix"]]), 1, on_accelerator=False)
    assert args.global_batch_size == 1


def test_a_refusal_is_exit_2_from_the_command_line_too(places):
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "pretrain_bdlm.py"), *BASE,
                           "--data-path", places["prefix"], "--adam-beta1", "1.5"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "pretrain_bdlm.py: error: --adam-beta1 must be in [0, 1); got 1.5"


def test_save_needs_room_for_a_checkpoint(places, monkeypatch, capsys):
    from collections import namedtuple

    import megatron_csbp.training.arguments as arguments

    save = os.path.join(places["tmp"], "checkpoints")
    parsed = build_parser().parse_args(BASE + ["--data-path", places["prefix"], "--save", save])
    need, parameters, per_parameter = checkpoint_bytes(validate(parsed, 1, on_accelerator=False), parsed)
    assert per_parameter == 4 + 8  # fp32 weights and Adam's two moments
    usage = namedtuple("usage", "total used free")
    for free, refused, warned in ((need - 1, True, False), (need + 1, False, True), (3 * need, False, False)):
        monkeypatch.setattr(arguments.shutil, "disk_usage", lambda path, free=free: usage(10 * need, 0, free))
        parsed = build_parser().parse_args(BASE + ["--data-path", places["prefix"], "--save", save])
        sizes = (f"{free / 2**30:.2f} GiB free there; one checkpoint of this model takes about {need / 2**30:.2f} GiB "
                 f"({parameters:,} parameters x 12 bytes: weights and optimizer state)")
        if refused:
            with pytest.raises(ConfigError) as caught:
                validate_args(parsed, 1, on_accelerator=False)
            assert str(caught.value) == f"--save {save}: {sizes}; free space or give another --save"
            continue
        validate_args(parsed, 1, on_accelerator=False)
        err = capsys.readouterr().err
        assert (f"WARNING: --save {save}: {sizes}: room for one checkpoint only" in err) == warned, err


def test_checkpoint_size_estimate_matches_a_real_checkpoint(tmp_path):
    """The estimate behind the free-space check, against the bytes a saved checkpoint really takes."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from pretrain_runs import TINY, flags
    from spawn import run_ranks

    from megatron_csbp.training.config import parse_args

    args = parse_args(flags({**TINY, "data_path": "unused", "train_iters": 4}))
    estimate = checkpoint_bytes(validate(args, 1, on_accelerator=False, check_paths=False), args)[0]
    actual = run_ranks(_save_once, 1, args, str(tmp_path / "save"), timeout=300)[0]
    assert 0.9 * actual <= estimate <= 1.1 * actual, (estimate, actual)


@on_cpu_backend
def _save_once(rank, world, args, save):
    """Builds the tiny model and optimizer, steps once, saves one checkpoint; returns its .distcp bytes."""
    from megatron_csbp.training import checkpointing, providers, loop as training
    from megatron_csbp.mcore import parallel_state

    args.vocab_size, args.tokenizer_type = 256, "ByteLevelTokenizer"
    parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=1)
    try:
        trainer = training.Trainer(providers.RunProviders(args))
        trainer.optimizer.step()  # Adam's moments exist from the first step on (zero gradients suffice)
        directory = checkpointing.save_checkpoint(save, trainer.state, trainer.model, trainer.optimizer,
                                                  trainer.scheduler, args, log=lambda line: None)
    finally:
        parallel_state.destroy_model_parallel()
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
               if name.endswith(".distcp"))


def test_prepare_data_on_empty_input_is_one_line(tmp_path):
    empty, skipped = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("")
    skipped.write_text('{"other": 1}\nnot json\n')
    script = os.path.join(REPO, "scripts", "prepare_data.py")
    for source, why, extra in ((empty, "the input is empty", []),
                               (skipped, "all 2 non-empty line(s) were skipped", ["--on-bad-line", "skip"])):
        done = subprocess.run([sys.executable, script, "--input", str(source), "--output-prefix",
                               str(tmp_path / "out"), *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1] == (
            f"prepare_data: {source}: no documents to write ({why}); give input with text in it")
        assert not list(tmp_path.glob("out*")), list(tmp_path.glob("out*"))


def prepare_data_command(*argv):
    """`scripts/prepare_data.py ARGV` in a fresh interpreter: (exit status, stderr)."""
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "prepare_data.py"), *map(str, argv)],
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr


def test_prepare_data_refuses_input_that_is_not_utf8_in_one_line(tmp_path):
    """A text file or a JSONL line in Latin-1: one line naming the file, line and byte and the fix, exit 2, and
    nothing written; the same JSONL with --on-bad-line skip builds the dataset from its good line (control)."""
    good, text, jsonl = tmp_path / "good.txt", tmp_path / "notes.txt", tmp_path / "lines.jsonl"
    good.write_text("read first, never written\n")
    text.write_bytes(b"plain line\n" + "caf\u00e9 au lait\n".encode("latin-1"))  # 0xe9: line 2, byte 14
    jsonl.write_bytes(b'{"text": "ok"}\n' + '{"text": "caf\u00e9"}\n'.encode("latin-1"))  # line 2, byte 28
    fix = "convert the file to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8), or skip such lines with --on-bad-line skip"
    for source, byte in ((text, 14), (jsonl, 28)):
        code, err = prepare_data_command("--input", good, source, "--output-prefix", tmp_path / "out")
        assert code == 2 and err.strip().splitlines() == [
            f"prepare_data: {source}:2: not UTF-8 text (byte 0xe9 at byte {byte} of the file); {fix}"], err
        assert sorted(os.listdir(tmp_path)) == ["good.txt", "lines.jsonl", "notes.txt"]  # no dataset, no temporary
    code, err = prepare_data_command("--input", jsonl, "--output-prefix", tmp_path / "out", "--on-bad-line", "skip")
    assert code == 0 and err.strip().splitlines() == [
        f"skipped {jsonl}:2: not UTF-8 text (byte 0xe9 at byte 28 of the file)"], err
    assert sorted(os.listdir(tmp_path)) == ["good.txt", "lines.jsonl", "notes.txt", "out.bin", "out.idx",
                                            "out.stats.json"]


def test_submit_refuses_a_non_positive_cpus_per_task():
    submit = os.path.join(REPO, "scripts", "slurm", "submit.py")
    for cpus, refused in (("-1", True), ("0", True), ("2", False)):
        done = subprocess.run([sys.executable, submit, "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"),
                               "--nodes", "1", "--gpus-per-node", "0", "--ntasks-per-node", "2", "--cpus-per-task",
                               cpus, "--dry-run"], capture_output=True, text=True, timeout=120, cwd=REPO)
        if refused:
            assert done.returncode == 2 and done.stderr.strip().splitlines() == [
                f"submit.py: refused: --cpus-per-task {cpus}: must be >= 1 (or drop it for Slurm's default)"]
        else:  # negative control: a valid count is written into the batch script
            assert done.returncode == 0 and "--cpus-per-task=2" in done.stdout, done.stderr

