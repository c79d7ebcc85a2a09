"""Checkpoints are never half-published, damage is caught on load (with a way back), a --load that
cannot be honoured is refused clearly, and Megatron-LM's exit conditions save before leaving."""

import os
import re
import shutil

import pytest

from pretrain_runs import base, run, validated_args
from spawn import on_cpu_backend, run_ranks

pytest_plugins = ["pretrain_runs"]


@pytest.fixture(scope="module")
def interrupted(corpus, tmp_path_factory):
    """A 1-rank run that saves at 3, then dies after writing iteration 6 but before publishing it; and
    its requeued run (--load == --save)."""
    save = tmp_path_factory.mktemp("interrupted") / "checkpoints"
    settings = base(corpus, train_iters=6, save=save, load=save, save_interval=3, eval_iters=0)
    crashed = run(1, settings, faults={"MEGATRON_CSBP_TEST_CRASH_BEFORE_PUBLISH": "6"}, expect=1, timeout=150)
    assert f"rank 0 failed: RuntimeError: injected crash before publishing {save}/iter_0000006" in crashed.output
    listing = sorted(os.listdir(save))
    tracker = (save / "latest_checkpointed_iteration.txt").read_text()
    resumed = run(1, settings)
    return dict(save=save, settings=settings, crashed=crashed, listing=listing, tracker=tracker, resumed=resumed)


def test_a_save_interrupted_before_publishing_leaves_the_previous_checkpoint(interrupted):
    save = interrupted["save"]
    assert interrupted["listing"] == ["iter_0000003", "iter_0000006.tmp", "latest_checkpointed_iteration.txt"]
    assert interrupted["tracker"] == "3"
    resumed = interrupted["resumed"]
    assert f"loaded checkpoint from {save} at iteration 3" in resumed.output
    crashed_losses = interrupted["crashed"].losses
    assert sorted(crashed_losses) == [1, 2, 3, 4, 5, 6] and sorted(resumed.losses) == [4, 5, 6]
    assert resumed.losses == {i: crashed_losses[i] for i in (4, 5, 6)}
    assert sorted(os.listdir(save)) == ["iter_0000003", "iter_0000006", "latest_checkpointed_iteration.txt"]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "6"


def test_a_load_that_cannot_be_honoured_is_one_line_and_exit_2(corpus, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run(1, base(corpus, load=empty, eval_iters=0), expect=2)
    assert "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1] == (
        f"pretrain_bdlm.py: error: --load {empty}: no checkpoint there (no latest_checkpointed_iteration.txt); "
        f"give the --save directory of an earlier run, or drop --load to start from scratch")


@on_cpu_backend
def _train_cases(rank, world_size, cases):
    """Runs `training.train` for each (name, args); returns {name: ("ok" | "error", output or message)}."""
    import contextlib
    import io

    from megatron_csbp.training import loop as training
    from megatron_csbp.core.rules import ConfigError

    results = {}
    for name, args in cases:
        output = io.StringIO()
        try:
            with contextlib.redirect_stdout(output):
                training.train(args)
            results[name] = ("ok", output.getvalue())
        except ConfigError as error:
            results[name] = ("error", str(error))
    return results


