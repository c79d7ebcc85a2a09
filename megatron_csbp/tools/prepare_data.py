"""Build a Megatron indexed dataset (.bin/.idx) from JSONL or plain-text files.

With no arguments it builds the default dataset, `data/stdlib_bytes_text_document`, that
`configs/tiny_cpu.yaml` trains on: real text present on every machine — this Python's standard-library
sources (a sorted, deterministic list, about 4 MB) — byte-tokenized, one document per file.
`--corpus sequences` builds `data/sequences_bytes_text_document`, the demo's (`configs/demo_sequences.yaml`):
runs of well-known sequences (months, weekdays, planets, rainbow colours) from random starts, generated
here. A tiny model learns them in a few minutes on two CPU cores, so its samples can be checked by eye.

Inputs ending in `.jsonl`/`.json` hold one JSON object per line (text under `--json-key`; with `--chat`, a
conversation under `--chat-key`), read by one reader (`jsonl_values`); any other file is one document. Input
must be UTF-8: where a bad line is fatal, every input is checked before any work. A bad line (not UTF-8, not
JSON, without the key, or a value the command cannot use) is reported as `file:line: why` and skipped (counted)
or fatal (one line with the fix, exit 2), per `--on-bad-line`. The dataset is read back and checked before it
replaces anything (see `megatron_csbp.data.datasets.write_indexed_dataset`); with `--chat`, the tokens and
their loss mask are published as one pair (`write_sft_dataset`). A prefix holding the other kind of dataset (plain
data for `--chat`, chat data for a plain build) is refused unless `--force`, which rebuilds it whole. An output
that will not fit on its disk is refused before anything is written. Refusals are one line, exit 2; a disk that
fills up all the same is one line naming the file, exit 1, with nothing published.

`main(argv)` is the command of `scripts/prepare_data.py`.
"""

import argparse
import itertools
import json
import os
import random
import sys
import sysconfig

# The checkout this package runs from, whose data/ the default datasets go to (configs/ name them there).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PREFIX = os.path.join("data", "stdlib_bytes_text_document")
DEFAULT_MAX_BYTES = 4_000_000
SEQUENCES = {
    "months": "january february march april may june july august september october november december",
    "weekdays": "monday tuesday wednesday thursday friday saturday sunday",
    "planets": "mercury venus earth mars jupiter saturn uranus neptune",
    "colours": "red orange yellow green blue indigo violet",
}
CORPUS_PREFIXES = {"stdlib": DEFAULT_PREFIX, "sequences": os.path.join("data", "sequences_bytes_text_document")}
MAX_PAD_WITHOUT_SEQ_LENGTH = 4096  # --pad-to-multiple without --seq-length: far above any diffusion block size


class BadInput(ValueError):
    """Input that cannot be used, said in one line naming the file (and line) or the flag, and the fix."""


class BadLine(BadInput):
    """One unusable input line (or text file): why, how to fix it, and where (`file:line`; the reader fills it in)."""

    def __init__(self, why: str, fix: str = "fix or remove the line", where: str | None = None, fatal: bool = False):
        super().__init__(why)
        self.why, self.fix, self.where = why, fix, where
        self.fatal = fatal  # not the line's fault (the chat template's): never skipped


def stdlib_sources(max_bytes: int | None = DEFAULT_MAX_BYTES) -> list[str]:
    """The standard library's .py files, sorted by relative path, up to `max_bytes` in total."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d not in skip)
        found += [os.path.relpath(os.path.join(directory, name), root) for name in files if name.endswith(".py")]
    chosen, total = [], 0
    for relative in sorted(found):
        size = os.path.getsize(os.path.join(root, relative))
        if max_bytes is not None and total + size > max_bytes:
            break
        chosen.append(os.path.join(root, relative))
        total += size
    return chosen


def sequence_documents(count: int = 4000, seed: int = 0) -> list[str]:
    """`count` documents, each one of `SEQUENCES` continued cyclically from a random word for 8 to 40 words:
    every word after the first follows from the one before, which is what the demo's samples show learned."""
    generator = random.Random(seed)
    documents = []
    for _ in range(count):
        words = SEQUENCES[generator.choice(sorted(SEQUENCES))].split()
        start, length = generator.randrange(len(words)), generator.randint(8, 40)
        documents.append(" ".join(words[(start + k) % len(words)] for k in range(length)) + "\n")
    return documents


