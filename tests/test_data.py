"""Tokenizers and vocabulary, prepare_data (bad lines, default corpus, atomic writes), vocabulary checks, and
GPTDataset splits of L-token samples, in one process and on 2 gloo ranks."""

import math
import os
import sys
import types

import numpy as np
import pytest
import torch

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.tools import prepare_data
from megatron_csbp.data import datasets, tokenizers
from megatron_csbp.training.arguments import validate_args
from megatron_csbp.training.config import parse_args
from spawn import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = ["num-layers=2", "hidden-size=64", "num-attention-heads=4", "micro-batch-size=2", "train-iters=6",
         "lr=1e-3", "bdlm-block-size=8", "eval-interval=3", "eval-iters=2", "seed=7"]


def training_args(data_path, *extra, world=1):
    args = parse_args(MODEL + [f"data-path={data_path}", *extra])
    return validate_args(args, world, on_accelerator=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A byte-level dataset of ~120 KB of standard-library sources, and those sources' texts."""
    prefix = str(tmp_path_factory.mktemp("corpus") / "stdlib")
    assert prepare_data.main(["--output-prefix", prefix, "--max-bytes", "120000"]) == 0
    texts = []
    for path in prepare_data.stdlib_sources(120000):
        with open(path, encoding="utf-8") as handle:
            texts.append(handle.read().encode("utf-8"))
    return prefix, texts


def test_byte_tokenizer_and_padded_vocabulary():
    args = parse_args(["tensor-model-parallel-size=1"])
    tokenizer = tokenizers.build_tokenizer(args)
    assert tokenizer.tokenize("hé") == [104, 195, 169] and tokenizer.detokenize([104, 195, 169, 256]) == "hé"
    assert (tokenizer.eod, tokenizer.vocab_size) == (256, 257) and tokenizers.vocabulary(args, tokenizer) == (257, 384)
    args = parse_args(["tensor-model-parallel-size=4"])
    assert tokenizers.vocabulary(args, tokenizers.build_tokenizer(args))[1] == 512
    args = parse_args(["vocab-size=383"])
    tokenizer = tokenizers.build_tokenizer(args)
    assert tokenizer.eod == 383 and tokenizers.vocabulary(args, tokenizer) == (384, 512)
    with pytest.raises(ConfigError, match="--vocab-size 100: the byte tokenizer needs at least 256"):
        tokenizers.build_tokenizer(parse_args(["vocab-size=100"]))
    null = tokenizers.build_tokenizer(parse_args(["tokenizer-type=NullTokenizer", "vocab-size=256"]))
    assert (null.eod, null.vocab_size) == (256, 257) and null.tokenize("104 195") == [104, 195]


def _fake_tokenizers(vocabulary):
    class Tokenizer:
        @staticmethod
        def from_file(path):
            tokenizer = Tokenizer()
            tokenizer.get_vocab_size = lambda with_added_tokens=True: len(vocabulary)
            tokenizer.token_to_id = vocabulary.get
            tokenizer.encode = lambda text, add_special_tokens=False: types.SimpleNamespace(
                ids=[vocabulary.get(word, 0) for word in text.split()])
            return tokenizer
    return types.SimpleNamespace(Tokenizer=Tokenizer)


def test_huggingface_tokenizer_is_optional_and_local(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    args = parse_args(["tokenizer-type=HuggingFaceTokenizer", f"tokenizer-model={path}"])
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ConfigError, match="needs the 'tokenizers' package"):
        tokenizers.build_tokenizer(args)
    vocabulary = {f"w{i}": i for i in range(1000)} | {"</s>": 1000}
    monkeypatch.setitem(sys.modules, "tokenizers", _fake_tokenizers(vocabulary))
    tokenizer = tokenizers.build_tokenizer(args)
    assert (tokenizer.eod, tokenizer.vocab_size, *tokenizers.vocabulary(args, tokenizer)) == (1000, 1001, 1001, 1024)
    assert tokenizer.tokenize("w5 w7") == [5, 7]
    monkeypatch.setitem(sys.modules, "tokenizers", _fake_tokenizers({f"w{i}": i for i in range(1024)}))
    tokenizer = tokenizers.build_tokenizer(args)
    assert (tokenizer.eod, *tokenizers.vocabulary(args, tokenizer)) == (1024, 1025, 1152)
    with pytest.raises(ConfigError, match="--tokenizer-model .*missing.json: no such file"):
        tokenizers.build_tokenizer(parse_args(["tokenizer-type=HuggingFaceTokenizer",
                                         f"tokenizer-model={tmp_path / 'missing.json'}"]))


JSONL = ['{"text": "alpha"}', '{"text": "bro', '{"body": "x"}', '{"text": 5}', '', '{"text": "omega!"}']


@pytest.mark.parametrize("mode", ["skip", "error"])
def test_prepare_data_reports_bad_jsonl_lines(tmp_path, capsys, mode):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(JSONL) + "\n")
    prefix = str(tmp_path / "out")
    code = prepare_data.main(["--input", str(source), "--output-prefix", prefix, "--on-bad-line", mode])
    out, err = capsys.readouterr()
    if mode == "error":
        assert code == 2
        assert f"{source}:2: not valid JSON" in err and "--on-bad-line skip" in err and len(err.splitlines()) == 1
        assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # no half dataset, no temporary files
        return
    assert code == 0
    assert f"skipped {source}:2: not valid JSON" in err
    assert f"skipped {source}:3: no 'text' key" in err and f"skipped {source}:4: 'text' is a int" in err
    assert "2 documents, 13 tokens (verified), skipped 3 bad line(s)" in out
    stats = datasets.dataset_stats(prefix)
    assert (stats.num_documents, stats.num_tokens, stats.max_token_id) == (2, 13, 256)
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    dataset = IndexedDataset(prefix)  # keep it alive: its items are views of its memory map
    assert dataset[1].tolist() == list(b"omega!") + [256]