def test_damaged_or_mismatched_checkpoints_and_exit_conditions(interrupted, corpus, tmp_path):
    source = interrupted["save"]
    truncated = tmp_path / "truncated"
    shutil.copytree(source, truncated)
    victim = truncated / "iter_0000006" / "__0_0.distcp"
    size = victim.stat().st_size
    os.truncate(victim, size // 2)
    unreadable = tmp_path / "unreadable"
    shutil.copytree(source, unreadable)
    metadata = unreadable / "iter_0000006" / ".metadata"
    metadata.write_bytes(b"\0" * metadata.stat().st_size)  # same size: the manifest cannot tell, loading can
    damaged = tmp_path / "damaged"  # same size, changed bytes: only the checksum can tell
    shutil.copytree(source, damaged)
    _damage(damaged / "iter_0000006" / "__0_0.distcp")
    lost = tmp_path / "lost"
    shutil.copytree(source, lost)
    shutil.rmtree(lost / "iter_0000006")
    empty = tmp_path / "requeue"
    empty.mkdir()
    settings = dict(train_iters=6, eval_iters=0)
    exits = {name: tmp_path / name for name in ("exit_interval", "exit_duration")}
    cases = [
        ("exit_interval", validated_args(corpus, save=str(exits["exit_interval"]), exit_interval=2, **settings)),
        ("exit_duration", validated_args(corpus, save=str(exits["exit_duration"]), exit_duration_in_mins=0,
                                         **settings)),
        ("truncated", validated_args(corpus, load=str(truncated), **settings)),
        ("fallback", validated_args(corpus, load=str(truncated), load_fallback_to_previous=True, **settings)),
        ("unreadable", validated_args(corpus, load=str(unreadable), **settings)),
        ("damaged", validated_args(corpus, load=str(damaged), **settings)),
        ("damaged_fallback", validated_args(corpus, load=str(damaged), load_fallback_to_previous=True, **settings)),
        ("lost", validated_args(corpus, load=str(lost), **settings)),
        ("shape", validated_args(corpus, load=str(source), hidden_size=32, **settings)),
        ("yarn", validated_args(corpus, load=str(source), **YARN, **settings)),
        ("yarn_finetune", validated_args(corpus, load=str(source), finetune=True, **YARN, train_iters=1,
                                         lr_warmup_iters=0, eval_iters=0)),
        ("requeue", validated_args(corpus, load=str(empty), save=str(empty), train_iters=1, lr_warmup_iters=0,
                                    eval_iters=0)),
        ("missing", validated_args(corpus, load=str(tmp_path / "missing"), save=str(tmp_path / "missing"),
                                   exit_on_missing_checkpoint=True, **settings)),
    ]
    results = run_ranks(_train_cases, 1, cases, timeout=300)[0]

    status, message = results["truncated"]
    assert status == "error" and message == (
        f"checkpoint {truncated}/iter_0000006 is corrupt: __0_0.distcp has {size // 2} bytes, {size} were written "
        f"(truncated?); restore it, or pass --load-fallback-to-previous to load the newest complete older "
        f"checkpoint")
    status, output = results["fallback"]
    assert status == "ok" and "falling back to an older checkpoint" in output
    assert f"loaded checkpoint from {truncated} at iteration 3" in output
    resumed = interrupted["resumed"].losses
    for iteration in (4, 5, 6):  # the fallback run trains on exactly as the original did
        assert f"iteration {iteration:8d}/       6" in output and f"lm loss: {resumed[iteration]:.6E}" in output
    status, message = results["unreadable"]
    assert status == "error" and message == (
        f"checkpoint {unreadable}/iter_0000006 is corrupt: .metadata does not match its sha256 in "
        f"csbp_manifest.json (damaged on disk or in transfer); restore it, or pass --load-fallback-to-previous to "
        f"load the newest complete older checkpoint"), message
    status, message = results["damaged"]
    assert status == "error" and message.startswith(
        f"checkpoint {damaged}/iter_0000006 is corrupt: __0_0.distcp does not match its sha256"), message
    status, output = results["damaged_fallback"]
    assert status == "ok" and f"loaded checkpoint from {damaged} at iteration 3" in output, output
    for iteration in (4, 5, 6):
        assert f"iteration {iteration:8d}/       6" in output and f"lm loss: {resumed[iteration]:.6E}" in output
    status, message = results["lost"]
    assert status == "error" and message.startswith(f"checkpoint {lost}/iter_0000006 does not exist"), message
    status, message = results["shape"]
    assert status == "error" and message == (
        f"checkpoint {source}/iter_0000006 was saved with --hidden-size 64, this run has --hidden-size 32: use the "
        f"same --hidden-size, or another --load")
    status, message = results["yarn"]  # resuming under other positions: refused; --finetune may change them
    assert status == "error" and message == (
        f"checkpoint {source}/iter_0000006 was trained with --position-embedding-type rope, this run has "
        f"--position-embedding-type yarn: a run that continues it keeps its positions; give its RoPE flags, or "
        f"--finetune to train it on under new ones (e.g. to extend its context with YaRN)"), message
    status, output = results["yarn_finetune"]
    assert status == "ok" and f"loaded checkpoint from {source} at iteration 6" in output, output
    for name, stop, why in (("exit_interval", 2, "--exit-interval 2"), ("exit_duration", 1, "--exit-duration-in-mins 0")):
        status, output = results[name]  # Megatron-LM's exit conditions: save, then leave (exit status 0)
        assert status == "ok" and f"exiting at iteration {stop} on {why}; last good checkpoint: iteration {stop} in " \
                                  f"{exits[name]}" in output, output
        assert (exits[name] / "latest_checkpointed_iteration.txt").read_text() == str(stop)
    status, message = results["missing"]  # Megatron-LM's --exit-on-missing-checkpoint: no silent fresh start
    assert status == "error" and message == (
        f"--load {tmp_path}/missing: no checkpoint there, and --exit-on-missing-checkpoint is set; give the --save "
        f"directory of an earlier run, or drop --exit-on-missing-checkpoint")
    status, output = results["requeue"]
    assert status == "ok" and f"no checkpoint in {empty} yet (--load is --save, the requeue pattern)" in output
    assert (empty / "latest_checkpointed_iteration.txt").read_text() == "1"


YARN = dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=4, yarn_original_max_position_embeddings=16)


