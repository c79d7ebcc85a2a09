"""Tokenizers and the run's vocabulary: the byte tokenizer, Megatron-LM's NullTokenizer, a local Hugging Face
`tokenizer.json`, and the MASK id and padded vocabulary size a model is built with.

Vocabulary: the tokenizer's ids (bytes 0..255 and EOD = 256 for the byte tokenizer), then the MASK id
right after them (or the id `--bdlm-mask-token-id` names), then Megatron-style padding to a multiple of
`--make-vocab-size-divisible-by` x TP. The padding is a detail of the layout: the model never predicts a
padded id, and a checkpoint's real rows load into any TP's padding, so only the real ids (`num_ids`) are
part of a model's identity.
"""

import argparse
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from megatron_csbp.core import rules
from megatron_csbp.core.rules import ConfigError

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

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`tokenize`'s ids and each one's character span in `text` (to mark the tokens of a span: SFT masks)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

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