def _decoded(data: bytes, path: str, line: int | None, offset: int) -> str:
    """`data`, the bytes of `path` from byte `offset` (its line `line`; None: the whole file), as UTF-8 text; else a
    `BadLine` naming the first byte that is not UTF-8, its line and its offset in the file."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1 if line is None else line
        raise BadLine(f"not UTF-8 text (byte 0x{data[error.start]:02x} at byte {offset + error.start} of the file)",
                      "convert the file to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)", f"{path}:{line}") from None


def _bad_line(error: BadLine, on_bad_line: str, report) -> None:
    """The bad-line policy (`--on-bad-line`): fatal, one line with the fix (exit 2), or reported and skipped."""
    if error.fatal:
        raise BadInput(f"{error.where}: {error.why}; {error.fix}")
    if on_bad_line == "error":
        raise BadInput(f"{error.where}: {error.why}; {error.fix}, or skip such lines with --on-bad-line skip")
    report(f"skipped {error.where}: {error.why}")


def check_inputs(paths: list[str], on_bad_line: str) -> None:
    """Before any work: every input file exists and, where a bad line is fatal, is UTF-8 throughout, so a file
    that is not is refused in one line (file, line, byte offset, the fix) before anything is tokenized."""
    for path in paths:
        if not os.path.isfile(path):
            raise BadInput(f"{path}: no such input file")
    if on_bad_line != "error":
        return  # bad lines are skipped as the readers meet them
    for path in paths:
        with open(path, "rb") as handle:
            offset = 0
            for number, raw in enumerate(handle, start=1):
                try:
                    _decoded(raw, path, number, offset)
                except BadLine as error:
                    _bad_line(error, on_bad_line, None)
                offset += len(raw)


_BLANK = object()
NOT_TEXT = "holds an unpaired surrogate escape (\\ud800-\\udfff), not text"


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _unencodable(value, name: str) -> str | None:
    """Where in `value`, a JSON value called `name`, a string cannot be encoded (an unpaired surrogate escape, which
    JSON allows and no tokenizer takes), as `name[1].content`; None where nowhere."""
    if isinstance(value, str):
        return None if _encodes(value) else name
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        if isinstance(key, str) and not _encodes(key):
            return f"a key of {name}"
        found = _unencodable(child, f"{name}.{key}" if isinstance(key, str) else f"{name}[{key}]")
        if found:
            return found
    return None


def _jsonl_value(raw: bytes, path: str, number: int, offset: int, key: str, key_flag: str, parse):
    """One JSONL line's `parse(record[key])`, `_BLANK` for a blank line, or a `BadLine`."""
    line = _decoded(raw, path, number, offset)
    if not line.strip():
        return _BLANK
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise BadLine(f"not valid JSON ({error.msg} at column {error.colno})") from None
    except RecursionError:
        raise BadLine("JSON nested too deeply to read") from None
    if not isinstance(record, dict) or key not in record:
        raise BadLine(f"no '{key}' key", f"set {key_flag} to the key that holds it")
    return parse(record[key])


def jsonl_values(paths: list[str], key: str, key_flag: str, on_bad_line: str, report, parse=lambda value: value):
    """The one reader of JSONL input: `parse(record[key])` for each non-blank line of each file of `paths`, in order.

    A line that is not UTF-8, not JSON, not an object with `key` (the flag `key_flag` names it), or whose value
    `parse` refuses (a `BadLine`), is a bad line: fatal or reported and skipped, per `on_bad_line`."""
    for path in paths:
        with open(path, "rb") as handle:
            offset = 0
            for number, raw in enumerate(handle, start=1):
                try:
                    value = _jsonl_value(raw, path, number, offset, key, key_flag, parse)
                except BadLine as error:
                    error.where = error.where or f"{path}:{number}"
                    _bad_line(error, on_bad_line, report)
                    value = _BLANK
                offset += len(raw)
                if value is not _BLANK:
                    yield value