def test_a_run_continuing_a_checkpoint_keeps_its_rope_and_a_finetune_may_change_it():
    """`check_same_positions`: the first RoPE flag that differs, named with both values, in one line; the same flags
    pass (a checkpoint recording no YaRN flags, saved before they existed, is plain RoPE)."""
    import argparse

    from megatron_csbp.training.checkpointing import CheckpointError, check_same_positions

    plain = dict(position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, use_rope_scaling=False,
                 rope_scaling_factor=8.0)
    yarn = {**plain, "position_embedding_type": "yarn", "yarn_rotary_scaling_factor": 4.0,
            "yarn_original_max_position_embeddings": 16}
    check_same_positions(plain, argparse.Namespace(**plain, yarn_beta_fast=None, llama_4_scaling_beta=None), "c")
    check_same_positions(yarn, argparse.Namespace(**yarn), "c")
    for saved, ours, said in (
            (yarn, plain,
             "was trained with --position-embedding-type yarn, this run has --position-embedding-type rope"),
            (yarn, {**yarn, "yarn_rotary_scaling_factor": 8.0},
             "was trained with --yarn-rotary-scaling-factor 4.0, this run has --yarn-rotary-scaling-factor 8.0"),
            (yarn, {**yarn, "llama_4_scaling_beta": 0.1},
             "was trained with no --llama-4-scaling-beta, this run has --llama-4-scaling-beta 0.1"),
            (plain, {**plain, "rotary_base": 500000},
             "was trained with --rotary-base 10000, this run has --rotary-base 500000")):
        with pytest.raises(CheckpointError) as refused:
            check_same_positions(saved, argparse.Namespace(**ours), "c")
        assert str(refused.value).startswith(f"checkpoint c {said}: a run that continues it keeps its positions; "
                                             f"give its RoPE flags, or --finetune"), str(refused.value)