@pytest.mark.parametrize("under", ["file/out", "file/deeper/out"])
def test_prepare_data_refuses_an_output_prefix_under_a_file(tmp_path, capsys, under):
    """A file on the prefix's directory path: one line naming the flag and the file, exit 2, before any work
    (was a raw [Errno 17] and exit 1)."""
    source = tmp_path / "in.txt"
    source.write_text("some text")
    (tmp_path / "file").write_text("not a directory")
    code = prepare_data.main(["--input", str(source), "--output-prefix", str(tmp_path / under)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"prepare_data: --output-prefix {tmp_path / under}: {tmp_path / 'file'} is a file"), err
    assert (tmp_path / "file").read_text() == "not a directory"
    assert sorted(os.listdir(tmp_path)) == ["file", "in.txt"]
    with pytest.raises(ConfigError, match="is a file"):  # the writer refuses it too, called directly
        datasets.write_indexed_dataset([[1, 2]], str(tmp_path / under), 257)


def test_prepare_data_json_key_and_text_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"content": "xy"}\n')
    (tmp_path / "b.txt").write_text("plain text\n")
    prefix = str(tmp_path / "out")
    assert prepare_data.main(["--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt"), "--json-key", "content",
                              "--output-prefix", prefix, "--no-append-eod"]) == 0
    assert datasets.dataset_stats(prefix) == datasets.DatasetStats(2, 2 + 11, max(b"xy" + b"plain text\n"))


def test_default_dataset_is_the_standard_library(corpus, capsys):
    prefix, texts = corpus
    stats = datasets.dataset_stats(prefix)
    assert stats.num_documents == len(texts) > 10
    assert stats.num_tokens == sum(len(text) + 1 for text in texts)
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    dataset = IndexedDataset(prefix)  # keep it alive: its items are views of its memory map
    assert dataset[0].tolist() == list(texts[0]) + [256]
    assert prepare_data.main(["--output-prefix", prefix, "--max-bytes", "120000"]) == 0
    assert "already built" in capsys.readouterr().out
    defaults = prepare_data.build_parser().parse_args([])
    assert defaults.input is None and defaults.max_bytes >= 1_000_000 and defaults.on_bad_line == "error"
    assert prepare_data.DEFAULT_PREFIX == os.path.join("data", "stdlib_bytes_text_document")
    tiny = parse_args(["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml")])
    assert tiny.data_path == [prepare_data.DEFAULT_PREFIX]


