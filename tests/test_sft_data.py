"""SFT data from a chat JSONL: `prepare_data --chat` renders each conversation with a local tokenizer's chat
template, marks the assistant tokens (and only them) in PREFIX_loss_mask, pads each conversation to a block
multiple; training reads the mask beside every sample, and a packed SFT run trains from it. The two are published
as one pair (a kill, a full disk or a swap of files never passes for a whole pair), and conversations the chat
template or the tokenizer cannot take are bad lines."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from chat_tokenizer import WORDS, save_chat_tokenizer
from pretrain_runs import run


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """A tiny BPE tokenizer with a ChatML template; 60 conversations: user turns in capitals, answers lowercase."""
    root = tmp_path_factory.mktemp("sft")
    save_chat_tokenizer(root / "tok")
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
    from megatron_csbp.data.datasets import LOSS_MASK_SUFFIX, _open_indexed
    from megatron_csbp.data.tokenizers import HuggingFaceTokenizer

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
    from megatron_csbp.data.tokenizers import HuggingFaceTokenizer

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


# --- a chat dataset and its mask are published as one pair ---------------------------------------------------------

def _conversations(path, count=6, variant=0, extra=()):
    """`count` conversations and the `extra` lines; `variant` changes one digit of every user turn, so two variants
    have documents of the same lengths but other tokens."""
    answer = lambda i: " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + i % 3))
    lines = [json.dumps({"messages": [{"role": "user", "content": f"QUESTION {i}{variant}?"},
                                      {"role": "assistant", "content": answer(i)}]}) for i in range(count)]
    path.write_text("\n".join([*lines, *extra]) + "\n")
    return path


def _chat(tok, source, prefix, *extra):
    return ["--input", str(source), "--output-prefix", str(prefix), "--chat", "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", str(tok), *map(str, extra)]


def _bytes(prefix):
    with open(f"{prefix}.bin", "rb") as data, open(f"{prefix}.idx", "rb") as index:
        return data.read() + index.read()


def _state(prefix):
    """What training makes of `prefix` (the checks `build_datasets` and `build_loss_mask_datasets` make, which both
    loops call): ("refused", the line), ("plain", its files' bytes) or ("chat", its and its mask's files' bytes)."""
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.data import datasets

    try:
        datasets.check_data_prefixes([str(prefix)])
        datasets.dataset_stats(str(prefix))
        masks = datasets.loss_mask_prefixes([str(prefix)])
    except ConfigError as error:
        return "refused", str(error)
    return ("plain", _bytes(prefix)) if masks is None else ("chat", _bytes(prefix), _bytes(masks[0]))


def _published(directory):
    return sorted(name for name in os.listdir(directory) if not name.endswith(".jsonl") and name != "tok")


class _Killed(BaseException):
    """The writer's process dying there: a BaseException, which nothing of the writer handles."""


def _die_after(monkeypatch, directory, steps):
    """The `steps`-th rename onto or removal of a file in `directory` (a publication step; the private directory's
    own files are not in it) is the last thing the process does; returns the steps taken, by file name."""
    taken, replace, remove = [], os.replace, os.remove

    def step(path):
        if os.path.dirname(os.path.abspath(path)) == str(directory):
            taken.append(os.path.basename(path))
            if len(taken) == steps:
                raise _Killed(taken[-1])

    def replace_then_step(source, target):
        replace(source, target)
        step(target)

    def remove_then_step(path):
        remove(path)
        step(path)
    monkeypatch.setattr(os, "replace", replace_then_step)
    monkeypatch.setattr(os, "remove", remove_then_step)
    return taken


@pytest.fixture(scope="module")
def pairs(chat_data, tmp_path_factory):
    """Inputs of two chat datasets (A, B: the same lengths, other tokens) and a plain one, and each built alone."""
    from megatron_csbp.tools import prepare_data

    root, _ = chat_data
    inputs = tmp_path_factory.mktemp("inputs")
    a, b = _conversations(inputs / "a.jsonl"), _conversations(inputs / "b.jsonl", variant=1)
    (inputs / "plain.jsonl").write_text('{"text": "plain text, every token trained on"}\n')
    argv = {"A": _chat(root / "tok", a, "{}"), "B": _chat(root / "tok", b, "{}"),
            "plain": ["--input", str(inputs / "plain.jsonl"), "--output-prefix", "{}"]}
    alone = {}
    for name, command in argv.items():
        prefix = inputs / f"alone_{name}"
        assert prepare_data.main([str(prefix) if part == "{}" else part for part in command]) == 0
        alone[name] = _state(prefix)
    assert alone["A"][0] == alone["B"][0] == "chat" and alone["plain"][0] == "plain"
    assert alone["A"][1] != alone["B"][1]
    return argv, alone


def _run(argv, prefix, *extra):
    from megatron_csbp.tools import prepare_data

    return prepare_data.main([str(prefix) if part == "{}" else part for part in argv] + list(extra))


@pytest.mark.parametrize("old, new", [("A", "B"), ("plain", "B"), ("A", "plain")])
def test_a_rebuild_killed_at_any_step_leaves_the_old_pair_or_a_refused_one(pairs, tmp_path, monkeypatch, old, new):
    """Kill a --force rebuild after each step of its publication in turn (every rename onto or removal of a
    published file): training then finds the old dataset whole, or the new one whole, or refuses in one line;
    never a mask over other tokens, nor chat tokens without their mask read as plain data. The next --force
    rebuild recovers from each of those states."""
    argv, alone = pairs
    prefix, outcomes = tmp_path / "data", []
    for steps in range(1, 20):
        assert _run(argv[old], prefix, "--force") == 0 and _state(prefix) == alone[old]  # recovered
        with monkeypatch.context() as patch:
            taken = _die_after(patch, tmp_path, steps)
            try:
                assert _run(argv[new], prefix, "--force") == 0
            except _Killed:
                pass
        state = _state(prefix)
        if len(taken) < steps:  # not killed: it published all its steps
            assert state == alone[new]
            break
        assert state in (alone[old], alone[new]) or state[0] == "refused", (taken, state)
        assert state[0] != "refused" or "\n" not in state[1] and "--force" in state[1], state
        outcomes.append((taken[-1], "old" if state == alone[old] else state[0] if state[0] == "refused" else "new"))
        assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]  # the private directory went
    else:
        pytest.fail("the rebuild never finished")
    assert [outcome for _, outcome in outcomes].count("refused") >= 2, outcomes  # some steps leave a refused state
    if new == "B":  # the new mask is published over the old tokens at some step, and refused there
        assert ("data_loss_mask.idx", "refused") in outcomes, outcomes
    if old == "A":  # the old pair is refused from the first step on: its record goes first
        assert outcomes[0] == ("data_loss_mask.stats.json", "refused"), outcomes