def _damage(path, *, length=4096):
    """Same-size damage: inverts up to `length` bytes in the middle of the file."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    for i in range(start, min(len(data), start + length)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _manifest_digit_changed(path):
    """Same-size, still valid JSON: one hex digit of one recorded digest changed."""
    text = path.read_text()
    at = text.index('"sha256": "') + len('"sha256": "')
    path.write_text(text[:at] + ("0" if text[at] != "0" else "1") + text[at + 1:])


def test_same_size_damage_of_any_checkpoint_file_is_named_and_fallback_skips_it(interrupted, tmp_path):
    """Every file of a checkpoint (each .distcp shard, .metadata, common.pt, metadata.json, the manifest)
    damaged without changing its size: the load refuses naming the file, and the fallback takes iteration 3."""
    from megatron_csbp.training.checkpointing import CheckpointError, find_checkpoint

    source = interrupted["save"]
    files = sorted(p.name for p in (source / "iter_0000006").iterdir())
    assert {".metadata", "common.pt", "csbp_manifest.json"} <= set(files) and any(
        name.endswith(".distcp") for name in files), files
    damages = [(name, _damage) for name in files] + [("csbp_manifest.json", _manifest_digit_changed)]
    for case, (name, damage) in enumerate(damages):
        root = tmp_path / f"case{case}"
        shutil.copytree(source, root)
        victim = root / "iter_0000006" / name
        size = victim.stat().st_size
        damage(victim)
        assert victim.stat().st_size == size
        directory = root / "iter_0000006"
        what = (f"{name} is damaged (unreadable, or not what was written)" if name == "csbp_manifest.json" else
                f"{name} does not match its sha256 in csbp_manifest.json (damaged on disk or in transfer)")
        with pytest.raises(CheckpointError) as refused:
            find_checkpoint(str(root), fallback=False, log=lambda line: None)
        assert str(refused.value) == (
            f"checkpoint {directory} is corrupt: {what}; restore it, or pass --load-fallback-to-previous to load "
            f"the newest complete older checkpoint"), name
        warnings = []
        assert find_checkpoint(str(root), fallback=True, log=warnings.append) == 3, name
        assert warnings == [f" WARNING: checkpoint {directory} is corrupt: {what}; falling back to an older "
                            f"checkpoint"], warnings
    intact = tmp_path / "intact"  # negative control: the undamaged copy loads its latest
    shutil.copytree(source, intact)
    assert find_checkpoint(str(intact), fallback=False, log=lambda line: None) == 6


def test_checksum_cost_is_logged_at_save(interrupted):
    output = interrupted["resumed"].output
    assert re.search(r"checksummed \d+ files \([0-9.]+ MiB\) in [0-9.]+ s \(sha256, 1 ranks sharing\)", output), \
        output[-3000:]


@pytest.fixture
def small_disk(tmp_path):
    """A 2.6 MiB tmpfs: room for one tiny checkpoint (~1.6 MiB), not two. Needs root (mount)."""
    import subprocess

    mount = tmp_path / "small_disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_during_a_save_says_so_and_keeps_the_previous_checkpoint(corpus, small_disk):
    from megatron_csbp.training.checkpointing import find_checkpoint

    save = small_disk / "checkpoints"
    result = run(1, base(corpus, save=save, save_interval=2, train_iters=4, eval_iters=0), expect=1, timeout=200)
    assert "saved checkpoint at iteration       2" in result.output
    assert "room for one checkpoint only" in result.output  # the up-front warning
    match = re.search(rf"rank 0 failed: CheckpointSaveError: no space left on device writing {save}/iter_0000004.tmp "
                      rf"under --save {save} \([0-9.]+ MiB free\); the previous checkpoint is intact: free space "
                      rf"there or give another --save", result.output)
    assert match, result.output[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert find_checkpoint(str(save), fallback=False, log=lambda line: None) == 2


class _Payload:
    """A pickle that, once loaded, creates `marker` (standing in for any code a replaced file could run)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _manifest_rebuilt(directory):
    """The manifest a forger would write: sizes and digests of the files as they now are."""
    from megatron_csbp.training import checkpointing

    names = checkpointing._checkpoint_files(str(directory))
    checkpointing._write_manifest(str(directory), {name: [os.path.getsize(directory / name),
                                                          checkpointing._digest(str(directory / name))]
                                                   for name in names})


