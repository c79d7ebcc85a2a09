"""Datasets: `--data-path` and its checks, Megatron indexed datasets (.bin/.idx) and GPTDataset splits for BDLM
training.

BDLM trains on the clean sequence `x0` of `L` tokens: GPTDataset is built with
`add_extra_token_to_sequence=False` (labels are `x0` itself, unshifted) and `create_attention_mask=False`
(the BDLM mask is the attention op's business); a sample's `tokens` are `x0`.
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import numpy as np

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.runtime.publish import fsync_path, out_of_space, private_directory
from megatron_csbp.data.tokenizers import Vocabulary

MEGATRON_SPLIT_DEFAULT = "969, 30, 1"


def parse_data_path(values: list[str] | None) -> tuple[list[str], list[float] | None]:
    """`--data-path p` or `--data-path w1 p1 w2 p2` -> (prefixes, weights or None), as Megatron's blend."""
    if not values:
        return [], None
    if len(values) == 1:
        return list(values), None
    try:
        weights = [float(w) for w in values[0::2]]
    except ValueError:
        raise ConfigError(f"--data-path: several datasets need weights, 'w1 prefix1 w2 prefix2 ...'; got {values}")
    if len(values) % 2:
        raise ConfigError(f"--data-path: {len(values)} values; weighted datasets come in pairs 'weight prefix'")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--data-path: weights must be finite, >= 0 and not all 0; got {weights}")
    return list(values[1::2]), weights


def check_data_prefixes(prefixes: list[str]) -> None:
    """Each `--data-path` prefix must have a readable `.bin` and `.idx`; the error says how to make one."""
    for prefix in prefixes:
        if prefix.endswith((".bin", ".idx")):
            raise ConfigError(f"--data-path {prefix}: give the prefix without the extension "
                              f"(--data-path {prefix[:-4]})")
        bin_path, idx_path = prefix + ".bin", prefix + ".idx"
        has_bin, has_idx = os.path.isfile(bin_path), os.path.isfile(idx_path)
        if not has_bin and not has_idx:
            raise ConfigError(f"--data-path {prefix}: no {bin_path} / {idx_path}; build the dataset with "
                              f"scripts/prepare_data.py (no arguments builds the default one)")
        if not has_idx:
            raise ConfigError(f"--data-path {prefix}: {bin_path} has no {idx_path} beside it (an interrupted "
                              f"build?); rebuild it with scripts/prepare_data.py --force")
        if not has_bin:
            raise ConfigError(f"--data-path {prefix}: {idx_path} has no {bin_path} beside it; rebuild it with "
                              f"scripts/prepare_data.py --force")
        for path in (bin_path, idx_path):
            if not os.access(path, os.R_OK):
                raise ConfigError(f"--data-path {prefix}: {path} is not readable; fix its permissions")


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


def _record(prefix: str) -> dict | None:
    """The record (`PREFIX.stats.json`) the writer left beside `prefix`, if the files are still exactly the ones it
    describes (same sizes and modification times, which a rename keeps), else None."""
    try:
        with open(prefix + ".stats.json", encoding="utf-8") as handle:
            record = json.load(handle)
        if isinstance(record, dict) and record.get("files") == _files_identity(prefix):
            return record
    except (OSError, ValueError):
        pass
    return None


def dataset_stats(prefix: str, chunk_tokens: int = 1 << 24) -> DatasetStats:
    """Documents, tokens and the largest token id of `prefix`.bin/.idx.

    Taken from the record the writer leaves when the files are unchanged since (see `_record`), else read from
    the files (the whole .bin, in chunks).
    """
    check_data_prefixes([prefix])
    record = _record(prefix)
    try:
        return DatasetStats(**{name: record[name] for name in DatasetStats.__dataclass_fields__})
    except (TypeError, KeyError):
        pass
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


