"""SFT data from a chat JSONL: `prepare_data --chat` renders each conversation with a local tokenizer's chat
template, marks the assistant tokens (and only them) in PREFIX_loss_mask, pads each conversation to a block
multiple; training reads the mask beside every sample, and a packed SFT run trains from it."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from pretrain_runs import run

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "zebra apple river stone cloud maple ember quiet lantern orbit velvet meadow".split()


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """A tiny BPE tokenizer with a ChatML template; 60 conversations: user turns in capitals, answers lowercase."""
    from megatron_csbp.tools.tiny_hf_model import make_tokenizer

    root = tmp_path_factory.mktemp("sft")
    tokenizer = make_tokenizer(300)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(root / "tok")
    generator = torch.Generator().manual_seed(0)
    lines = []
    for i in range(60):
        pick = lambda n: " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (n,), generator=generator).tolist())
        messages = [{"role": "system", "content": "BE BRIEF."}, {"role": "user", "content": f"QUESTION {i}?"},
                    {"role": "assistant", "content": pick(3 + i % 5)}]
        if i % 3 == 0:  # a second exchange
            messages += [{"role": "user", "content": "AND MORE?"}, {"role": "assistant", "content": pick(2)}]
        lines.append(json.dumps({"messages": messages}))
    lines.insert(1, "not json")
    (root / "chat.jsonl").write_text("\n".join(lines) + "\n")
    prefix = str(root / "sft")
    from megatron_csbp.tools import prepare_data

    argv = ["--input", str(root / "chat.jsonl"), "--output-prefix", prefix, "--chat", "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok"), "--pad-to-multiple", "8"]
    assert prepare_data.main(argv) == 2  # the bad line is fatal by default
    assert prepare_data.main([*argv, "--on-bad-line", "skip"]) == 0
    return root, prefix


def test_only_assistant_tokens_are_supervised(chat_data):
    from megatron_csbp.training.datasets import LOSS_MASK_SUFFIX, _open_indexed
    from megatron_csbp.training.tokenizers import HuggingFaceTokenizer

    root, prefix = chat_data
    tokenizer = HuggingFaceTokenizer(str(root / "tok"))
    tokens, masks = _open_indexed(prefix), _open_indexed(prefix + LOSS_MASK_SUFFIX)
    assert len(tokens) == len(masks) == 60
    first = json.loads((root / "chat.jsonl").read_text().splitlines()[0])["messages"]
    ids, mask = tokens[0].tolist(), masks[0].tolist()
    decode = lambda picked: tokenizer._tokenizer.decode(picked, skip_special_tokens=False)
    # By hand, sample 0 (two exchanges): what is supervised is exactly each answer and its end-of-turn marker.
    assert decode([t for t, m in zip(ids, mask) if m]) == (first[2]["content"] + "<|im_end|>\n" + first[4]["content"]
                                                           + "<|im_end|>\n")
    assert decode([t for t, m in zip(ids, mask) if not m]) == (
        "<|im_start|>system\nBE BRIEF.<|im_end|>\n<|im_start|>user\nQUESTION 0?<|im_end|>\n<|im_start|>assistant\n"
        "<|im_start|>user\nAND MORE?<|im_end|>\n<|im_start|>assistant\n" + "<|endoftext|>" * ids.count(tokenizer.eod))
    for k in range(len(tokens)):  # every conversation ends with EOD, padded with EOD to a multiple of 8, unmasked
        ids, mask = tokens[k].tolist(), masks[k].tolist()
        assert len(ids) % 8 == 0 and ids[-1] == tokenizer.eod and sum(mask) > 0
        assert all(not m for t, m in zip(ids, mask) if t == tokenizer.eod)
        supervised = tokenizer.detokenize([t for t, m in zip(ids, mask) if m])
        assert not re.search("[A-Z]", supervised) and "<|im_start|>" not in supervised


def test_a_conversation_longer_than_the_sequence_is_refused_in_one_line(chat_data, capsys, tmp_path):
    from megatron_csbp.tools import prepare_data

    root, _ = chat_data
    argv = ["--input", str(root / "chat.jsonl"), "--output-prefix", str(tmp_path / "short"), "--chat",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok"), "--pad-to-multiple", "8",
            "--on-bad-line", "skip"]
    assert prepare_data.main([*argv, "--seq-length", "12"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("prepare_data: --seq-length 12 must be a "
                                                                       "positive multiple of --pad-to-multiple 8")
    assert prepare_data.main([*argv[:-2], "--on-bad-line", "error", "--seq-length", "16"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(r"prepare_data: .*chat\.jsonl:1: the conversation is \d+ tokens with its EOD, longer than "
                    r"--seq-length 16", line), line
    assert not os.path.exists(tmp_path / "short.bin")  # refused before anything is written


def test_a_chat_file_that_is_not_utf8_is_refused_in_one_line(chat_data, tmp_path):
    """Through the command: a Latin-1 line in the chat JSONL is one line naming the file, line and byte and the
    fix, exit 2, and nothing is written (was a UnicodeDecodeError traceback)."""
    root, _ = chat_data
    good = json.dumps({"messages": [{"role": "user", "content": "HI?"}, {"role": "assistant", "content": "apple"}]})
    bad = json.dumps({"messages": [{"role": "user", "content": "CAF\u00c9?"}, {"role": "assistant", "content": "x"}]},
                     ensure_ascii=False)
    source = tmp_path / "latin1.jsonl"
    source.write_bytes(good.encode() + b"\n" + bad.encode("latin-1") + b"\n")
    byte = len(good) + 1 + bad.index("\u00c9")
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                         "scripts", "prepare_data.py"),
                           "--input", str(source), "--output-prefix", str(tmp_path / "out"), "--chat",
                           "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"prepare_data: {source}:2: not UTF-8 text (byte 0xc9 at byte {byte} of the file); convert the file to UTF-8 "
        f"(e.g. iconv -f LATIN1 -t UTF-8), or skip such lines with --on-bad-line skip"], done.stderr
    assert os.listdir(tmp_path) == ["latin1.jsonl"]


def test_plain_and_chat_inputs_share_one_jsonl_reader(chat_data, capsys, tmp_path):
    """One reader of JSONL lines: a line that is not JSON is the same one line in plain and in chat mode (file,
    line, why and the fix, exit 2), skipped alike with --on-bad-line skip, and blank lines are passed over."""
    from megatron_csbp.tools import prepare_data

    root, _ = chat_data
    source = tmp_path / "in.jsonl"
    source.write_text("\n   \n{not json\n")
    plain = ["--input", str(source), "--output-prefix", str(tmp_path / "plain")]
    chat = ["--input", str(source), "--output-prefix", str(tmp_path / "chat"), "--chat", "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok")]
    why = f"{source}:3: not valid JSON (Expecting property name enclosed in double quotes at column 2)"
    for argv in (plain, chat):
        assert prepare_data.main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"prepare_data: {why}; fix or remove the line, or skip such lines with --on-bad-line skip"]
        assert prepare_data.main([*argv, "--on-bad-line", "skip"]) == 2  # nothing left to write
        assert capsys.readouterr().err.strip().splitlines()[0] == f"skipped {why}"
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_training_reads_each_samples_mask_and_trains_packed(chat_data):
    from pretrain_runs import validated_args
    from megatron_csbp.training.providers import RunProviders
    from megatron_csbp.training.tokenizers import HuggingFaceTokenizer

    root, prefix = chat_data
    settings = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(root / "tok"), split="90,10,0",
                    reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    args = validated_args(prefix, **settings)
    train, _, _ = RunProviders(args).train_valid_test_datasets_provider([16, 4, 0])
    tokenizer = HuggingFaceTokenizer(str(root / "tok"))
    seen = 0
    for index in range(8):
        sample = train[index]
        ids, mask = sample["tokens"].tolist(), sample["loss_mask"].tolist()
        assert len(ids) == len(mask) == args.seq_length
        for token, supervised in zip(ids, mask):  # capitals and template markers never supervised
            text = tokenizer.detokenize([token])
            if re.search("[A-Z]", text) or text in ("<|im_start|>", "<|endoftext|>"):
                assert not supervised, (index, text)
        supervised = tokenizer.detokenize([t for t, m in zip(ids, mask) if m])
        assert sum(mask) == 0 or any(word in supervised for word in WORDS), supervised
        seen += sum(mask)
    assert seen > 0
    done = run(1, {"data_path": prefix, "train_iters": 3, "eval_interval": 3, "eval_iters": 1, **settings})
    losses = [float(m) for m in re.findall(r"lm loss:\s*([-+0-9.eE]+)", done.output)]
    assert len(losses) >= 3 and all(loss == loss and loss > 0 for loss in losses), done.output[-3000:]
