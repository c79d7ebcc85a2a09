"""`torch_dist` checkpoints that are never half-written and never silently wrong.

Layout (Megatron-LM's): `<save>/iter_0000100/` holds a `megatron.core.dist_checkpointing` checkpoint of the
model and optimizer (sharded, so it reloads into another TP or block-parallel size), the LR scheduler, the
loop's position (iteration, consumed samples: the data iterator skips them on resume), the arguments, and
every rank's RNG states. `<save>/latest_checkpointed_iteration.txt` names the newest complete one.

Why it cannot be lost: a checkpoint is written under `iter_XXXXXXX.tmp`, a manifest of its files is added
last, the directory is renamed to its real name, and only then is the tracker file replaced (temp file +
`os.replace`). A crash at any point leaves the previous checkpoint and tracker as they were.

Why it cannot be silently wrong: the manifest records every file's size and SHA-256, and its own SHA-256
(any changed byte of the manifest is caught too). The digests are computed right after
`dist_checkpointing.save` returns and before publishing, each rank hashing its share of the files while
they are still in the page cache: megatron-core's writers (`FileSystemWriterAsync`, in a helper process)
offer no hook where the bytes are written, and hashing there would mean patching them. The cost is one
read of the checkpoint from memory at ~0.9 GB/s per rank, divided over the ranks, and the same on load
(see `check_complete`); the save's log line reports it. On load, every file is checked against the
manifest and `.metadata` and the common state are read before any tensor is, so a damaged, truncated or
missing file is one line naming it; with `fallback=True` the newest older checkpoint that verifies is
used instead.

Why Megatron-LM reads it, and we read Megatron-LM's: the common state has Megatron-LM's keys and meanings
(`args` as a Namespace with the consumed samples, `iteration`, `checkpoint_version`, `opt_param_scheduler`,
and `rng_state` as Megatron-LM's per-(PP, TP) list of RNG dicts), so a checkpoint saved by either loop
resumes in the other at the same iteration, data position and schedule. Our own extras (`loop`: the skip
counters; `parallel_sizes`) ride along. Megatron-LM's save gets the same manifest (`record_manifest`, from
`megatron_lm`'s hook); one without it (saved by Megatron-LM alone) is verified by what dist_checkpointing
itself records (`.metadata` and the common state must read), and said so.

Why loading runs no code from the checkpoint: `.metadata` and the common state are read through
`safe_load`'s allow-lists, and `dist_checkpointing.load` runs under `safe_load.restricted()`.
"""

import argparse
import errno
import hashlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_csbp.core import supervision
from megatron_csbp.core.rules import ConfigError
from megatron_csbp.training import publish, safe_load

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "csbp_manifest.json"
_ITERATION_DIR = re.compile(r"iter_(\d{7})")
# Settings that fix a parameter's shape: a checkpoint only loads into a model that agrees on all of them.
# The MASK id too: training, sampling and export must agree on it with the checkpoint. The vocabulary is its
# real ids (`vocab_ids`), not the padded rows: megatron-core loads the real rows into any TP's padding (the
# embedding and output weights allow a shape mismatch, the rows past a checkpoint's start at zero), and the
# model never predicts a padding row. A checkpoint recording no `vocab_ids` is compared by its padded rows.
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "kv_channels", "vocab_ids", "swiglu", "normalization", "add_bias_linear",
                    "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights", "mask_token_id")
_ACCELERATOR_RNG_KEY = "cuda_rng_state"  # Megatron-LM's name for the accelerator's RNG state (the CPU's here)


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


def _saved_arguments(args: argparse.Namespace, state: LoopState) -> argparse.Namespace:
    """Megatron-LM's `args` entry: the arguments, with the data position Megatron-LM resumes from."""
    return argparse.Namespace(**{**_plain_args(args), "consumed_train_samples": state.consumed_train_samples,
                                 "consumed_valid_samples": state.consumed_valid_samples,
                                 "skipped_train_samples": 0})


def saved_args(common: dict) -> dict:
    """A checkpoint's recorded arguments as a dict (a Namespace in ours and Megatron-LM's; a dict in v0.1's)."""
    recorded = common.get("args")
    return vars(recorded) if isinstance(recorded, argparse.Namespace) else dict(recorded or {})