DIE_AFTER = (
    "import os, signal, sys\n"
    "from megatron_csbp.tools import prepare_data\n"
    "replace, last = os.replace, os.environ['DIE_AFTER']\n"
    "def replace_then_die(source, target):\n"
    "    replace(source, target)\n"
    "    if os.path.abspath(target) == last:\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "os.replace = replace_then_die\n"
    "sys.exit(prepare_data.main(sys.argv[1:]))\n")


def test_a_process_killed_between_the_mask_and_the_tokens_is_refused_then_rebuilt(pairs, tmp_path):
    """SIGKILL right after the new mask is published, before the tokens: training refuses the pair in one line
    naming the files and the fix, prepare_data refuses to call it built, and --force rebuilds it whole, removing
    the dead writer's private directory."""
    argv, alone = pairs
    prefix = tmp_path / "data"
    assert _run(argv["A"], prefix) == 0
    command = [sys.executable, "-c", DIE_AFTER] + [str(prefix) if part == "{}" else part for part in argv["B"]]
    done = subprocess.run(command + ["--force"], env={**os.environ, "DIE_AFTER": f"{prefix}_loss_mask.idx"},
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == -9, done.stderr
    assert _bytes(f"{prefix}_loss_mask") == alone["B"][2] and _bytes(prefix) == alone["A"][1]  # new mask, old tokens
    state = _state(prefix)
    assert state == ("refused", f"--data-path {prefix}: {prefix}_loss_mask.bin/.idx have no record of the tokens "
                                f"they were built for ({prefix}_loss_mask.stats.json is missing, from an older "
                                f"version, or older than them: an interrupted build?); rebuild both with "
                                f"scripts/prepare_data.py --chat --force --output-prefix {prefix}"), state
    assert [name for name in os.listdir(tmp_path) if name.startswith(".data.partial-")]  # the dead writer's
    assert _run(argv["B"], prefix) == 2  # not "already built"
    assert _run(argv["B"], prefix, "--force") == 0 and _state(prefix) == alone["B"]
    assert _published(tmp_path) == ["data.bin", "data.idx", "data.stats.json", "data_loss_mask.bin",
                                    "data_loss_mask.idx", "data_loss_mask.stats.json"]


def test_training_refuses_a_mask_not_written_with_its_tokens(pairs, tmp_path):
    """The digest refusal. Two chat datasets with documents of the same lengths and other tokens: with their masks
    swapped (whole, records and all), each is refused in one line, though the lengths agree; so is a mask without
    its record, one changed since it, an old record without the tokens' digest, and tokens changed in place. The
    digest is recomputed where the tokens' own record is gone (accepted), and prepare_data --force repairs all."""
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.data import datasets
    from pretrain_runs import validated_args

    argv, alone = pairs
    a, b = tmp_path / "a", tmp_path / "b"
    assert _run(argv["A"], a) == 0 and _run(argv["B"], b) == 0
    assert _state(a) == alone["A"] and _state(b) == alone["B"]  # the negative control: each whole pair accepted
    held = [datasets._open_indexed(str(prefix)) for prefix in (a, b)]  # held: the lengths are views of their mmaps
    assert held[0].sequence_lengths.tolist() == held[1].sequence_lengths.tolist()  # only the digest tells them apart
    del held
    for suffix in (".bin", ".idx", ".stats.json"):
        os.rename(f"{a}_loss_mask{suffix}", tmp_path / f"swap{suffix}")
        os.rename(f"{b}_loss_mask{suffix}", f"{a}_loss_mask{suffix}")
        os.rename(tmp_path / f"swap{suffix}", f"{b}_loss_mask{suffix}")
    fix = "rebuild both with scripts/prepare_data.py --chat --force --output-prefix"
    for prefix in (a, b):
        assert _state(prefix) == ("refused", f"--data-path {prefix}: {prefix}_loss_mask.bin/.idx were built for other "
                                             f"tokens than {prefix}.bin/.idx (the digest its record names is not "
                                             f"theirs: rebuilt or copied apart?); {fix} {prefix}")
    args = validated_args(str(a), tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(argv["A"][-1]),
                          split="90,10,0")
    with pytest.raises(ConfigError, match="were built for other tokens"):  # what both training loops call
        datasets.build_loss_mask_datasets(args, sizes=[4, 1, 0])
    assert _run(argv["A"], a) == 2  # prepare_data does not call it built either
    assert _run(argv["A"], a, "--force") == 0 and _state(a) == alone["A"]

    no_record = "have no record of the tokens they were built for"
    record = json.loads(open(f"{a}_loss_mask.stats.json").read())
    os.remove(f"{a}.stats.json")  # the tokens' digest is recomputed from their files: the same
    assert _state(a) == alone["A"]
    os.utime(f"{a}_loss_mask.bin")  # the mask changed since its record
    assert no_record in _state(a)[1]
    assert _run(argv["A"], a, "--force") == 0 and _state(a) == alone["A"]
    os.remove(f"{a}_loss_mask.stats.json")
    assert no_record in _state(a)[1]
    with open(f"{a}_loss_mask.stats.json", "w") as handle:  # as written before the digest was recorded
        json.dump({key: value for key, value in record.items() if key != "tokens_sha256"}, handle)
    assert no_record in _state(a)[1]
    assert _run(argv["A"], a, "--force") == 0 and _state(a) == alone["A"]
    with open(f"{a}.bin", "r+b") as handle:  # one token changed in place, its size and record kept
        handle.seek(4)
        token = handle.read(2)
        handle.seek(4)
        handle.write(bytes([token[0] ^ 1, token[1]]))
    assert "were built for other tokens" in _state(a)[1]


def test_chat_over_plain_data_and_plain_over_chat_data_need_force(pairs, tmp_path, capsys):
    """--chat into a prefix holding plain data is refused in one line (was "already built", exit 0, no mask), and
    so is a plain build over chat data (its mask would be left over other tokens); both leave the files as they
    are, and --force rebuilds them whole, a plain rebuild removing the mask. A whole pair is "already built"."""
    argv, alone = pairs
    prefix = tmp_path / "data"
    assert _run(argv["plain"], prefix) == 0
    files = _published(tmp_path)
    capsys.readouterr()
    assert _run(argv["A"], prefix) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"prepare_data: --output-prefix {prefix} holds a plain dataset ({prefix}.bin/.idx without a loss mask "
        f"{prefix}_loss_mask.bin/.idx), not chat data; give another --output-prefix, or --force to rebuild it as "
        f"chat data"]
    assert _published(tmp_path) == files and _state(prefix) == alone["plain"]
    assert _run(argv["A"], prefix, "--force") == 0 and _state(prefix) == alone["A"]
    assert _run(argv["A"], prefix) == 0 and "already built" in capsys.readouterr().out
    assert _run(argv["plain"], prefix) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"prepare_data: --output-prefix {prefix} holds chat data (its loss mask {prefix}_loss_mask.bin/.idx is beside "
        f"it); give another --output-prefix, or --force to rebuild it as plain data (the mask is removed)"]
    assert _state(prefix) == alone["A"]
    assert _run(argv["plain"], prefix, "--force") == 0 and _state(prefix) == alone["plain"]
    assert _published(tmp_path) == ["data.bin", "data.idx", "data.stats.json"]