def test_interrupted_write_keeps_the_previous_dataset(tmp_path):
    prefix = str(tmp_path / "d")
    datasets.write_indexed_dataset([[1, 2, 3], [4]], prefix, 257)

    def crashing():
        yield [5, 6]
        raise KeyboardInterrupt("preempted")
    with pytest.raises(KeyboardInterrupt):
        datasets.write_indexed_dataset(crashing(), prefix, 257)
    assert datasets.dataset_stats(prefix) == datasets.DatasetStats(2, 4, 4)
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx", "d.stats.json"]
    with pytest.raises(RuntimeError, match="nothing was replaced"):
        datasets.write_indexed_dataset([[1, 300]], prefix, 257)
    assert datasets.dataset_stats(prefix) == datasets.DatasetStats(2, 4, 4)


@pytest.mark.parametrize("max_id, needle", [(256, None), (257, "collides with the MASK id 257"),
                                            (300, "beyond the tokenizer's ids"),
                                            (400, "token id 400 exceeds the model's vocabulary (384 padded ids)")])
def test_vocabulary_check(tmp_path, max_id, needle):
    prefix = str(tmp_path / "ids")
    datasets.write_indexed_dataset([[0, 5, max_id], [7]], prefix, 1000)
    if needle is None:
        assert datasets.check_vocabulary([prefix], 257, 384) == max_id
        return
    with pytest.raises(ConfigError) as caught:
        datasets.check_vocabulary([prefix], 257, 384)
    assert str(caught.value).startswith(f"--data-path {prefix}: ") and needle in str(caught.value)
    with pytest.raises(ConfigError, match="--data-path"):
        datasets.build_datasets(training_args(prefix, "seq-length=16"))


def test_recorded_stats_are_used_only_for_unchanged_files(tmp_path):
    prefix = str(tmp_path / "d")
    written = datasets.write_indexed_dataset([[1, 2, 3], [4, 5]], prefix, 257)
    assert written == datasets.DatasetStats(2, 5, 5) == datasets.dataset_stats(prefix)
    os.remove(prefix + ".stats.json")
    assert datasets.dataset_stats(prefix) == written  # read from the files
    datasets.write_indexed_dataset([[1, 2, 3], [4, 5]], prefix, 257)
    with open(prefix + ".bin", "r+b") as handle:  # same size, new content (uint16 tokens): id 300 appears
        handle.seek(2)
        handle.write(np.array([300], dtype=np.uint16).tobytes())
    os.utime(prefix + ".bin", ns=(0, 0))
    assert datasets.dataset_stats(prefix).max_token_id == 300
    with pytest.raises(ConfigError, match="token id 300"):
        datasets.check_vocabulary([prefix], 257, 384)


def test_missing_and_corrupt_datasets_are_refused(tmp_path):
    prefix = str(tmp_path / "d")
    with pytest.raises(ConfigError, match=f"--data-path {prefix}: no {prefix}.bin"):
        datasets.dataset_stats(prefix)
    datasets.write_indexed_dataset([list(range(50))], prefix, 257)
    with open(prefix + ".bin", "r+b") as handle:
        handle.truncate(40)
    with pytest.raises(ConfigError, match="d.bin has 40 bytes, its .idx describes 100"):
        datasets.dataset_stats(prefix)
    with open(prefix + ".idx", "wb") as handle:
        handle.write(b"not an index")
    with pytest.raises(ConfigError, match="corrupt"):
        datasets.dataset_stats(prefix)
    os.remove(prefix + ".idx")
    with pytest.raises(ConfigError, match="has no .*d.idx beside it"):
        datasets.build_datasets(parse_args(MODEL + [f"data-path={prefix}", "seq-length=16"]))


def _pieces_come_from(tokens: list[int], texts: list[bytes]) -> bool:
    chunks, current = [], []
    for token in tokens:
        if token == 256:
            chunks.append(bytes(current))
            current = []
        else:
            current.append(token)
    chunks.append(bytes(current))
    return all(any(chunk in text for text in texts) for chunk in chunks if chunk)