def _loop_state(common: dict) -> LoopState:
    """Where to resume: our `loop` entry, or Megatron-LM's iteration and consumed samples."""
    if "loop" in common:
        return LoopState(**common["loop"])
    recorded = saved_args(common)
    return LoopState(iteration=common["iteration"], consumed_train_samples=recorded.get("consumed_train_samples", 0),
                     consumed_valid_samples=recorded.get("consumed_valid_samples", 0))


def _saved_parallel_sizes(common: dict) -> dict:
    recorded = saved_args(common)
    sizes = dict(common.get("parallel_sizes") or {name: recorded.get(name, 1) for name in
                                                  ("tensor_model_parallel_size", "pipeline_model_parallel_size")})
    sizes.setdefault("expert_model_parallel_size", recorded.get("expert_model_parallel_size", 1))  # dense: 1
    return sizes


def _rng_state() -> list:
    """This rank's RNG states in Megatron-LM's layout (`cuda_rng_state`: the accelerator's, or the CPU's)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_csbp.core.device import default_device

    device = default_device()
    accelerator = torch.get_rng_state() if device.type == "cpu" else torch.get_device_module(device).get_rng_state()
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), _ACCELERATOR_RNG_KEY: accelerator,
             "rng_tracker_states": get_cuda_rng_tracker().get_states()}]


def _set_rng_state(states: list) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_csbp.core.device import default_device

    if isinstance(states, dict):  # v0.1's own layout
        states = [{"random_rng_state": states["python"], "torch_rng_state": states["torch"],
                   "np_rng_state": ("MT19937", np.array(states["numpy"]["state"]["key"], dtype=np.uint32),
                                    states["numpy"]["state"]["pos"], states["numpy"]["has_gauss"],
                                    states["numpy"]["gauss"]),
                   _ACCELERATOR_RNG_KEY: states["accelerator"], "rng_tracker_states": states["tracker"]}]
    state = states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    device = default_device()
    if device.type != "cpu":
        torch.get_device_module(device).set_rng_state(state[_ACCELERATOR_RNG_KEY])
    if state["rng_tracker_states"]:
        get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


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
        # The distributed optimizer's state as Megatron-LM saves it by default (dp_reshardable): megatron-core's own
        # default layout is refused by its checkpointing (`ShardedTensor.flattened_range is not supported`).
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                          metadata={"chained_optim_avoid_prefix": True,
                                                                    "distrib_optim_sharding_type": "dp_reshardable"})
    if rng is not None:
        state["rng_state"] = _rng_sharded_object(rng)
    return state


def _parallel_sizes() -> dict:
    from megatron.core import parallel_state as mpu
    return {"tensor_model_parallel_size": mpu.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": mpu.get_pipeline_model_parallel_world_size(),
            "expert_model_parallel_size": mpu.get_expert_model_parallel_world_size()}


CHECKSUM = "sha256"
_MANIFEST_FORMAT = 2  # 1 (sizes only) is still read, with a warning


def _canonical(data: dict) -> bytes:
    return json.dumps(data, indent=0, sort_keys=True).encode()


def _digest(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, CHECKSUM).hexdigest()


def _checkpoint_files(directory: str) -> list[str]:
    """Every file of a checkpoint directory but the manifest, as sorted relative paths."""
    names = []
    for folder, _, files in os.walk(directory):
        names += [os.path.relpath(os.path.join(folder, name), directory) for name in files]
    return sorted(name for name in names if name not in (MANIFEST, MANIFEST + ".tmp"))


def _world() -> tuple[int, int]:
    """(rank, world size) of the default group, or (0, 1) outside a distributed run."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value) -> list:
    rank, world = _world()
    if world == 1:
        return [value]
    gathered = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


def _hash_share(directory: str, names: list[str]) -> tuple[dict, int, float]:
    """This rank's share of `names` hashed: ({name: [bytes, digest]}, bytes read, seconds)."""
    rank, world = _world()
    started, digests, total = time.perf_counter(), {}, 0
    for name in names[rank::world]:
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        digests[name] = [size, _digest(path)]
        total += size
    return digests, total, time.perf_counter() - started


def _manifest_bytes(files: dict) -> bytes:
    body = {"format": _MANIFEST_FORMAT, "checksum": CHECKSUM,
            "files": {name: {"bytes": size, CHECKSUM: digest} for name, (size, digest) in files.items()}}
    body["manifest_" + CHECKSUM] = hashlib.new(CHECKSUM, _canonical(body)).hexdigest()
    return _canonical(body)