def _file_digest(prefix: str) -> str:
    digest = hashlib.sha256()
    for suffix in (".idx", ".bin"):
        with open(prefix + suffix, "rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()


def dataset_digest(prefix: str) -> str:
    """The sha256 of `prefix`.idx and .bin: equal digests mean the same documents (the .idx: their lengths and the
    ids' type) of the same token ids (the .bin), which is what a loss mask built for one dataset must find in
    another to be valid for it. Taken from the record while the files are unchanged since it was written (as the
    stats are: training start-up reads no .bin), else computed from the files (one full read)."""
    check_data_prefixes([prefix])
    record = _record(prefix)
    if record is not None and isinstance(record.get("sha256"), str):
        return record["sha256"]
    return _file_digest(prefix)


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


LOSS_MASK_SUFFIX = "_loss_mask"  # PREFIX_loss_mask.bin/.idx: 1 where token j of PREFIX is supervised (SFT data)
_BLOCK = 4096  # what a file's size is rounded up to on disk, as most filesystems allocate


class DatasetNotWritten(OSError):
    """A dataset that could not be written for want of space, said in one line naming the file; nothing of it was
    published."""


def indexed_dataset_bytes(num_documents: int, num_tokens: int, vocab_size: int) -> int:
    """The disk space a dataset of so many documents and tokens takes as the writer writes it: the ids in the .bin,
    the .idx (a header, each document's length, offset and index), its record, each file in whole blocks."""
    from megatron.core.datasets.indexed_dataset import DType

    whole = lambda size: -(-size // _BLOCK) * _BLOCK
    index = 34 + 20 * num_documents + 8
    return whole(num_tokens * DType.size(DType.optimal_dtype(vocab_size))) + whole(index) + _BLOCK


@contextlib.contextmanager
def _writing(path: str, output_prefix: str):
    """A full disk while the block writes (for) `path` becomes one line naming it (the error alone names no file)."""
    try:
        yield
    except OSError as error:
        if not out_of_space(error):
            raise
        raise DatasetNotWritten(f"--output-prefix {output_prefix}: no space left on device writing {path}; nothing "
                                f"was published and the temporaries are removed: free space there or give another "
                                f"--output-prefix") from None


def _build(documents: Iterable[list[int]], private: str, vocab_size: int, target: str, output_prefix: str):
    """Writes `documents` (token id lists; empty ones are dropped) as `private`.bin/.idx, reads them back and checks
    them (documents, tokens, ids < `vocab_size`), and records their stats and digest beside them; returns the stats.
    `target` is the prefix they are for, named in errors."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    num_documents = num_tokens = 0
    with _writing(target + ".bin", output_prefix):
        builder = IndexedDatasetBuilder(private + ".bin", dtype=DType.optimal_dtype(vocab_size))
        for ids in documents:
            if len(ids) == 0:
                continue
            builder.add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
            num_documents += 1
            num_tokens += len(ids)
        builder.data_file.close()  # its buffered ids reach the disk here, so a full disk is the .bin's
    with _writing(target + ".idx", output_prefix):
        builder.finalize(private + ".idx")
    stats = dataset_stats(private)
    if (stats.num_documents, stats.num_tokens) != (num_documents, num_tokens) or stats.max_token_id >= vocab_size:
        raise RuntimeError(f"{target}: read back {stats}, wrote {num_documents} documents and {num_tokens} "
                           f"tokens with ids < {vocab_size}; nothing was replaced")
    return stats


def _seal(private: str, stats: DatasetStats, target: str, output_prefix: str, **pairing) -> str:
    """Makes `private`.bin/.idx durable and writes their record (stats, digest, `pairing`, the files' identity)
    beside them, to be published with them; returns their digest."""
    digest = _file_digest(private)
    with _writing(target + ".stats.json", output_prefix):
        for suffix in (".bin", ".idx"):
            fsync_path(private + suffix)
        with open(private + ".stats.json", "w", encoding="utf-8") as handle:
            json.dump({**asdict(stats), "sha256": digest, **pairing, "files": _files_identity(private)}, handle)
            handle.flush()
            os.fsync(handle.fileno())
    return digest


def _install(private: str, prefix: str, record: bool = True) -> None:
    """Renames `private`.bin/.idx (and, with `record`, their record) onto `prefix`'s. The old .idx and record go
    first, so a stop in between leaves a .bin without its .idx (refused, `check_data_prefixes`), never new ids
    under an old index."""
    _remove(prefix + ".idx", prefix + ".stats.json")
    os.replace(private + ".bin", prefix + ".bin")
    os.replace(private + ".idx", prefix + ".idx")
    if record:
        os.replace(private + ".stats.json", prefix + ".stats.json")


def write_indexed_dataset(documents: Iterable[list[int]], output_prefix: str, vocab_size: int) -> DatasetStats:
    """Write `documents` (token id lists) as a plain dataset, `output_prefix`.bin/.idx, verified, then renamed into
    place.

    Built in a private directory beside the prefix (`publish.private_directory`: removed on failure, and after a
    kill by the next write there) and read back (documents, tokens, ids < `vocab_size`) before the renames, so a
    crash never leaves a half dataset under the real name. A `.stats.json` record beside it spares training
    start-up a full read of the .bin (see `dataset_stats`, `dataset_digest`). A loss mask beside the prefix (of an
    earlier chat build) is withdrawn, its record first, so no reader ever pairs it with the new tokens.
    """
    check_output_prefix(output_prefix)
    mask = output_prefix + LOSS_MASK_SUFFIX
    with private_directory(output_prefix, "--output-prefix") as directory:
        private = os.path.join(directory, "tokens")
        stats = _build(documents, private, vocab_size, output_prefix, output_prefix)
        _seal(private, stats, output_prefix, output_prefix)
        _remove(mask + ".stats.json")
        _install(private, output_prefix)
        _remove(mask + ".idx", mask + ".bin")
        fsync_path(os.path.dirname(directory))
    return stats


def _same_documents(prefix: str, other: str) -> bool:
    first, second = _open_indexed(prefix), _open_indexed(other)  # held: the lengths are views of their mmaps
    return bool(np.array_equal(first.sequence_lengths, second.sequence_lengths))


def write_sft_dataset(tokens: Iterable[list[int]], masks: Iterable[list[int]], output_prefix: str,
                      vocab_size: int) -> DatasetStats:
    """Write SFT data as one pair: `tokens` at `output_prefix`.bin/.idx and their loss masks (1: supervised, 0: not;
    the same documents, token by token) at `output_prefix`_loss_mask.bin/.idx; returns the tokens' stats.

    Both are built in one private directory and checked (each read back; the masks have the tokens' documents,
    token for token), and the mask's record names the tokens' digest (`dataset_digest`), which training checks
    (`check_loss_mask`). They are published in an order no reader can take for a whole pair before it is one: the
    old mask's record goes first, then the new mask's files, the tokens, and the mask's record last. Until that
    last rename a reader finds a mask without its record, which training refuses; so a stop at any point leaves
    the old pair whole or a refused one, never a mask over other tokens taken for whole, and the new tokens never
    stand alone, where they would read as plain data with every token supervised.
    """
    check_output_prefix(output_prefix)
    mask = output_prefix + LOSS_MASK_SUFFIX
    with private_directory(output_prefix, "--output-prefix") as directory:
        private_tokens, private_mask = os.path.join(directory, "tokens"), os.path.join(directory, "mask")
        stats = _build(tokens, private_tokens, vocab_size, output_prefix, output_prefix)
        mask_stats = _build(masks, private_mask, 2, mask, output_prefix)
        if ((mask_stats.num_documents, mask_stats.num_tokens) != (stats.num_documents, stats.num_tokens)
                or not _same_documents(private_tokens, private_mask)):
            raise RuntimeError(f"{output_prefix}: the loss masks ({mask_stats}) do not cover the tokens ({stats}) "
                               f"document by document; nothing was replaced")
        digest = _seal(private_tokens, stats, output_prefix, output_prefix)
        _seal(private_mask, mask_stats, mask, output_prefix, tokens_sha256=digest)
        _remove(mask + ".stats.json")
        _install(private_mask, mask, record=False)
        _install(private_tokens, output_prefix)
        os.replace(private_mask + ".stats.json", mask + ".stats.json")
        fsync_path(os.path.dirname(directory))
    return stats


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
    vocabulary = vocabulary or Vocabulary.from_args(args)
    prefixes, weights = parse_data_path(args.data_path)
    if not prefixes:
        raise ConfigError("--data-path is required (scripts/prepare_data.py builds the default dataset)")
    check_data_prefixes(prefixes)
    check_vocabulary(prefixes, vocabulary.mask_token_id, vocabulary.padded_vocab_size,
                     vocabulary.tokenizer.vocab_size)
    split, sizes = args.split or MEGATRON_SPLIT_DEFAULT, sizes or split_sizes(args)
    check_split(prefixes, split)
    return _build_gpt_datasets(args, vocabulary, prefixes, weights, split, sizes, is_built_on_rank)


def _build_gpt_datasets(args, vocabulary, prefixes, weights, split, sizes, is_built_on_rank):
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

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


def has_loss_mask(prefix: str) -> bool:
    """Whether anything of a loss mask stands beside `prefix` (its .bin, .idx or record): a whole mask or what an
    interrupted write left of one, either of which makes `prefix` SFT data, never plain data."""
    return any(os.path.exists(prefix + LOSS_MASK_SUFFIX + suffix) for suffix in (".bin", ".idx", ".stats.json"))


def check_loss_mask(prefix: str, flag: str = "--data-path") -> str:
    """`prefix`'s loss mask, `prefix`_loss_mask, checked to be the one written with `prefix`'s tokens: its files
    whole, its record unchanged since `write_sft_dataset` wrote it, and the tokens' digest the one it names. Else
    one line naming the files and the fix."""
    mask = prefix + LOSS_MASK_SUFFIX
    fix = f"rebuild both with scripts/prepare_data.py --chat --force --output-prefix {prefix}"
    for path in (mask + ".bin", mask + ".idx"):
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {prefix}: {path} is missing from its loss mask (an interrupted build?); {fix}")
    record = _record(mask)
    if record is None or not isinstance(record.get("tokens_sha256"), str):
        raise ConfigError(f"{flag} {prefix}: {mask}.bin/.idx have no record of the tokens they were built for "
                          f"({mask}.stats.json is missing, from an older version, or older than them: an interrupted "
                          f"build?); {fix}")
    if record["tokens_sha256"] != dataset_digest(prefix):
        raise ConfigError(f"{flag} {prefix}: {mask}.bin/.idx were built for other tokens than {prefix}.bin/.idx "
                          f"(the digest its record names is not theirs: rebuilt or copied apart?); {fix}")
    if not _same_documents(prefix, mask):
        raise ConfigError(f"{flag} {prefix}: {mask} holds other documents than it (rebuilt apart?); {fix}")
    return mask


def loss_mask_prefixes(prefixes: list[str]) -> list[str] | None:
    """The loss-mask datasets beside `prefixes` (`tools.prepare_data --chat` writes them), or None where there are
    none; refuses a blend where only some have one, or a mask not written with its dataset (`check_loss_mask`)."""
    present = [has_loss_mask(prefix) for prefix in prefixes]
    if not any(present):
        return None
    if not all(present):
        lacking = prefixes[present.index(False)]
        raise ConfigError(f"--data-path {lacking} has no {lacking}{LOSS_MASK_SUFFIX}.bin/.idx while other datasets of "
                          f"the blend do: blend only SFT datasets (prepare_data --chat) or only plain ones")
    return [check_loss_mask(prefix) for prefix in prefixes]


def build_loss_mask_datasets(args: argparse.Namespace, vocabulary: Vocabulary | None = None,
                             is_built_on_rank: Callable[[], bool] | None = None, sizes: list[int] | None = None):
    """(train, valid, test) loss masks sample by sample beside `build_datasets`' samples, or None without masks.

    A GPTDataset over the mask files with the same settings: its documents have the same lengths, so its
    shuffles and sample boundaries are the token datasets' and sample `i` is the mask of token sample `i`."""
    vocabulary = vocabulary or Vocabulary.from_args(args)
    prefixes, weights = parse_data_path(args.data_path)
    masks = loss_mask_prefixes(prefixes)
    if masks is None:
        return None
    split, sizes = args.split or MEGATRON_SPLIT_DEFAULT, sizes or split_sizes(args)
    return _build_gpt_datasets(args, vocabulary, masks, weights, split, sizes, is_built_on_rank)