def read_documents(paths: list[str], json_key: str, on_bad_line: str, report):
    """Yield document texts: the `json_key` string of each line of a `.jsonl`/`.json` file, any other file whole.
    Bad lines (and text files that are not UTF-8) follow `on_bad_line`; `report` gets one line per skipped one."""

    def text(value):
        if not isinstance(value, str):
            raise BadLine(f"'{json_key}' is a {type(value).__name__}, not a string")
        if not _encodes(value):
            raise BadLine(f"'{json_key}' {NOT_TEXT}")
        return value

    for path in paths:
        if path.endswith((".jsonl", ".json")):
            yield from jsonl_values([path], json_key, "--json-key", on_bad_line, report, text)
            continue
        with open(path, "rb") as handle:
            data = handle.read()
        try:
            document = _decoded(data, path, None, 0)
        except BadLine as error:
            _bad_line(error, on_bad_line, report)
            continue
        yield document


def chat_template(tokenizer_model: str):
    """`render(messages, generation_prompt) -> text` from the chat template of a local Hugging Face tokenizer
    directory (its chat_template.jinja or tokenizer_config.json), rendered by transformers' sandboxed Jinja: nothing
    of the file runs as Python. A template that does not parse is fatal; one that fails on a conversation (raises,
    trips the sandbox, errs) makes that conversation a bad line; both name the template's file."""
    directory = tokenizer_model if os.path.isdir(tokenizer_model) else os.path.dirname(os.path.abspath(tokenizer_model))
    config = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(config):
        raise BadInput(f"--tokenizer-model {tokenizer_model}: --chat needs the tokenizer's chat template, and {config} "
                       f"does not exist; give the tokenizer's directory")
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    if not hf.chat_template:
        raise BadInput(f"--tokenizer-model {tokenizer_model}: {config} has no chat_template; use a chat model's "
                       f"tokenizer (or add its template there)")
    import jinja2

    template = os.path.join(directory, "chat_template.jinja")
    template = template if os.path.isfile(template) else config

    def render(messages, generation_prompt):
        try:
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except jinja2.TemplateSyntaxError as error:
            raise BadLine(f"the chat template in {template} does not parse (its line {error.lineno}: "
                          f"{' '.join(str(error.message).split())})", "fix the template", fatal=True) from None
        except Exception as error:  # the template's own code, sandboxed: whatever it raises is its failure here
            raise BadLine(f"the chat template in {template} fails on this conversation ({type(error).__name__}: "
                          f"{' '.join(str(error).split())})", "fix the conversation or the template") from None
        if not _encodes(text):
            raise BadLine(f"the chat template in {template} renders text that {NOT_TEXT}", "fix the template",
                          fatal=True)
        return text
    return render