def test_the_space_a_dataset_takes_is_known_before_it_is_written(pairs, tmp_path):
    from megatron_csbp.data import datasets

    argv, _ = pairs
    prefix = tmp_path / "data"
    assert _run(argv["A"], prefix) == 0
    for name, vocabulary in ((str(prefix), 300), (f"{prefix}_loss_mask", 2)):
        stats = datasets.dataset_stats(name)
        assert os.path.getsize(name + ".bin") == 2 * stats.num_tokens  # uint16 ids
        assert os.path.getsize(name + ".idx") == 34 + 20 * stats.num_documents + 8
        block = lambda size: -(-size // 4096) * 4096
        assert datasets.indexed_dataset_bytes(stats.num_documents, stats.num_tokens, vocabulary) == (
            block(os.path.getsize(name + ".bin")) + block(os.path.getsize(name + ".idx")) + 4096)


@pytest.mark.parametrize("phase, call, written", [("add_document", 1, "data.bin"),
                                                  ("finalize", 2, "data_loss_mask.idx"),
                                                  ("record", 2, "data_loss_mask.stats.json")])
def test_a_disk_full_mid_write_names_the_file_and_publishes_nothing(pairs, tmp_path, monkeypatch, capsys, phase,
                                                                    call, written):
    """ENOSPC while the tokens' .bin, the mask's .idx or the mask's record is written: one line naming that file,
    exit 1, the old pair whole and no temporaries left."""
    import errno

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron_csbp.data import datasets

    argv, alone = pairs
    prefix = tmp_path / "data"
    assert _run(argv["A"], prefix) == 0
    files = _published(tmp_path)
    owner, name = (datasets.json, "dump") if phase == "record" else (IndexedDatasetBuilder, phase)
    original, calls = getattr(owner, name), []

    def fills_the_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, fills_the_disk)
    capsys.readouterr()
    assert _run(argv["B"], prefix, "--force") == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"prepare_data: --output-prefix {prefix}: no space left on device writing {tmp_path / written}; nothing was "
        f"published and the temporaries are removed: free space there or give another --output-prefix"]
    assert _published(tmp_path) == files and _state(prefix) == alone["A"]
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]


