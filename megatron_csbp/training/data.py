"""Datasets: tokenizers, Megatron indexed datasets (.bin/.idx) and GPTDataset splits for BDLM training.

BDLM trains on the clean sequence `x0` of `L` tokens: GPTDataset is built with
`add_extra_token_to_sequence=False` (labels are `x0` itself, unshifted) and `create_attention_mask=False`
(the BDLM mask is the attention op's business); a sample's `tokens` are `x0`.

Vocabulary: the tokenizer's ids (bytes 0..255 and EOD = 256 for the byte tokenizer), then the MASK id
right after them (or the id `--bdlm-mask-token-id` names), then Megatron-style padding to a multiple of
`--make-vocab-size-divisible-by` x TP. The padding is a detail of the layout: the model never predicts a
padded id, and a checkpoint's real rows load into any TP's padding, so only the real ids (`num_ids`) are
part of a model's identity.
"""

import argparse
import hashlib
import json
import math
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import numpy as np

from megatron_csbp.core import rules
from megatron_csbp.core.rules import ConfigError
from megatron_csbp.training.arguments import MEGATRON_SPLIT_DEFAULT, check_data_prefixes, parse_data_path

_HF_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


class ByteTokenizer:
    """UTF-8 bytes as ids `0..vocab_size-2`, EOD last: real text, no download, no model file."""

    def __init__(self, base_vocab_size: int = 256):
        if base_vocab_size < 256:
            raise ConfigError(f"--vocab-size {base_vocab_size}: the byte tokenizer needs at least 256 ids")
        self.eod = base_vocab_size
        self.vocab_size = base_vocab_size + 1
        self.unique_identifiers = OrderedDict(class_name=type(self).__name__, vocab_size=self.vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class NullTokenizer(ByteTokenizer):
    """Megatron-LM's NullTokenizer: the data's ids are the tokens (`0..vocab_size-1`), EOD is `--vocab-size`;
    text is space-separated ids. With `--vocab-size 256` it numbers exactly like `ByteTokenizer`."""

    def __init__(self, base_vocab_size: int):
        self.eod = base_vocab_size
        self.vocab_size = base_vocab_size + 1
        self.unique_identifiers = OrderedDict(class_name=type(self).__name__, vocab_size=self.vocab_size)

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(token) for token in text.split()]
        except ValueError:
            raise ConfigError(f"NullTokenizer takes space-separated token ids as text, got {text[:40]!r}") from None

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def tokenizer_file(path: str) -> str:
    """`--tokenizer-model`: a tokenizer.json, or a Hugging Face directory holding one (what Megatron-LM's
    HuggingFaceTokenizer takes), so one config serves both loops."""
    found = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(found):
        raise ConfigError(f"--tokenizer-model {path}: no such file (a local tokenizer.json, or a directory "
                          f"holding one, is needed)")
    return found


class HuggingFaceTokenizer:
    """A local `tokenizer.json` through the `tokenizers` package (optional); EOD is its end-of-text token."""

    def __init__(self, path: str, base_vocab_size: int | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs the 'tokenizers' package: "
                              "pip install tokenizers (or use the default ByteLevelTokenizer)") from None
        path = tokenizer_file(path)
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as error:
            raise ConfigError(f"--tokenizer-model {path}: not a tokenizer.json ({error})") from None
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        found = [self._tokenizer.token_to_id(token) for token in _HF_EOD_CANDIDATES]
        self.eod = next((i for i in found if i is not None), size)
        self.vocab_size = max(size, self.eod + 1)
        if base_vocab_size is not None:
            if base_vocab_size < self.vocab_size - (self.eod == size):
                raise ConfigError(f"--vocab-size {base_vocab_size} is smaller than {path}'s vocabulary ({size})")
            self.vocab_size = max(self.vocab_size, base_vocab_size + 1)
        self.unique_identifiers = OrderedDict(class_name=type(self).__name__, path=os.path.abspath(path),
                                              vocab_size=self.vocab_size, eod=self.eod)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode(list(ids))


def build_tokenizer(args: argparse.Namespace):
    """The tokenizer of `--tokenizer-type` (with the MASK id and padded vocabulary: `Vocabulary.from_args`)."""
    if args.tokenizer_type == "HuggingFaceTokenizer":
        if args.tokenizer_model is None:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model path/to/tokenizer.json")
        tokenizer = HuggingFaceTokenizer(args.tokenizer_model, args.vocab_size)
    elif args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size (the ids before EOD)")
        tokenizer = NullTokenizer(args.vocab_size)
    else:
        tokenizer = ByteTokenizer(256 if args.vocab_size is None else args.vocab_size)
    return tokenizer