@pytest.fixture
def payload_checkpoint(interrupted, tmp_path):
    """A copy of the run's checkpoints whose latest `.metadata` is a payload, with the manifest rebuilt to match;
    and the marker file the payload would create."""
    import pickle

    marker = tmp_path / "payload_ran"
    control = pickle.loads(pickle.dumps(_Payload(marker)))  # negative control: the payload is live under pickle
    control.close()
    assert marker.exists()
    marker.unlink()
    root = tmp_path / "payload"
    shutil.copytree(interrupted["save"], root)
    directory = root / "iter_0000006"
    (directory / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _manifest_rebuilt(directory)
    refusal = (f"checkpoint {directory}: {directory}/.metadata is refused: it names io.open, which is not "
               f"checkpoint metadata (loading it could run code); nothing was loaded: replace the checkpoint with a "
               f"copy you trust")
    return root, marker, refusal


def test_a_metadata_payload_never_runs_and_is_refused_naming_the_file(payload_checkpoint):
    from megatron_csbp.training.checkpointing import CheckpointError, find_checkpoint

    root, marker, refusal = payload_checkpoint
    with pytest.raises(CheckpointError) as refused:
        find_checkpoint(str(root), fallback=False, log=lambda line: None)
    assert str(refused.value).startswith(refusal + ";"), str(refused.value)
    assert not marker.exists()
    warnings = []  # the fallback skips it, as any unusable checkpoint, and runs nothing either
    assert find_checkpoint(str(root), fallback=True, log=warnings.append) == 3
    assert refusal in warnings[0] and not marker.exists()


def test_the_metadata_allow_list_reads_real_checkpoints_and_names_only_checkpoint_classes(interrupted):
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    from megatron_csbp.runtime import safe_load

    directory = str(interrupted["save"] / "iter_0000006")
    ours, torchs = safe_load.read_metadata(directory), FileSystemReader(directory).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata and ours.storage_data == torchs.storage_data
    names = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            names.add(module.split(".")[0])
            return super().find_class(module, name)

    with open(os.path.join(directory, ".metadata"), "rb") as handle:
        Recording(handle).load()
    assert names == {"torch"}, names  # torch's classes only: nothing of builtins, os, subprocess...


def test_every_entry_point_refuses_a_metadata_payload_before_it_runs(payload_checkpoint, corpus, tmp_path):
    """Training, generation and export: exit 2, the one line, no traceback, and the payload never ran."""
    import subprocess
    import sys

    from pretrain_runs import REPO, command, environment

    root, marker, refusal = payload_checkpoint
    scripts = os.path.join(REPO, "scripts")
    for name, argv in (
            ("pretrain_bdlm.py", command(1, base(corpus, load=root, eval_iters=0))),
            ("generate_bdlm.py", [sys.executable, os.path.join(scripts, "generate_bdlm.py"), "--load", str(root),
                                  "--prompt", "def ", "--max-new-tokens", "4"]),
            ("convert_hf.py", [sys.executable, os.path.join(scripts, "convert_hf.py"), "export", "--load", str(root),
                               "--hf-dir", str(tmp_path / "hf")])):
        done = subprocess.run(argv, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, (name, done.stdout[-2000:] + done.stderr[-3000:])
        assert "Traceback" not in done.stderr and not marker.exists(), name
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"{name}: error: {refusal}"), (name, last)


def _common_state_file(directory, common: dict, by_name=()):
    """Writes `directory/common.pt` as torch.save does, the enums of `by_name` pickled by name through getattr
    (as Debian's Python 3.11.2 pickles every enum: `return getattr, (self.__class__, self._name_)`)."""
    import enum

    import torch

    saved = {cls: cls.__dict__.get("__reduce_ex__") for cls in by_name}
    try:
        for cls in by_name:
            cls.__reduce_ex__ = enum.pickle_by_enum_name
        torch.save(common, directory / "common.pt")
    finally:
        for cls, original in saved.items():
            if original is None:
                del cls.__reduce_ex__
            else:
                cls.__reduce_ex__ = original


class _GetattrOfNonMember:
    def __reduce__(self):
        from megatron.core.transformer.enums import AttnBackend

        return getattr, (AttnBackend, "__init__")


def test_megatron_lms_common_state_with_enums_by_name_loads_and_nothing_else_does(interrupted, tmp_path):
    """Megatron-LM's `args` hold enums (AttnBackend, ModelType, the exit signal) and dtypes; pickled by name
    (getattr), torch's weights_only refuses them. Loaded through the allow-list: the same values, and a getattr
    of anything but an enum member is still refused, in one line that says what was seen."""
    import argparse
    import signal

    import torch
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    from megatron_csbp.training import checkpointing

    root = tmp_path / "megatron_lm"
    shutil.copytree(interrupted["save"], root)
    directory = root / "iter_0000006"
    (directory / "csbp_manifest.json").unlink()  # as Megatron-LM's pretrain() alone writes it
    args = argparse.Namespace(attention_backend=AttnBackend.auto, model_type=ModelType.encoder_or_decoder,
                              exit_signal=signal.SIGTERM, params_dtype=torch.bfloat16, consumed_train_samples=24)
    _common_state_file(directory, {"args": args, "iteration": 6, "checkpoint_version": 3.0},
                       by_name=(AttnBackend, ModelType, signal.Signals))
    with pytest.raises(Exception, match="getattr"):  # negative control: plain weights_only refuses this file
        torch.load(directory / "common.pt", weights_only=True)
    assert checkpointing.saved_args(checkpointing.common_state(str(directory))) == vars(args)
    warnings = []
    checkpointing.check_complete(str(directory), log=warnings.append)
    assert warnings == [f" WARNING: {directory} was written by Megatron-LM without csbp_manifest.json: checked "
                        f"through dist_checkpointing's .metadata and common state only, no checksums"]

    _common_state_file(directory, {"args": _GetattrOfNonMember(), "iteration": 6, "checkpoint_version": 3.0})
    with pytest.raises(checkpointing.CheckpointError) as refused:
        checkpointing.check_complete(str(directory), log=lambda line: None)
    assert str(refused.value) == (
        f"checkpoint {directory} is corrupt: its common state cannot be read (getattr('AttnBackend', '__init__') is "
        f"not an enum member a checkpoint may name), and it has no csbp_manifest.json"), str(refused.value)

    _damage(directory / "common.pt")  # damaged, no manifest: said as seen, never "its save did not finish"
    with pytest.raises(checkpointing.CheckpointError) as refused:
        checkpointing.check_complete(str(directory), log=lambda line: None)
    message = str(refused.value)
    assert message.startswith(f"checkpoint {directory} is corrupt: its common state cannot be read (") and \
        message.endswith("), and it has no csbp_manifest.json") and "\n" not in message, message
    assert "did not finish" not in message


def test_our_checkpoint_without_its_manifest_is_refused_saying_what_was_seen(interrupted, tmp_path):
    from megatron_csbp.training.checkpointing import CheckpointError, check_complete

    root = tmp_path / "no_manifest"
    shutil.copytree(interrupted["save"], root)
    directory = root / "iter_0000006"
    check_complete(str(directory), log=lambda line: None)  # negative control: intact, it verifies
    (directory / "csbp_manifest.json").unlink()
    with pytest.raises(CheckpointError) as refused:
        check_complete(str(directory), log=lambda line: None)
    assert str(refused.value) == (f"checkpoint {directory} is incomplete: no csbp_manifest.json, which this plugin "
                                  f"writes before publishing a checkpoint (removed since, or a directory that was "
                                  f"never published)")


def test_objects_in_distcp_shards_are_read_weights_only_during_a_load(tmp_path):
    """torch's `DefaultLoadPlanner.load_bytes` (megatron-core's load planner inherits it) unpickles a shard's
    objects (RNG states, extra states) with weights_only=False; under `safe_load.restricted()` a payload there
    is refused and an RNG state still loads."""
    import io
    import random
    import types

    import numpy as np
    import torch
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from megatron_csbp.runtime import safe_load

    assert MCoreLoadPlanner.load_bytes is DefaultLoadPlanner.load_bytes  # what every dist_checkpointing load uses

    def load_bytes(obj):
        planner = DefaultLoadPlanner(flatten_state_dict=False)
        planner.state_dict = {}
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        MCoreLoadPlanner.load_bytes(planner, types.SimpleNamespace(dest_index=types.SimpleNamespace(fqn="x")), buffer)
        return planner.state_dict["x"]

    marker = tmp_path / "payload_ran"
    load_bytes(_Payload(marker)).close()  # negative control: outside a load, torch's reader runs it
    assert marker.exists()
    marker.unlink()
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state()}]
    with safe_load.restricted():
        with pytest.raises(Exception, match="io.open|open"):
            load_bytes(_Payload(marker))
        loaded = load_bytes(rng)
    assert not marker.exists()
    assert loaded[0]["random_rng_state"] == rng[0]["random_rng_state"]
    assert torch.equal(loaded[0]["torch_rng_state"], rng[0]["torch_rng_state"])
    assert all(np.array_equal(a, b) for a, b in zip(loaded[0]["np_rng_state"], rng[0]["np_rng_state"]))
    load_bytes(_Payload(marker)).close()  # torch's own reader is back after the load
    assert marker.exists()