@pytest.fixture
def small_disk(tmp_path):
    """A 32 KiB tmpfs: room for a chat dataset of a few conversations, not of 60. Needs root (mount)."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_is_refused_before_writing_and_named_when_it_fills_all_the_same(pairs, chat_data, small_disk,
                                                                                    monkeypatch, capsys):
    """On a real 32 KiB disk: a chat build (and a plain one) that cannot fit is refused before anything is written,
    naming the prefix and the space needed (was: the mask published without its dataset, "[Errno 28]" naming no
    file). With that check out of the way the disk fills mid-write: one line naming the file, exit 1, the old
    pair whole, no temporaries."""
    from megatron_csbp.runtime import publish

    root, _ = chat_data
    argv, _ = pairs
    prefix = small_disk / "data"
    big = _chat(root / "tok", root / "chat.jsonl", prefix, "--on-bad-line", "skip")
    plain = ["--input", str(root / "chat.jsonl"), "--output-prefix", str(prefix), "--json-key", "messages",
             "--on-bad-line", "skip"]
    for command in (big, plain):
        capsys.readouterr()
        assert _run(command, prefix) == 2
        line, = capsys.readouterr().err.strip().splitlines()[-1:]
        assert re.fullmatch(rf"prepare_data: --output-prefix {prefix}: [0-9.]+ MiB are to be written but only "
                            rf"[0-9.]+ MiB are free there; free space or give another --output-prefix", line), line
        assert os.listdir(small_disk) == []
    assert _run(argv["A"], prefix) == 0
    old = _state(prefix)
    monkeypatch.setattr(publish, "require_free_space", lambda *args: None)
    capsys.readouterr()
    assert _run(big, prefix, "--force") == 1
    line, = capsys.readouterr().err.strip().splitlines()[-1:]
    assert re.fullmatch(rf"prepare_data: --output-prefix {prefix}: no space left on device writing "
                        rf"{prefix}(_loss_mask)?\.(bin|idx|stats\.json); nothing was published and the temporaries "
                        rf"are removed: free space there or give another --output-prefix", line), line
    assert _state(prefix) == old and not [name for name in os.listdir(small_disk) if name.startswith(".")]


# --- chat templates and conversations that cannot be rendered or encoded ---------------------------------------------

FAILING = ("{% for m in messages %}{% if m.content == 'RAISE' %}{{ raise_exception('no RAISE here') }}"
           "{% elif m.content == 'ESCAPE' %}{{ m.content.__class__.__mro__ }}{% elif m.content == 'DIVIDE' %}{{ 1 // 0 }}"
           "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer_with(root, tmp_path, template):
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(root / "tok", tok)
    (tok / "chat_template.jinja").write_text(template)
    return tok


def test_conversations_the_template_or_the_tokenizer_cannot_take_are_bad_lines(chat_data, tmp_path, capsys):
    """A template that raises, trips the sandbox or errs on a conversation, text that cannot be encoded (an
    unpaired surrogate, which JSON allows) and JSON nested too deeply: each one line naming the input line and
    the template's file or the field, exit 2, nothing written; with --on-bad-line skip each is skipped and counted
    and the rest is built (was a traceback each)."""
    root, _ = chat_data
    tok = _tokenizer_with(root, tmp_path, FAILING)
    template = tok / "chat_template.jinja"
    turn = lambda content, **more: json.dumps(
        {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "apple", **more}]})
    bad = [(turn("RAISE"), f"the chat template in {template} fails on this conversation (TemplateError: no RAISE "
                           f"here)", "fix the conversation or the template"),
           (turn("ESCAPE"), f"the chat template in {template} fails on this conversation (SecurityError: access to "
                            f"attribute '__class__' of 'str' object is unsafe.)",
            "fix the conversation or the template"),
           (turn("DIVIDE"), f"the chat template in {template} fails on this conversation (ZeroDivisionError: "
                            f"integer division or modulo by zero)", "fix the conversation or the template"),
           (turn("HI \ud800?"), r"messages[0].content holds an unpaired surrogate escape (\ud800-\udfff), not text",
            "replace or remove it"),
           (turn("HI?", name="\udfff"), r"messages[1].name holds an unpaired surrogate escape (\ud800-\udfff), not "
                                        r"text", "replace or remove it"),
           ('{"messages": ' + "[" * 100000 + "]" * 100000 + "}", "JSON nested too deeply to read",
            "fix or remove the line")]
    for line, why, fix in bad:
        source = tmp_path / "one.jsonl"
        source.write_text(turn("HI?") + "\n" + line + "\n")
        assert _run(_chat(tok, source, tmp_path / "out"), None) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"prepare_data: {source}:2: {why}; {fix}, or skip such lines with --on-bad-line skip"]
    source = tmp_path / "all.jsonl"
    source.write_text("\n".join([turn("HI?")] + [line for line, _, _ in bad] + [turn("BYE?")]) + "\n")
    assert _run(_chat(tok, source, tmp_path / "out", "--on-bad-line", "skip"), None) == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"skipped {source}:{number}: {why}" for number, (_, why, _) in
                                        enumerate(bad, start=2)]
    assert "2 conversations" in out and f"skipped {len(bad)} bad line(s)" in out
    assert _state(tmp_path / "out")[0] == "chat"
    assert _published(tmp_path) == ["out.bin", "out.idx", "out.stats.json", "out_loss_mask.bin", "out_loss_mask.idx",
                                    "out_loss_mask.stats.json"]


def test_a_template_that_does_not_parse_is_fatal_even_when_skipping(chat_data, tmp_path, capsys):
    root, _ = chat_data
    tok = _tokenizer_with(root, tmp_path, "{% for m in messages %}{{ m['content'] }}\n{% if %}")
    source = _conversations(tmp_path / "in.jsonl")
    for extra in ([], ["--on-bad-line", "skip"]):
        assert _run(_chat(tok, source, tmp_path / "out", *extra), None) == 2
        line, = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"prepare_data: {source}:1: the chat template in {tok / 'chat_template.jinja'} does "
                               f"not parse (its line 2: "), line
        assert line.endswith("); fix the template"), line
    assert _published(tmp_path) == []


def test_padding_is_bounded_before_any_work(chat_data, tmp_path, capsys):
    """A huge --pad-to-multiple without --seq-length is refused in one line naming the flag (was gigabytes
    allocated per conversation); the bound itself builds (control). With a --seq-length as huge, the space the
    padding would take is refused before anything is written."""
    root, _ = chat_data
    source = _conversations(tmp_path / "in.jsonl", count=2)
    out = tmp_path / "out"
    assert _run(_chat(root / "tok", source, out, "--pad-to-multiple", 10 ** 9), None) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "prepare_data: --pad-to-multiple 1000000000 is more than 4096 tokens without --seq-length: give the "
        "diffusion block size, or the training --seq-length L to pad to a divisor of it"]
    huge = 10 ** 12
    assert _run(_chat(root / "tok", source, out, "--pad-to-multiple", huge, "--seq-length", huge), None) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"prepare_data: --output-prefix {out}: [0-9.]+ MiB are to be written but only [0-9.]+ MiB "
                        rf"are free there; free space or give another --output-prefix", line), line
    assert _published(tmp_path) == []
    assert _run(_chat(root / "tok", source, out, "--pad-to-multiple", 4096), None) == 0
    from megatron_csbp.data.datasets import _open_indexed

    written = _open_indexed(str(out))  # held: the lengths are a view of its mmap
    assert written.sequence_lengths.tolist() == [4096, 4096]