def _write_manifest(directory: str, files: dict) -> None:
    temporary = os.path.join(directory, MANIFEST + ".tmp")
    with open(temporary, "wb") as handle:
        handle.write(_manifest_bytes(files))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(directory, MANIFEST))


def read_manifest(directory: str, log=print) -> dict:
    """{file: (bytes, digest or None)} from a checkpoint's manifest, which must be exactly as written."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST}")
    raw = open(path, "rb").read()
    try:
        data = json.loads(raw)
        if isinstance(data.get("files"), dict) and all(isinstance(v, int) for v in data["files"].values()):
            log(f" WARNING: checkpoint {directory} has no checksums (saved by an older version): sizes checked only")
            return {name: (size, None) for name, size in data["files"].items()}
        claimed = data.pop("manifest_" + CHECKSUM)
        intact = claimed == hashlib.new(CHECKSUM, _canonical(data)).hexdigest()
        data["manifest_" + CHECKSUM] = claimed
        intact = intact and _canonical(data) == raw
        files = {name: (entry["bytes"], entry[CHECKSUM]) for name, entry in data["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        intact = False
    if not intact:
        raise CheckpointError(f"checkpoint {directory} is corrupt: {MANIFEST} is damaged (unreadable, or not "
                              f"what was written)")
    return files


def _write_tracker(root: str, iteration: int) -> None:
    temporary = os.path.join(root, TRACKER + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(str(iteration))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(root, TRACKER))
    publish.fsync_dir(root)


def _explain_save_error(error: BaseException, root: str, directory: str) -> BaseException:
    """A save that ran out of disk says so, naming the path (torch's own message can be `unexpected pos`)."""
    chain, cause = [], error
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    no_space = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain) or any(
        "no space left" in str(e).lower() for e in chain)
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    if not no_space and (free is None or free > 1 << 20):
        return error
    where = f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
    return CheckpointSaveError(f"no space left on device writing {directory} under --save {root}{where}; the "
                               f"previous checkpoint is intact: free space there or give another --save")


def record_manifest(directory: str, log=print) -> None:
    """Writes `directory`'s manifest: every file's size and SHA-256, each rank hashing its share. Collective;
    called once every rank's files are written (our save, and Megatron-LM's through `megatron_lm`'s hook)."""
    names = _checkpoint_files(directory)
    shares = _gather(_hash_share(directory, names))
    supervision.progress()
    files = {name: entry for digests, _, _ in shares for name, entry in digests.items()}
    total, seconds = sum(share[1] for share in shares), max(share[2] for share in shares)
    log(f" checksummed {len(files)} files ({total / 2**20:.1f} MiB) in {seconds:.3f} s ({CHECKSUM}, "
        f"{len(shares)} ranks sharing)")
    if _world()[0] == 0:
        _write_manifest(directory, files)


class CheckpointSaveError(RuntimeError):
    """A save that could not be written (e.g. a full disk); the previous checkpoint is untouched."""