def chat_document(messages, render, tokenizer) -> tuple[list[int], list[int]]:
    """A conversation's token ids under the chat template and its loss mask: 1 on the tokens of the assistant
    turns (what the template writes for each, its end-of-turn marker included), 0 on everything else.

    Each assistant turn is the text between the template's rendering of the turns before it (with the
    generation prompt) and of the turns up to it; a template that does not render a conversation's beginning
    as a prefix of the whole cannot be cut so, and is refused (`BadLine`)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in messages):
        raise BadLine("the conversation must be a list of {'role': str, 'content': str}")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadLine("no assistant turn, so nothing would be trained on")
    text = render(messages, False)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:turn], True) if turn else ""
        through = render(messages[:turn + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise BadLine(f"the chat template does not render turn {turn}'s conversation as a prefix of the whole, "
                          f"so its assistant tokens cannot be found", "use another chat template")
        spans.append((len(before), len(through)))
    ids, offsets = tokenizer.tokenize_with_offsets(text)
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in offsets]
    return ids, mask


def chat_documents(paths, key, render, tokenizer, on_bad_line: str, report, max_length=None):
    """`(ids, mask)` per conversation of the JSONL `paths`, each ending with EOD (mask 0). A conversation longer
    than `max_length` (the training `--seq-length`) would be cut across samples: a bad line; so is one holding
    text that cannot be encoded (named by its field)."""

    def conversation(messages):
        unencodable = _unencodable(messages, key)
        if unencodable:
            raise BadLine(f"{unencodable} {NOT_TEXT}", "replace or remove it")
        ids, mask = chat_document(messages, render, tokenizer)
        if max_length is not None and len(ids) + 1 > max_length:
            raise BadLine(f"the conversation is {len(ids) + 1} tokens with its EOD, longer than --seq-length "
                          f"{max_length}, so training would cut it across samples", "raise --seq-length")
        return ids + [tokenizer.eod], mask + [0]

    yield from jsonl_values(paths, key, "--chat-key", on_bad_line, report, conversation)


def build_parser() -> argparse.ArgumentParser:
    from megatron_csbp.core.rules import BYTE_TOKENIZER, TEXT_TOKENIZERS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--input", nargs="+", default=None,
                        help="JSONL (.jsonl/.json) or text files. Default: the --corpus.")
    parser.add_argument("--corpus", choices=sorted(CORPUS_PREFIXES), default="stdlib",
                        help="Without --input: the Python standard library's sources (default), or the demo's "
                             "generated sequences.")
    parser.add_argument("--output-prefix", default=None,
                        help="Writes PREFIX.bin/.idx. Default (without --input): the corpus's, "
                             f"{DEFAULT_PREFIX} or {CORPUS_PREFIXES['sequences']}, in the repository.")
    parser.add_argument("--json-key", default="text", help="Key holding the text in each JSONL object.")
    parser.add_argument("--on-bad-line", choices=("skip", "error"), default="error",
                        help="A malformed JSONL line (or undecodable text file) is fatal (default) or skipped.")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="End every document with the EOD id (default on).")
    parser.add_argument("--tokenizer-type", choices=TEXT_TOKENIZERS, default=BYTE_TOKENIZER)
    parser.add_argument("--tokenizer-model", default=None, help="Local tokenizer.json (HuggingFaceTokenizer).")
    parser.add_argument("--vocab-size", type=int, default=None, help="Tokenizer ids before EOD (as in training).")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                        help="Only for the default corpus: standard-library bytes to take.")
    parser.add_argument("--force", action="store_true",
                        help="Rebuild even if a verified dataset is already there, and over one of the other kind "
                             "(chat data for a plain build, whose loss mask goes, or plain data for --chat).")
    parser.add_argument("--chat", action="store_true",
                        help="Inputs are chat JSONL (a list of {role, content} per line under --chat-key): rendered "
                             "with --tokenizer-model's chat template, with PREFIX_loss_mask.bin/.idx marking the "
                             "assistant tokens, the only ones trained on.")
    parser.add_argument("--chat-key", default="messages", help="Key holding the conversation in each JSONL object.")
    parser.add_argument("--seq-length", type=int, default=None, metavar="L",
                        help="With --chat: the training --seq-length; a longer conversation is a bad line (it would "
                             "be cut across samples).")
    parser.add_argument("--pad-to-multiple", type=int, default=1, metavar="B",
                        help="With --chat: pad each conversation with EOD to a multiple of B tokens (the diffusion "
                             "block size), so packed conversations start on block boundaries and train as if alone. "
                             f"At most {MAX_PAD_WITHOUT_SEQ_LENGTH} without --seq-length; else a divisor of it.")
    return parser


def _check_chat_flags(args) -> None:
    """`--chat`'s flags, before any work: an input, a Hugging Face tokenizer, and a padding that fits the sequence
    (or, without --seq-length, is a block size: a huge one would pad every conversation to it)."""
    from megatron_csbp.core.rules import ConfigError

    if not args.input:
        raise BadInput("--chat needs --input FILE.jsonl (conversations under --chat-key)")
    if args.tokenizer_type != "HuggingFaceTokenizer" or not args.tokenizer_model:
        raise ConfigError("--chat needs --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (a local tokenizer "
                          "with a chat template in DIR/tokenizer_config.json)")
    if args.pad_to_multiple < 1:
        raise ConfigError(f"--pad-to-multiple {args.pad_to_multiple} must be >= 1 (the diffusion block size)")
    if args.seq_length is None and args.pad_to_multiple > MAX_PAD_WITHOUT_SEQ_LENGTH:
        raise ConfigError(f"--pad-to-multiple {args.pad_to_multiple} is more than {MAX_PAD_WITHOUT_SEQ_LENGTH} tokens "
                          f"without --seq-length: give the diffusion block size, or the training --seq-length L to "
                          f"pad to a divisor of it")
    if args.seq_length is not None and (args.seq_length < 1 or args.seq_length % args.pad_to_multiple):
        raise ConfigError(f"--seq-length {args.seq_length} must be a positive multiple of --pad-to-multiple "
                          f"{args.pad_to_multiple}, as training's is of its block size")


def _already_built(prefix: str, args, tokenizer) -> str | None:
    """The line saying `prefix` already holds what this command builds (then nothing is done), or None: build it.

    Without --force, a prefix holding the other kind of dataset (plain data for --chat, chat data for a plain
    build) is refused, as is chat data whose mask is not the one written with its tokens: --force rebuilds either
    whole (a plain build removes the mask)."""
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.data.datasets import LOSS_MASK_SUFFIX, check_loss_mask, dataset_stats, has_loss_mask

    if args.force:
        return None
    mask = prefix + LOSS_MASK_SUFFIX
    if args.chat and os.path.exists(prefix + ".idx") and not has_loss_mask(prefix):
        raise ConfigError(f"--output-prefix {prefix} holds a plain dataset ({prefix}.bin/.idx without a loss mask "
                          f"{mask}.bin/.idx), not chat data; give another --output-prefix, or --force to rebuild it "
                          f"as chat data")
    if not args.chat and has_loss_mask(prefix):
        raise ConfigError(f"--output-prefix {prefix} holds chat data (its loss mask {mask}.bin/.idx is beside it); "
                          f"give another --output-prefix, or --force to rebuild it as plain data (the mask is removed)")
    if not os.path.exists(prefix + ".idx"):
        return None
    if args.chat:
        check_loss_mask(prefix, "--output-prefix")
    stats = dataset_stats(prefix)
    if stats.max_token_id >= tokenizer.vocab_size:
        return None
    return f"{prefix}: already built ({stats.num_documents} documents, {stats.num_tokens} tokens); --force rebuilds it"


def _jsonl_lines(path: str) -> int:
    with open(path, "rb") as handle:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 24), b"")) + 1


def _plain_bytes(inputs: list[str], generated: list[str] | None, vocab_size: int) -> int:
    """The space a plain build takes, estimated from its input before tokenizing: a token per input byte (a UTF-8
    byte is at most one token, byte-level or byte-pair) and two per document (EOD, a special token the tokenizer
    may add), a document per JSONL line or other file. JSON's own syntax makes it an overestimate."""
    from megatron_csbp.data.datasets import indexed_dataset_bytes

    if generated is not None:
        size, documents = sum(len(text.encode("utf-8")) for text in generated), len(generated)
    else:
        size = sum(os.path.getsize(path) for path in inputs)
        documents = sum(_jsonl_lines(path) if path.endswith((".jsonl", ".json")) else 1 for path in inputs)
    return indexed_dataset_bytes(documents, size + 2 * documents, vocab_size)