def test_gpt_dataset_samples_are_clean_sequences_of_length_L(corpus):
    prefix, texts = corpus
    args = training_args(prefix, "seq-length=64", "split=90,10,0")
    train, valid, test = datasets.build_datasets(args)
    assert test is None and len(train) >= 6 * 2 and len(valid) >= (6 // 3 + 1) * 2 * 2
    for dataset in (train, valid):
        for index in (0, 1, len(dataset) - 1):
            sample = dataset[index]
            assert "attention_mask" not in sample
            tokens = sample["tokens"]
            assert tokens.shape == (64,) and tokens.dtype == torch.int64 and int(tokens.max()) <= 256
            assert _pieces_come_from(tokens.tolist(), texts)
    assert not _pieces_come_from([ord("\x07")] * 8, texts)  # the content check can fail

    other = os.path.join(os.path.dirname(prefix), "other")
    datasets.write_indexed_dataset([list(b"zzzz" * 40)] * 20, other, 257)
    blended = datasets.build_datasets(training_args(f"0.5 {prefix} 0.5 {other}", "seq-length=32", "split=90,10,0"))[0]
    tokens = torch.stack([blended[i]["tokens"] for i in range(len(blended))])
    from_other = (tokens == ord("z")).float().mean(dim=1) > 0.5
    assert 0.25 < from_other.float().mean() < 0.75  # both sources, in proportion to their weights


def test_splits_without_documents_are_refused(corpus):
    prefix, texts = corpus
    with pytest.raises(ConfigError) as caught:  # megatron-core would loop forever on an empty split
        datasets.build_datasets(training_args(prefix, "seq-length=64"))
    assert str(caught.value) == (f"--split '969, 30, 1' leaves the valid split 0 of the {len(texts)} documents of "
                                 f"--data-path {prefix}; give it at least {math.ceil(100 / len(texts))}% of the "
                                 f"documents, a zero share, or use more data")
    with pytest.raises(ConfigError, match="--split '0,0,0': give up to three"):
        datasets.build_datasets(training_args(prefix, "seq-length=64", "split=0,0,0"))
    splits = datasets.build_datasets(training_args(prefix, "seq-length=64", "split=100,0,0", "eval-iters=0"))
    assert splits[1:] == (None, None)


def test_transformer_and_optimizer_configs_from_tiny_cpu():
    from megatron_csbp.training.megatron_config import optimizer_config_from_args, transformer_config_from_args

    args = validate_args(parse_args(["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml")]), 2,
                         on_accelerator=False, check_paths=False)
    config = transformer_config_from_args(args)
    assert (config.num_layers, config.hidden_size, config.num_query_groups, config.ffn_hidden_size) == (4, 256, 2, 704)
    assert config.context_parallel_size == 2 and config.gated_linear_unit and config.calculate_per_token_loss
    assert config.params_dtype == torch.float32 and not config.add_bias_linear and config.normalization == "RMSNorm"
    optimizer = optimizer_config_from_args(args)
    assert (optimizer.lr, optimizer.min_lr, optimizer.adam_beta2, optimizer.weight_decay) == (1e-3, 1e-4, 0.95, 0.1)


def _build_on_rank(rank, world_size, prefix, cache):
    args = training_args(prefix, "seq-length=64", "global-batch-size=4", "split=90,10,0", f"data-cache-path={cache}",
                         world=world_size)
    train, valid, _ = datasets.build_datasets(args)
    return torch.stack([train[i]["tokens"] for i in range(8)]), torch.stack([valid[i]["tokens"] for i in range(4)])


def test_datasets_build_on_gloo_ranks_without_cuda(corpus, tmp_path):
    prefix, _ = corpus
    results = run_ranks(_build_on_rank, 2, prefix, str(tmp_path / "cache"), timeout=240)
    alone = _build_on_rank(0, 1, prefix, str(tmp_path / "cache_single"))
    for train, valid in results:
        assert torch.equal(train, alone[0]) and torch.equal(valid, alone[1])
    assert os.listdir(tmp_path / "cache")  # rank 0 wrote the index cache the other rank read