def vocabulary(args: argparse.Namespace, tokenizer) -> tuple[int, int]:
    """(MASK id, padded vocabulary size) of the run: MASK is `--bdlm-mask-token-id` (an unused id of the
    tokenizer, or a new one further on, as `scripts/convert_hf.py import` records it) or, by default, a new id
    right after the tokenizer's; the vocabulary is padded (Megatron's rule) to hold both."""
    mask = getattr(args, "bdlm_mask_token_id", None)
    if mask is not None and mask < 0:
        raise ConfigError(f"--bdlm-mask-token-id {mask} must be a non-negative id")
    mask = tokenizer.vocab_size if mask is None else mask
    return mask, rules.padded_vocab_size(max(tokenizer.vocab_size, mask + 1), args.make_vocab_size_divisible_by,
                                         args.tensor_model_parallel_size)


@dataclass(frozen=True)
class Vocabulary:
    """A run's tokenizer, its MASK id and the model's padded vocabulary size, worked out once per run."""

    tokenizer: Any
    mask_token_id: int
    padded_vocab_size: int

    @classmethod
    def from_args(cls, args: argparse.Namespace, tokenizer=None) -> "Vocabulary":
        """From the flags (`vocabulary`), with `tokenizer` (Megatron-LM's, under `pretrain()`) or the plugin's."""
        tokenizer = build_tokenizer(args) if tokenizer is None else tokenizer
        return cls(tokenizer, *vocabulary(args, tokenizer))

    @property
    def num_ids(self) -> int:
        """The ids the model reads and predicts: the tokenizer's and MASK (the padding rows after them are neither)."""
        return max(self.tokenizer.vocab_size, self.mask_token_id + 1)

    def recorded(self, args: argparse.Namespace) -> argparse.Namespace:
        """A copy of `args` with `mask_token_id`, `vocab_ids` (`num_ids`) and `padded_vocab_size` added: the
        arguments a checkpoint records and checks (a checkpoint's vocabulary must be the model's) and the FLOPs
        count reads. `args` is untouched."""
        return argparse.Namespace(**{**vars(args), **self.arguments()})

    def arguments(self) -> dict:
        """What a run's arguments record of the vocabulary (our checkpoints' args, Megatron-LM's global args)."""
        return {"mask_token_id": self.mask_token_id, "vocab_ids": self.num_ids,
                "padded_vocab_size": self.padded_vocab_size}


@dataclass(frozen=True)
class DatasetStats:
    """What an indexed dataset holds, read back from its files."""

    num_documents: int
    num_tokens: int
    max_token_id: int