def _write_chat(args, prefix, tokenizer, report, skipped) -> int:
    """`--chat`: the conversations' tokens at PREFIX and their assistant-token masks at PREFIX_loss_mask, published
    as one pair (`datasets.write_sft_dataset`); each conversation padded with EOD (mask 0) to a multiple of
    --pad-to-multiple tokens as it is written, so packed conversations start on block boundaries."""
    from megatron_csbp.data.datasets import LOSS_MASK_SUFFIX, indexed_dataset_bytes, write_sft_dataset
    from megatron_csbp.runtime.publish import require_free_space

    render = chat_template(args.tokenizer_model)
    check_inputs(args.input, args.on_bad_line)
    documents = list(chat_documents(args.input, args.chat_key, render, tokenizer, args.on_bad_line, report,
                                    args.seq_length))
    if not documents:
        why = f"all {len(skipped)} non-empty line(s) were skipped" if skipped else "the input is empty"
        raise BadInput(f"{', '.join(args.input)}: no conversations to write ({why}); give input with conversations "
                       f"in it")
    block = args.pad_to_multiple
    lengths = [-(-len(ids) // block) * block for ids, _ in documents]
    require_free_space(prefix, indexed_dataset_bytes(len(documents), sum(lengths), tokenizer.vocab_size)
                       + indexed_dataset_bytes(len(documents), sum(lengths), 2), "--output-prefix")
    padded = lambda values, fill, length: values + [fill] * (length - len(values))
    stats = write_sft_dataset((padded(ids, tokenizer.eod, n) for (ids, _), n in zip(documents, lengths)),
                              (padded(mask, 0, n) for (_, mask), n in zip(documents, lengths)), prefix,
                              tokenizer.vocab_size)
    supervised = sum(sum(mask) for _, mask in documents)
    print(f"wrote {prefix}.bin/.idx: {stats.num_documents} conversations, {stats.num_tokens} tokens, {supervised} "
          f"of them assistant tokens (loss mask: {prefix}{LOSS_MASK_SUFFIX}.bin/.idx, verified, published with them)"
          + (f", skipped {len(skipped)} bad line(s)" if skipped else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    from megatron_csbp.runtime import quiet

    quiet.quiet_start_up()  # before megatron is imported
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.data.datasets import check_output_prefix, write_indexed_dataset
    from megatron_csbp.runtime.publish import require_free_space
    from megatron_csbp.data.tokenizers import build_tokenizer

    args = build_parser().parse_args(argv)
    args.make_vocab_size_divisible_by, args.tensor_model_parallel_size = 1, 1
    prefix = args.output_prefix or os.path.join(REPO_ROOT, CORPUS_PREFIXES[args.corpus])
    generated = None if args.input or args.corpus == "stdlib" else sequence_documents()
    inputs = args.input or ([] if generated else stdlib_sources(args.max_bytes))
    try:
        check_output_prefix(prefix)
        if args.chat:
            _check_chat_flags(args)
        tokenizer = build_tokenizer(args)
        built = _already_built(prefix, args, tokenizer)
        if built:
            print(built)
            return 0
        eod = [tokenizer.eod] if args.append_eod else []
        skipped = []

        def report(line):
            skipped.append(line)
            print(line, file=sys.stderr)
        if args.chat:
            return _write_chat(args, prefix, tokenizer, report, skipped)
        check_inputs(inputs, args.on_bad_line)
        require_free_space(prefix, _plain_bytes(inputs, generated, tokenizer.vocab_size), "--output-prefix")
        texts = generated or read_documents(inputs, args.json_key, args.on_bad_line, report)
        documents = (ids for ids in (tokenizer.tokenize(text) + eod for text in texts if text) if ids)
        first = next(documents, None)
        if first is None:  # nothing to write: say why, before any file is made
            named = ", ".join(inputs) if len(inputs) <= 3 else f"{len(inputs)} input files"
            why = f"all {len(skipped)} non-empty line(s) were skipped" if skipped else "the input is empty"
            raise BadInput(f"{named}: no documents to write ({why}); give input with text in it")
        stats = write_indexed_dataset(itertools.chain([first], documents), prefix, tokenizer.vocab_size)
    except (ConfigError, BadInput) as error:  # refused input: one line, exit 2 (as every entry of ours)
        print(f"prepare_data: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a full disk mid-write among them (`datasets.DatasetNotWritten`): nothing published
        print(f"prepare_data: {error}", file=sys.stderr)
        return 1
    print(f"wrote {prefix}.bin/.idx: {stats.num_documents} documents, {stats.num_tokens} tokens (verified)"
          + (f", skipped {len(skipped)} bad line(s)" if skipped else ""))
    return 0
