"""`torch_dist` checkpoints that are never half-written and never silently wrong.

Layout (Megatron-LM's): `<save>/iter_0000100/` holds a `megatron.core.dist_checkpointing` checkpoint of the
model and optimizer (sharded, so it reloads into another TP or block-parallel size), the LR scheduler, the
loop's position (iteration, consumed samples: the data iterator skips them on resume), the arguments, and
every rank's RNG states. `<save>/latest_checkpointed_iteration.txt` names the newest complete one.

Why it cannot be lost: a checkpoint is written under `iter_XXXXXXX.tmp`, a manifest of its file sizes is
added last, the directory is renamed to its real name, and only then is the tracker file replaced (temp
file + `os.replace`). A crash at any point leaves the previous checkpoint and tracker as they were. On load,
the manifest catches a truncated or missing file before any tensor is read; with `fallback=True` the newest
older complete checkpoint is used instead.
"""

import argparse
import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_csbp.arguments import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "csbp_manifest.json"
_ITERATION_DIR = re.compile(r"iter_(\d{7})")
# Settings that fix a parameter's shape: a checkpoint only loads into a model that agrees on all of them.
# The MASK id too: training, sampling and export must agree on it with the checkpoint.
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "kv_channels", "padded_vocab_size", "swiglu", "normalization", "add_bias_linear",
                    "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights", "mask_token_id")
_TEST_CRASH_BEFORE_PUBLISH = "MEGATRON_CSBP_TEST_CRASH_BEFORE_PUBLISH"  # iteration: fail after writing, pre-rename


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: one line naming the directory and what to do."""


@dataclass
class LoopState:
    """Where the training loop is; saved with every checkpoint."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    """The iteration `latest_checkpointed_iteration.txt` names, or None when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load {root}: {path} holds {text!r}, not an iteration number; fix or delete it")
    return int(text)