def _open_indexed(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    check_data_prefixes([prefix])
    try:
        return IndexedDataset(prefix, mmap=True)
    except Exception as error:
        raise ConfigError(f"--data-path {prefix}: {prefix}.idx/.bin are corrupt or do not match ({error}); "
                          f"rebuild with scripts/prepare_data.py --force") from None


def _files_identity(prefix: str) -> list:
    return [[os.stat(prefix + suffix).st_size, os.stat(prefix + suffix).st_mtime_ns] for suffix in (".bin", ".idx")]


def _read_record(prefix: str) -> DatasetStats | None:
    """The stats `write_indexed_dataset` recorded, if the files are still exactly the ones it wrote."""
    try:
        with open(prefix + ".stats.json", encoding="utf-8") as handle:
            record = json.load(handle)
        if record.pop("files") == _files_identity(prefix):
            return DatasetStats(**record)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return None


def _write_record(prefix: str, stats: DatasetStats) -> None:
    temporary = f"{prefix}.stats.json.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump({**asdict(stats), "files": _files_identity(prefix)}, handle)
    os.replace(temporary, prefix + ".stats.json")


def dataset_stats(prefix: str, chunk_tokens: int = 1 << 24) -> DatasetStats:
    """Documents, tokens and the largest token id of `prefix`.bin/.idx.

    Taken from the `.stats.json` record `write_indexed_dataset` leaves when the files are unchanged since
    (same sizes and modification times), else read from the files (the whole .bin, in chunks).
    """
    check_data_prefixes([prefix])
    recorded = _read_record(prefix)
    if recorded is not None:
        return recorded
    dataset = _open_indexed(prefix)
    num_tokens = int(dataset.sequence_lengths.sum(dtype=np.int64))
    expected_bytes = num_tokens * np.dtype(dataset.index.dtype).itemsize
    actual_bytes = os.path.getsize(prefix + ".bin")
    if actual_bytes != expected_bytes:
        raise ConfigError(f"--data-path {prefix}: {prefix}.bin has {actual_bytes} bytes, its .idx describes "
                          f"{expected_bytes}; rebuild with scripts/prepare_data.py --force")
    max_id = -1
    if num_tokens:
        tokens = np.memmap(prefix + ".bin", dtype=dataset.index.dtype, mode="r")
        for start in range(0, num_tokens, chunk_tokens):
            max_id = max(max_id, int(tokens[start:start + chunk_tokens].max()))
        del tokens
    return DatasetStats(len(dataset.document_indices) - 1, num_tokens, max_id)


def check_vocabulary(prefixes: list[str], mask_token_id: int, padded_vocab_size: int,
                     tokenizer_ids: int | None = None) -> int:
    """Refuse datasets with ids the model cannot take (beyond its vocabulary or the tokenizer's
    `tokenizer_ids` ids (default: those before MASK), or the MASK id); returns the max id."""
    tokenizer_ids = mask_token_id if tokenizer_ids is None else tokenizer_ids
    largest = -1
    for prefix in prefixes:
        max_id = dataset_stats(prefix).max_token_id
        fix = ("rebuild it with the model's tokenizer, or give the --tokenizer-type/--tokenizer-model/--vocab-size "
               "that built it")
        if max_id >= padded_vocab_size:
            raise ConfigError(f"--data-path {prefix}: token id {max_id} exceeds the model's vocabulary "
                              f"({padded_vocab_size} padded ids); {fix}")
        if max_id == mask_token_id:
            raise ConfigError(f"--data-path {prefix}: token id {max_id} collides with the MASK id {mask_token_id}; "
                              f"{fix}")
        if max_id >= tokenizer_ids:
            raise ConfigError(f"--data-path {prefix}: token id {max_id} lies beyond the tokenizer's ids and the MASK "
                              f"id {mask_token_id} (padding); {fix}")
        largest = max(largest, max_id)
    return largest


def _remove(*paths: str) -> None:
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


def check_output_prefix(prefix: str) -> None:
    """Refuses, before any work, an output prefix whose directory cannot exist: a file stands on its path."""
    directory = os.path.dirname(os.path.abspath(prefix))
    probe = directory
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"--output-prefix {prefix}: {probe} is a file, so {directory} cannot be a directory; give "
                          f"a prefix under a directory")


