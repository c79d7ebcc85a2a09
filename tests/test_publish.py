"""megatron_csbp.runtime.publish: a directory appears whole or not at all, and replaces another whole."""

import errno
import os
import socket
import subprocess
import sys

import pytest

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.runtime import publish


def _tree(directory):
    return {os.path.relpath(os.path.join(folder, name), directory): open(os.path.join(folder, name)).read()
            for folder, _, files in os.walk(directory) for name in files}


def _write(directory, files):
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
        with open(os.path.join(directory, name), "w") as handle:
            handle.write(text)


def _beside(target):
    prefix = f".{os.path.basename(target)}."
    return sorted(name for name in os.listdir(os.path.dirname(target)) if name.startswith(prefix))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "set aside"])
def test_a_published_directory_replaces_the_old_one_whole(tmp_path, monkeypatch, exchange):
    if not exchange:  # kernels or filesystems without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(publish, "_exchange", lambda first, second: False)
    target = str(tmp_path / "out")
    _write(target, {"model-00001-of-00002.safetensors": "old", "model-00002-of-00002.safetensors": "old",
                    "index.json": "old"})
    with publish.private_directory(target, "--out") as private:
        _write(private, {"model.safetensors": "new", "sub/config.json": "new"})
        publish.publish_directory(private, target, replace=True, flag="--out")
    assert _tree(target) == {"model.safetensors": "new", os.path.join("sub", "config.json"): "new"}
    assert _beside(target) == []


def test_a_missing_or_empty_target_is_taken_and_a_non_empty_one_is_never_merged(tmp_path):
    for target in (str(tmp_path / "missing"), str(tmp_path / "empty")):
        if target.endswith("empty"):
            os.mkdir(target)
        with publish.private_directory(target, "--out") as private:
            _write(private, {"a": "new"})
            publish.publish_directory(private, target, replace=False, flag="--out")
        assert _tree(target) == {"a": "new"} and _beside(target) == []
    target = str(tmp_path / "taken")
    _write(target, {"theirs": "written meanwhile"})
    with pytest.raises(ConfigError, match="something else was written there meanwhile"):
        with publish.private_directory(target, "--out") as private:
            _write(private, {"a": "new"})
            publish.publish_directory(private, target, replace=False, flag="--out")
    assert _tree(target) == {"theirs": "written meanwhile"} and _beside(target) == []


def test_a_failed_write_leaves_nothing(tmp_path):
    target = str(tmp_path / "out")
    with pytest.raises(RuntimeError):
        with publish.private_directory(target, "--out") as private:
            _write(private, {"half": "written"})
            raise RuntimeError("killed")
    assert not os.path.exists(target) and _beside(target) == []


def test_only_the_temporaries_of_dead_writers_are_removed(tmp_path):
    target = str(tmp_path / "out")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    for name in (f".out.partial-{host}-{dead.pid}-x", f".out.old-{host}-{dead.pid}-y",
                 f".out.partial-{host}-{os.getppid()}-z", f".out.partial-otherhost-{dead.pid}-w"):
        _write(str(tmp_path / name), {"f": "x"})
    removed = publish.remove_abandoned(target)
    assert sorted(os.path.basename(path) for path in removed) == [f".out.old-{host}-{dead.pid}-y",
                                                                   f".out.partial-{host}-{dead.pid}-x"]
    assert _beside(target) == sorted([f".out.partial-{host}-{os.getppid()}-z", f".out.partial-otherhost-{dead.pid}-w"])


def test_refusals_name_the_flag(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^--save .*file/out: a file stands where a directory is needed"):
        publish.make_private(str(tmp_path / "file" / "out"), "--save")
    with pytest.raises(ConfigError, match=r"^--hf-dir .*: \d+\.\d MiB are to be written but only"):
        publish.require_free_space(str(tmp_path / "new" / "out"), 1 << 62, "--hf-dir")
    publish.require_free_space(str(tmp_path / "new" / "out"), 1, "--hf-dir")
    assert publish.out_of_space(RuntimeError("wrapped")) is False
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as error:
            raise RuntimeError("unexpected pos 42") from error
    except RuntimeError as error:
        assert publish.out_of_space(error)