def _plain_args(args: argparse.Namespace) -> dict:
    """The arguments as plain values (the common state is read back with `torch.load(weights_only=True)`)."""
    plain = {}
    for key, value in vars(args).items():
        if isinstance(value, (bool, int, float, str, type(None))):
            plain[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
            plain[key] = list(value)
    return plain


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_csbp.device import default_device

    device = default_device()
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state(),
            "accelerator": None if device.type == "cpu" else torch.get_device_module(device).get_rng_state(),
            "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_csbp.device import default_device

    random.setstate(state["python"])
    numpy_state = state["numpy"]
    numpy_state["state"]["key"] = np.array(numpy_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    device = default_device()
    if state["accelerator"] is not None and device.type != "cpu":
        torch.get_device_module(device).set_rng_state(state["accelerator"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(data):
    """RNG states differ per pipeline stage and TP rank, and are replicated over DP x block-parallel ranks."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing import ShardedObject

    return ShardedObject("rng_state", data,
                         (mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()),
                         (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()),
                         replica_id=mpu.get_data_parallel_rank(with_context_parallel=True))


def _sharded_state_dict(model, optimizer, *, is_loading: bool, with_optimizer: bool, rng) -> dict:
    model_state = model.sharded_state_dict()
    state = {"model": model_state}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                          metadata={"chained_optim_avoid_prefix": True})
    if rng is not None:
        state["rng_state"] = _rng_sharded_object(rng)
    return state


def _parallel_sizes() -> dict:
    from megatron.core import parallel_state as mpu
    return {"tensor_model_parallel_size": mpu.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": mpu.get_pipeline_model_parallel_world_size()}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(directory: str) -> None:
    sizes = {}
    for folder, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(folder, name)
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    temporary = os.path.join(directory, MANIFEST + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump({"files": sizes}, handle, indent=0, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(directory, MANIFEST))


def _write_tracker(root: str, iteration: int) -> None:
    temporary = os.path.join(root, TRACKER + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(str(iteration))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(root, TRACKER))
    _fsync_dir(root)


def save_checkpoint(root: str, state: LoopState, model, optimizer, scheduler, args) -> str:
    """Writes `<root>/iter_XXXXXXX/` (collective: every rank calls it); returns its path.

    `optimizer` and `scheduler` None: a model-only checkpoint (a converted model), loaded with --finetune."""
    from megatron.core import dist_checkpointing

    final = checkpoint_dir(root, state.iteration)
    temporary = final + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(temporary, ignore_errors=True)  # what an interrupted save left
        os.makedirs(temporary)
    dist.barrier()
    sharded = _sharded_state_dict(model, optimizer, is_loading=False, with_optimizer=optimizer is not None,
                                  rng=_rng_state())
    sharded.update(loop=asdict(state), scheduler=None if scheduler is None else scheduler.state_dict(),
                   args=_plain_args(args),
                   parallel_sizes=_parallel_sizes())
    dist_checkpointing.save(sharded, temporary)
    dist.barrier()
    if rank == 0:
        _write_manifest(temporary)
        if os.environ.get(_TEST_CRASH_BEFORE_PUBLISH) == str(state.iteration):
            raise RuntimeError(f"injected crash before publishing {final} ({_TEST_CRASH_BEFORE_PUBLISH})")
        replaced = final + ".old"
        if os.path.exists(final):  # an older save of this iteration (e.g. --finetune into the same --save)
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(final, replaced)
        os.rename(temporary, final)
        _fsync_dir(root)
        _write_tracker(root, state.iteration)
        shutil.rmtree(replaced, ignore_errors=True)
    dist.barrier()
    return final


def check_complete(directory: str) -> None:
    """Refuses a directory that is not a complete checkpoint (missing, unfinished or truncated files)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint {directory} does not exist")
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"checkpoint {directory} is incomplete (no {MANIFEST}: its save did not finish)")
    try:
        sizes = json.load(open(manifest_path, encoding="utf-8"))["files"]
    except (ValueError, KeyError) as error:
        raise CheckpointError(f"checkpoint {directory} is corrupt: unreadable {MANIFEST} ({error})") from None
    for name, size in sorted(sizes.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {directory} is corrupt: {name} is missing")
        if os.path.getsize(path) != size:
            raise CheckpointError(f"checkpoint {directory} is corrupt: {name} has {os.path.getsize(path)} bytes, "
                                  f"{size} were written (truncated?)")


def iteration_dirs(root: str) -> list[int]:
    """Iterations of the `iter_XXXXXXX` directories under `root`, newest first (complete or not)."""
    found = [int(m.group(1)) for name in os.listdir(root) if (m := _ITERATION_DIR.fullmatch(name))]
    return sorted(found, reverse=True)


def find_checkpoint(root: str, *, fallback: bool, log=print) -> int:
    """The iteration to load from `root`: the tracker's, checked complete; with `fallback`, the newest
    older complete one when it is not. Raises `CheckpointError` naming the directory otherwise."""
    latest = read_tracker(root)
    if latest is None:
        raise CheckpointError(f"--load {root}: no checkpoint there (no {TRACKER}); give the --save directory of "
                              f"an earlier run, or drop --load to start from scratch")
    try:
        check_complete(checkpoint_dir(root, latest))
        return latest
    except CheckpointError as error:
        if not fallback:
            raise CheckpointError(f"{error}; restore it, or pass --load-fallback-to-previous to load the newest "
                                  f"complete older checkpoint") from None
        log(f" WARNING: {error}; falling back to an older checkpoint")
    for iteration in iteration_dirs(root):
        if iteration < latest:
            try:
                check_complete(checkpoint_dir(root, iteration))
            except CheckpointError as error:
                log(f" WARNING: {error}; skipped")
                continue
            return iteration
    raise CheckpointError(f"--load {root}: the latest checkpoint (iteration {latest}) is unusable and no complete "
                          f"older one exists")


def check_compatible(saved_args: dict, args: argparse.Namespace, directory: str) -> None:
    """Refuses a checkpoint of another model shape, naming the first setting that differs."""
    for name in MODEL_SHAPE_ARGS:
        if name in saved_args and saved_args[name] != getattr(args, name, None):
            if name == "padded_vocab_size":
                raise CheckpointError(
                    f"checkpoint {directory} has a padded vocabulary of {saved_args[name]} ids, this run "
                    f"{args.padded_vocab_size} (the tokenizer's ids + MASK, padded to a multiple of "
                    f"--make-vocab-size-divisible-by x --tensor-model-parallel-size): set "
                    f"--make-vocab-size-divisible-by so both pad alike, or use the checkpoint's tokenizer")
            flag = "--bdlm-mask-token-id" if name == "mask_token_id" else "--" + name.replace("_", "-")
            raise CheckpointError(f"checkpoint {directory} was saved with {flag} {saved_args[name]}, this run has "
                                  f"{flag} {getattr(args, name, None)}: use the same {flag}, or another --load")


def load_checkpoint(directory: str, model, optimizer, scheduler, args, *, load_optimizer=True, load_rng=True,
                    log=print) -> LoopState:
    """Loads a complete checkpoint directory into the model (and optimizer, scheduler, RNG); returns the
    loop state to continue from. Collective."""
    from megatron.core import dist_checkpointing

    check_complete(directory)
    try:
        common = dist_checkpointing.load_common_state_dict(directory)
    except Exception as error:
        raise CheckpointError(f"checkpoint {directory} is corrupt: its common state cannot be read ({error})") from None
    check_compatible(common["args"], args, directory)
    if load_optimizer and common.get("scheduler") is None:
        raise CheckpointError(f"checkpoint {directory} holds a model only (no optimizer state, e.g. a converted "
                              f"model): load it with --finetune (or --no-load-optim)")
    load_rng = load_rng and common["parallel_sizes"] == _parallel_sizes()
    if not load_rng:
        log(f" not restoring RNG states from {directory} (saved with {common['parallel_sizes']}, running with "
            f"{_parallel_sizes()})")
    sharded = _sharded_state_dict(model, optimizer, is_loading=True, with_optimizer=load_optimizer,
                                  rng=_rng_state() if load_rng else None)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        loaded = dist_checkpointing.load(sharded, directory)
    except (Exception, CheckpointException) as error:
        message = " ".join(str(error).split())[:500]
        raise CheckpointError(f"checkpoint {directory} cannot be loaded ({type(error).__name__}: {message})") from None
    model.load_state_dict(loaded["model"])
    if load_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(common["scheduler"])
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    return LoopState(**common["loop"])
