"""Reading a checkpoint's pickles through allow-lists, so that loading one never runs code from it.

A torch_dist checkpoint holds three kinds of pickle, and torch reads two of them with plain `pickle`:
* `.metadata`, torch.distributed.checkpoint's `Metadata`, which `FileSystemReader.read_metadata` unpickles
  with `pickle.load`: a replaced file runs whatever it names. `read_metadata` unpickles it first through an
  `Unpickler` that resolves only `_metadata_globals()` (what torch's DCP and megatron-core's torch_dist
  strategy write, as recorded from real checkpoints of both training loops, plus enum members by name) and
  refuses any other name, in one line naming the file, before torch opens it. Every load path calls
  `check_metadata` first.
* the objects of `ShardedObject`s (e.g. RNG states) inside the `.distcp` shards, which torch's
  `DefaultLoadPlanner.load_bytes` reads with `torch.load(weights_only=False)`: `restricted()` makes them
  `weights_only` with `_common_state_globals()` while a load runs.
* `common.pt`, which megatron-core reads with `torch.load`'s `weights_only` unpickler already; what
  Megatron-LM's `args` hold beyond megatron-core's own safe globals (enums pickled by name through
  `getattr`, as e.g. Debian's Python 3.11.2 pickles every enum; 3.11.7 pickles them by value) is allowed by
  `restricted()` too, and nothing more.

A checksum manifest does not authenticate a checkpoint (whoever can replace a file can rebuild it), so these
allow-lists are what stand between a checkpoint and code execution.
"""

import contextlib
import os
import pathlib
import pickle

import torch

from megatron_csbp.core.rules import ConfigError

METADATA = ".metadata"


class UnsafeCheckpoint(ConfigError):
    """A checkpoint file that names something other than checkpoint data: refused, never unpickled."""


def _enums() -> tuple:
    """The enums a checkpoint may name (by value or, through `getattr`, by name): torch DCP's in `.metadata`;
    in Megatron-LM's common state, those of its `args` (attention backend, CUDA graph scope, model type, exit
    signal) and of its rerun state machine's state (megatron-core's own safe globals)."""
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState
    from megatron.core.transformer.enums import AttnBackend, CudaGraphScope
    from megatron.core.transformer.enums import ModelType as TransformerModelType
    from signal import Signals
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType

    return (_MEM_FORMAT_ENCODING, WriteItemType, LoadItemType, ModelType, TransformerModelType, AttnBackend,
            CudaGraphScope, Signals, RerunDiagnostic, RerunMode, RerunState)


def enum_member(cls, name):
    """What a pickle's `getattr(cls, name)` may mean here: a member of one of `_enums()`, nothing else."""
    if cls in _enums() and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__qualname__', cls)!r}, {name!r}) is not an enum member "
                                 f"a checkpoint may name")


def _metadata_globals() -> dict:
    """{(module, name): object} a `.metadata` may name."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint import filesystem, metadata, planner

    allowed = {(m.__name__, name): getattr(m, name) for m, names in (
        (metadata, ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                    "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
        (filesystem, ("_StorageInfo",)),
        (planner, ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")),
        # megatron-core keeps these (empty) classes so that the .metadata of older checkpoints still reads
        (mcore_torch, ("MCoreMetadata", "MCoreSavePlan")),
    ) for name in names}
    allowed.update({("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
                    ("pathlib", "PosixPath"): pathlib.PosixPath, ("builtins", "getattr"): enum_member})
    allowed.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    allowed: dict = {}

    def find_class(self, module, name):
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpoint(f"{module}.{name}") from None

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a persistent id, which checkpoint metadata never holds")


def read_metadata(directory: str):
    """The checkpoint's `.metadata` as torch's `Metadata`, unpickled through `_metadata_globals()` only.
    Raises `UnsafeCheckpoint` (a pickle naming anything else) or `ConfigError` (unreadable), one line each."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(directory, METADATA)
    _MetadataUnpickler.allowed = _MetadataUnpickler.allowed or _metadata_globals()
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except UnsafeCheckpoint as named:
        raise UnsafeCheckpoint(f"checkpoint {directory}: {path} is refused: it names {named}, which is not "
                               f"checkpoint metadata (loading it could run code); nothing was loaded: replace the "
                               f"checkpoint with a copy you trust") from None
    except Exception as error:  # noqa: BLE001 - any unpickling failure of a damaged file
        raise ConfigError(f"checkpoint {directory} is corrupt: {METADATA} cannot be read ({type(error).__name__}: "
                          f"{' '.join(str(error).split())[:200]})") from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(f"checkpoint {directory} is corrupt: {path} holds a {type(metadata).__name__}, not "
                          f"torch.distributed.checkpoint metadata")
    return metadata


def check_metadata(directory: str) -> None:
    """Refuses a checkpoint whose `.metadata` is not plain checkpoint metadata (see `read_metadata`)."""
    read_metadata(directory)


def _common_state_globals() -> list:
    """What torch's `weights_only` needs for our and Megatron-LM's common state and sharded objects, beyond
    megatron-core's registered safe globals: enums by name (`builtins.getattr` as `enum_member`)."""
    return [(enum_member, "builtins.getattr"), *_enums()]


def _load_bytes_weights_only(self, read_item, value) -> None:
    """torch's `DefaultLoadPlanner.load_bytes` (which unpickles with `weights_only=False`), weights_only."""
    from torch.distributed.checkpoint._traverse import set_element

    loaded = torch.load(value, weights_only=True)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
    else:
        self.state_dict[read_item.dest_index.fqn] = loaded


@contextlib.contextmanager
def restricted():
    """While a checkpoint loads: `torch.load` allows what checkpoints hold (`_common_state_globals`), and the
    objects inside `.distcp` shards are read `weights_only` too."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    original = DefaultLoadPlanner.load_bytes
    DefaultLoadPlanner.load_bytes = _load_bytes_weights_only
    try:
        with torch.serialization.safe_globals(_common_state_globals()):
            yield
    finally:
        DefaultLoadPlanner.load_bytes = original


def reason(error: BaseException) -> str:
    """torch's `weights_only` refusal in one line (what it saw, without its page of advice), else the error."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        seen = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n")[0].split(" Please use")[0]
        return " ".join(seen.split())
    return f"{type(error).__name__}: {' '.join(text.split())[:300]}"