def write_indexed_dataset(documents: Iterable[list[int]], output_prefix: str, vocab_size: int) -> DatasetStats:
    """Write `documents` (token id lists) as `output_prefix`.bin/.idx, verified, then renamed into place.

    Written under a temporary name and read back (documents, tokens, ids < `vocab_size`) before the rename, so
    a crash never leaves a half dataset under the real name. The old .idx goes first: an interruption between
    the two renames leaves a .bin without .idx, which `check_data_prefixes` reports. A `.stats.json` record
    beside it spares training start-up a full read of the .bin (see `dataset_stats`).
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    check_output_prefix(output_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    temporary = f"{output_prefix}.tmp{os.getpid()}"
    num_documents = num_tokens = 0
    try:
        builder = IndexedDatasetBuilder(temporary + ".bin", dtype=DType.optimal_dtype(vocab_size))
        for ids in documents:
            if len(ids) == 0:
                continue
            builder.add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
            num_documents += 1
            num_tokens += len(ids)
        builder.finalize(temporary + ".idx")
        stats = dataset_stats(temporary)
        if (stats.num_documents, stats.num_tokens) != (num_documents, num_tokens) or stats.max_token_id >= vocab_size:
            raise RuntimeError(f"{output_prefix}: read back {stats}, wrote {num_documents} documents and {num_tokens} "
                               f"tokens with ids < {vocab_size}; nothing was replaced")
        _remove(output_prefix + ".idx", output_prefix + ".stats.json")
        os.replace(temporary + ".bin", output_prefix + ".bin")
        os.replace(temporary + ".idx", output_prefix + ".idx")
        _write_record(output_prefix, stats)
        return stats
    finally:
        _remove(temporary + ".bin", temporary + ".idx")


def _data_fingerprint(prefixes: list[str]) -> str:
    """Changes whenever a dataset is rebuilt, so cached sample indices of an older build are never reused."""
    digest = hashlib.md5(usedforsecurity=False)
    for prefix in prefixes:
        for path in (prefix + ".bin", prefix + ".idx"):
            info = os.stat(path)
            digest.update(f"{os.path.abspath(path)}:{info.st_size}:{info.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]


def split_sizes(args: argparse.Namespace) -> list[int]:
    """Samples each split must provide, as Megatron-LM counts them (train, valid every eval interval, test)."""
    evaluations = args.train_iters // args.eval_interval + 1
    return [args.train_iters * args.global_batch_size, evaluations * args.eval_iters * args.global_batch_size,
            args.eval_iters * args.global_batch_size]


def check_split(prefixes: list[str], split: str) -> None:
    """Every split with a share needs documents in every dataset (megatron-core loops forever on none)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                         parse_and_normalize_split)

    try:
        with np.errstate(invalid="ignore", divide="ignore"):
            vector = parse_and_normalize_split(split)
        if not all(np.isfinite(vector)):
            raise ValueError(split)
        matrix = convert_split_vector_to_split_matrix(vector)
    except (AssertionError, ValueError, ZeroDivisionError):
        raise ConfigError(f"--split '{split}': give up to three non-negative train,valid,test proportions, "
                          f"not all zero (e.g. 98,2,0)") from None
    for prefix in prefixes:
        count = _open_indexed(prefix).sequence_lengths.shape[0]
        for name, bounds in zip(("train", "valid", "test"), matrix):
            if bounds is not None and round(bounds[1] * count) == round(bounds[0] * count):
                raise ConfigError(f"--split '{split}' leaves the {name} split 0 of the {count} documents of "
                                  f"--data-path {prefix}; give it at least {math.ceil(100 / count)}% of the "
                                  f"documents, a zero share, or use more data")


class _Unpadded:
    """The tokenizer as GPTDataset sees it: BDLM samples are never padded, and GPTDataset rewrites every token
    equal to `tokenizer.pad` to 0 (a tokenizer whose pad is its EOS would lose every EOD) and fails on a
    `pad` of None (Megatron-LM's HuggingFaceTokenizer without a pad token). So the pad is megatron-core's own
    "none" value, -1, which no token id equals."""

    pad = -1

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        if name == "_tokenizer":  # during unpickling (DataLoader workers), before __init__'s state is back
            raise AttributeError(name)
        return getattr(self._tokenizer, name)


def build_datasets(args: argparse.Namespace, vocabulary: Vocabulary | None = None,
                   is_built_on_rank: Callable[[], bool] | None = None, sizes: list[int] | None = None):
    """(train, valid, test) GPTDatasets of `L`-token samples (`None` for an empty split) from `--data-path`.

    Checks paths and vocabulary first. Collective when torch.distributed is initialised (megatron-core builds
    the index cache on rank 0 behind a barrier of the default group): call it on every rank. By default every
    rank builds (reads) the data, since every block-parallel rank needs the same samples. Indices are cached
    under `--data-cache-path` (default: `cache/` beside the first dataset), keyed by the data files' identity.
    """
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    vocabulary = vocabulary or Vocabulary.from_args(args)
    prefixes, weights = parse_data_path(args.data_path)
    if not prefixes:
        raise ConfigError("--data-path is required (scripts/prepare_data.py builds the default dataset)")
    check_data_prefixes(prefixes)
    check_vocabulary(prefixes, vocabulary.mask_token_id, vocabulary.padded_vocab_size,
                     vocabulary.tokenizer.vocab_size)
    split, sizes = args.split or MEGATRON_SPLIT_DEFAULT, sizes or split_sizes(args)
    check_split(prefixes, split)
    cache_root = args.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "cache")
    cache = os.path.join(cache_root, _data_fingerprint(prefixes))
    if len(prefixes) > 1 and not torch.distributed.is_initialized():
        cache = None  # megatron-core's BlendedDataset asks torch.distributed for the rank on a cache miss
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=(prefixes, weights),
        split=split, path_to_cache=cache,
        tokenizer=_Unpadded(vocabulary.tokenizer), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False, add_extra_token_to_sequence=False, mmap_bin_files=True,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, is_built_on_rank or (lambda: True), config)
    return tuple(builder.build())