def writer_helpers_die_with_us() -> None:
    """megatron-core's checkpoint writer keeps a `multiprocessing` manager for the life of the process that saves:
    a spawned server process, which holds that process's resource tracker open too. Started by megatron-core, both
    outlive a saving process killed outright (`kill -9`, the OOM killer) for good, orphaned; started here before
    the first save (the same manager and queue), the server asks to die with its parent. Call it before a save."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(supervision.die_with_parent)
        filesystem_async._results_queue = manager.Queue()  # its proxy keeps the manager


def save_checkpoint(root: str, state: LoopState, model, optimizer, scheduler, args, log=print) -> str:
    """Writes `<root>/iter_XXXXXXX/` (collective: every rank calls it); returns its path.

    `optimizer` and `scheduler` None: a model-only checkpoint (a converted model), loaded with --finetune."""
    from megatron.core import dist_checkpointing

    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    final = checkpoint_dir(root, state.iteration)
    temporary = final + ".tmp"
    rank = dist.get_rank()
    try:
        if rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)  # what an interrupted save left
            os.makedirs(temporary)
        dist.barrier()
        sharded = _sharded_state_dict(model, optimizer, is_loading=False, with_optimizer=optimizer is not None,
                                      rng=_rng_state())
        sharded.update(args=_saved_arguments(args, state), checkpoint_version=3.0, iteration=state.iteration,
                       opt_param_scheduler=None if scheduler is None else scheduler.state_dict(),
                       num_floating_point_operations_so_far=0, loop=asdict(state), parallel_sizes=_parallel_sizes())
        writer_helpers_die_with_us()
        dist_checkpointing.save(sharded, temporary)
        supervision.progress()  # each phase of a long save gets the whole timeout (as torch's barriers do)
        dist.barrier()
        record_manifest(temporary, log=log)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - re-raised as is unless out of space
        explained = _explain_save_error(error, root, temporary)
        if explained is error:
            raise
        raise explained from error
    if rank == 0:
        # An older save of this iteration (e.g. --finetune into the same --save) is replaced whole.
        publish.publish_directory(temporary, final, replace=True, flag="--save")
        _write_tracker(root, state.iteration)
    dist.barrier()
    return final


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def _check_files(directory: str, files: dict) -> str | None:
    """This rank's share of the checks: every size, and the digests of its share of the files."""
    for name, (size, _) in sorted(files.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"checkpoint {directory} is corrupt: {name} is missing"
        if os.path.getsize(path) != size:
            return (f"checkpoint {directory} is corrupt: {name} has {os.path.getsize(path)} bytes, {size} were "
                    f"written (truncated?)")
    rank, world = _world()
    for name in sorted(files)[rank::world]:
        expected = files[name][1]
        if expected is not None and _digest(os.path.join(directory, name)) != expected:
            return (f"checkpoint {directory} is corrupt: {name} does not match its {CHECKSUM} in {MANIFEST} "
                    f"(damaged on disk or in transfer)")
    return None


def common_state(directory: str) -> dict:
    """The checkpoint's common state (`common.pt`), read through `safe_load`'s allow-list: one line if refused
    or unreadable, saying what torch saw."""
    from megatron.core import dist_checkpointing

    try:
        with safe_load.restricted():
            return dist_checkpointing.load_common_state_dict(directory)
    except Exception as error:  # noqa: BLE001 - refused (weights_only), damaged or missing: said as seen
        raise CheckpointError(f"checkpoint {directory} is corrupt: its common state cannot be read "
                              f"({safe_load.reason(error)})") from None


def _check_readable(directory: str) -> str | None:
    """`.metadata` (through `safe_load`'s allow-list) and the common state parse (both small; read by every load)."""
    try:
        safe_load.check_metadata(directory)
        common = common_state(directory)
    except ConfigError as error:
        return str(error)
    missing = [key for key in ("args", "iteration") if key not in common]
    if missing:
        return f"checkpoint {directory} is corrupt: its common state lacks {', '.join(missing)}"
    return None


def _without_manifest(directory: str) -> str | None:
    """Why a directory without a manifest cannot be used, or None for one Megatron-LM's `pretrain()` saved
    without it (Megatron-LM's keys and not our `loop`; ours always has `loop`, and its manifest is written
    before it is published)."""
    try:
        common = common_state(directory)
    except CheckpointError as error:
        return f"{error}, and it has no {MANIFEST}"
    if "loop" in common:
        return (f"checkpoint {directory} is incomplete: no {MANIFEST}, which this plugin writes before publishing "
                f"a checkpoint (removed since, or a directory that was never published)")
    if "checkpoint_version" in common and "iteration" in common:
        return None
    return (f"checkpoint {directory} is incomplete: no {MANIFEST}, and its common state has neither our keys nor "
            f"Megatron-LM's (keys: {', '.join(sorted(map(str, common))[:10])})")


def check_complete(directory: str, log=print) -> None:
    """Refuses a directory that is not a complete, intact checkpoint: missing, unfinished, truncated or
    changed files (sizes and SHA-256 against the manifest), an unreadable `.metadata` or common state.
    Collective in a distributed run (every rank calls it; each hashes its share, all agree on the verdict)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint {directory} does not exist")
    error, files = None, {}
    if not os.path.isfile(os.path.join(directory, MANIFEST)):
        error = _without_manifest(directory)
        if error is None:
            log(f" WARNING: {directory} was written by Megatron-LM without {MANIFEST}: checked through "
                f"dist_checkpointing's .metadata and common state only, no checksums")
    else:
        try:
            files = read_manifest(directory, log=log)
        except CheckpointError as refused:
            error = str(refused)
    if error is None:
        error = _check_files(directory, files)
    supervision.progress()
    error = next((e for e in _gather(error) if e), None)
    if error is None:
        error = next((e for e in _gather(_check_readable(directory)) if e), None)
    if error is not None:
        raise CheckpointError(error)


def iteration_dirs(root: str) -> list[int]:
    """Iterations of the `iter_XXXXXXX` directories under `root`, newest first (complete or not)."""
    found = [int(m.group(1)) for name in os.listdir(root) if (m := _ITERATION_DIR.fullmatch(name))]
    return sorted(found, reverse=True)


def verify(directory: str, log=print) -> None:
    """`check_complete`, and the one line a user reads when it passes (what was checked, how long it took)."""
    started = time.perf_counter()
    check_complete(directory, log=log)
    log(f" verified {directory} (sizes, {CHECKSUM}, .metadata, common state) in {time.perf_counter() - started:.3f} s")


def find_checkpoint(root: str, *, fallback: bool, log=print) -> int:
    """The iteration to load from `root`: the tracker's, checked complete and intact (`check_complete`);
    with `fallback`, the newest older one that verifies when it is not. Raises `CheckpointError` naming the
    directory otherwise. Collective in a distributed run."""
    try:
        latest = read_tracker(root)
    except CheckpointError as error:
        if not fallback or not iteration_dirs(root):
            raise
        log(f" WARNING: {error}; falling back to the newest checkpoint that verifies")
        latest = iteration_dirs(root)[0] + 1
    if latest is None:
        raise CheckpointError(f"--load {root}: no checkpoint there (no {TRACKER}); give the --save directory of "
                              f"an earlier run, or drop --load to start from scratch")
    if latest in iteration_dirs(root) or not fallback:
        try:
            verify(checkpoint_dir(root, latest), log=log)
            return latest
        except CheckpointError as error:
            if not fallback:
                raise CheckpointError(f"{error}; restore it, or pass --load-fallback-to-previous to load the newest "
                                      f"complete older checkpoint") from None
            log(f" WARNING: {error}; falling back to an older checkpoint")
    for iteration in iteration_dirs(root):
        if iteration < latest:
            try:
                check_complete(checkpoint_dir(root, iteration), log=log)
            except CheckpointError as error:
                log(f" WARNING: {error}; skipped")
                continue
            return iteration
    raise CheckpointError(f"--load {root}: the latest checkpoint (iteration {latest}) is unusable and no complete "
                          f"older one exists")


def check_compatible(saved_args: dict, args: argparse.Namespace, directory: str) -> None:
    """Refuses a checkpoint of another model shape, naming the first setting that differs."""
    names = MODEL_SHAPE_ARGS if "vocab_ids" in saved_args else (*MODEL_SHAPE_ARGS, "padded_vocab_size")
    for name in names:
        if name in saved_args and saved_args[name] != getattr(args, name, None):
            if name in ("vocab_ids", "padded_vocab_size"):
                what = "ids (the tokenizer's and MASK)" if name == "vocab_ids" else "padded ids"
                raise CheckpointError(
                    f"checkpoint {directory} has a vocabulary of {saved_args[name]} {what}, this run "
                    f"{getattr(args, name, None)}: use the checkpoint's tokenizer (and --vocab-size)")
            flag = "--bdlm-mask-token-id" if name == "mask_token_id" else "--" + name.replace("_", "-")
            raise CheckpointError(f"checkpoint {directory} was saved with {flag} {saved_args[name]}, this run has "
                                  f"{flag} {getattr(args, name, None)}: use the same {flag}, or another --load")


def rope_flags(args) -> dict:
    """A model's RoPE as its training flags (YAML keys): base, percent, Llama 3's scaling, YaRN and the query
    scaling (`positions.RotaryPositions`), from parsed or recorded arguments."""
    from megatron_csbp.core.positions import RotaryPositions

    flags = {"rotary-base": args.rotary_base, "rotary-percent": args.rotary_percent,
             "use-rope-scaling": bool(args.use_rope_scaling), **RotaryPositions.from_args(args).flags()}
    if args.use_rope_scaling:
        flags["rope-scaling-factor"] = args.rope_scaling_factor
    return flags


def check_same_positions(saved_args: dict, args: argparse.Namespace, directory: str) -> None:
    """Refuses (one line naming the first flag that differs) a run that continues a checkpoint (not --finetune)
    under another RoPE than it was trained with: every weight was trained for its positions. A --finetune run
    may change them (e.g. to extend the context with YaRN): it starts a new training from the weights."""
    saved, ours = rope_flags(argparse.Namespace(**saved_args)), rope_flags(args)
    for key in (*saved, *(key for key in ours if key not in saved)):
        if saved.get(key) != ours.get(key):
            def said(flags):
                return f"--{key} {flags[key]}" if key in flags else f"no --{key}"
            raise CheckpointError(f"checkpoint {directory} was trained with {said(saved)}, this run has {said(ours)}: "
                                  f"a run that continues it keeps its positions; give its RoPE flags, or --finetune to "
                                  f"train it on under new ones (e.g. to extend its context with YaRN)")


def window_flags(args) -> dict:
    """A model's sliding-window layers as its flags (`core.windows`), from parsed or recorded arguments."""
    size, skip = getattr(args, "window_size", None), getattr(args, "window_attn_skip_freq", None)
    return {"window-size": None if size is None else ",".join(map(str, size)),
            "window-attn-skip-freq": list(skip) if isinstance(skip, (list, tuple)) else skip}


def check_same_windows(saved_args: dict, args: argparse.Namespace, directory: str) -> None:
    """Refuses (one line naming the first flag that differs) a run that continues a checkpoint (not --finetune)
    with other sliding-window layers than it was trained with: the weights were trained for what each layer sees."""
    saved, ours = window_flags(argparse.Namespace(**saved_args)), window_flags(args)
    for key in saved:
        if saved[key] != ours[key]:
            def said(flags):
                return f"no --{key}" if flags[key] is None else f"--{key} {flags[key]}"
            raise CheckpointError(f"checkpoint {directory} was trained with {said(saved)}, this run has {said(ours)}: "
                                  f"a run that continues it keeps its layers' windows; give its window flags, or "
                                  f"--finetune to train it on under new ones")


def load_checkpoint(directory: str, model, optimizer, scheduler, args, *, load_optimizer=True, load_rng=True,
                    verify=True, resuming=False, log=print) -> LoopState:
    """Loads a complete checkpoint directory into the model (and optimizer, scheduler, RNG); returns the
    loop state to continue from. Collective. `verify=False` for a directory `find_checkpoint` just checked;
    `resuming`: the run continues the checkpoint's training (not --finetune), so its RoPE must be the same."""
    from megatron.core import dist_checkpointing

    if verify:
        check_complete(directory, log=log)
    safe_load.check_metadata(directory)  # cheap, and torch unpickles it with plain pickle: never unchecked
    common = common_state(directory)
    check_compatible(saved_args(common), args, directory)
    if resuming:
        check_same_positions(saved_args(common), args, directory)
        check_same_windows(saved_args(common), args, directory)
    scheduler_state = common.get("opt_param_scheduler", common.get("scheduler"))
    if load_optimizer and scheduler_state is None:
        raise CheckpointError(f"checkpoint {directory} holds a model only (no optimizer state, e.g. a converted "
                              f"model): load it with --finetune (or --no-load-optim)")
    saved_sizes = _saved_parallel_sizes(common)
    if load_rng and saved_sizes != _parallel_sizes():
        log(f" not restoring RNG states from {directory} (saved with {saved_sizes}, running with "
            f"{_parallel_sizes()})")
    load_rng = load_rng and saved_sizes == _parallel_sizes()
    sharded = _sharded_state_dict(model, optimizer, is_loading=True, with_optimizer=load_optimizer,
                                  rng=_rng_state() if load_rng else None)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        with safe_load.restricted():
            loaded = dist_checkpointing.load(sharded, directory)
    except (Exception, CheckpointException) as error:
        message = " ".join(str(error).split())[:500]
        raise CheckpointError(f"checkpoint {directory} cannot be loaded ({type(error).__name__}: {message})") from None
    model.load_state_dict(loaded["model"])
    if load_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(scheduler_state)
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    return _loop_state(common)
