"""Megatron-LM's own example recipes (Llama 3 / 3.1, Mixtral, Qwen3; tag core_v0.16.1, read from `MEGATRON_LM_PATH`)
through both loops' parsers: each flag is honoured, neutral (taken, with a note) or refused with a one-line reason,
and none is refused that Megatron-LM would run the same way.

Each recipe's flags are read from its file as the shell would pass them to Megatron-LM's script (`recipe_flags`:
every branch, torchrun's own arguments aside, variables at the defaults the file gives them; paths, and what the
recipe's launcher supplies, stood in). A recipe is parsed and validated whole, as on the GPUs it is written for, by
each loop (Megatron-LM's parser with the plugin's checks; our loop's parser and validation); a refusal names one of
its flags, which is then taken out and the rest parsed again, until the rest is taken. Every flag refused must be one
`NOT_THE_SAME_RUN` explains (what Megatron-LM would do with it that the plugin does not), or under our loop one that
Megatron-LM's loop takes instead (`--training-loop megatron-lm`), or one this machine lacks the software for
(Transformer Engine). The counts are printed.
"""

import argparse
import collections
import importlib.util
import os
import re
import shlex
import sys

import pytest

from conftest import megatron_lm_path

MEGATRON_LM = megatron_lm_path()
pytestmark = pytest.mark.skipif(MEGATRON_LM is None, reason="Megatron-LM is absent: set MEGATRON_LM_PATH to a "
                                                            "Megatron-LM checkout of tag core_v0.16.1")
RL = "examples/rl/model_configs/"
RECIPES = {  # each recipe: its files, in the order the shell reads them (the RL configs source common.sh first)
    "Llama 3 8B (FP8)": ["examples/llama/train_llama3_8b_h100_fp8.sh"],
    "Llama 3.1 8B Instruct (ModelOpt)": ["examples/post_training/modelopt/conf/meta-llama/Llama-3.1-8B-Instruct.sh"],
    "Llama 3.1 8B Instruct (RL)": [RL + "common.sh", RL + "llama3p1_8b_instruct.sh"],
    "Mixtral 8x7B": ["examples/mixtral/train_mixtral_8x7b_distributed.sh"],
    **{f"Qwen3 {size} (ModelOpt)": [f"examples/post_training/modelopt/conf/Qwen/Qwen3-{size}.sh"]
       for size in ("0.6B", "8B", "30B-A3B", "235B-A22B")},
    **{f"Qwen3 {size} (RL)": [RL + "common.sh", RL + f"qwen3_{name}.sh"]
       for size, name in (("4B", "4b"), ("8B", "8b"), ("32B", "32b"), ("30B-A3B", "30b_a3b_moe"))},
}
# Why each refused flag of the recipes is not a run Megatron-LM would make the same way under the plugin.
_RL = "reinforcement learning (Megatron-LM's train_rl.py), not BDLM training"
_FP8 = "FP8 training: other numerics, not tested with the CSBP attention"
NOT_THE_SAME_RUN = {
    "--apply-layernorm-1p": "zero-centred norm weights (1 + w): a parametrisation the BDLM model does not implement",
    "--cross-entropy-loss-fusion": "Megatron-LM's fused cross-entropy over GPT logits; the BDLM loss has none yet",
    "--fp8-format": _FP8, "--fp8-amax-history-len": _FP8, "--fp8-amax-compute-algo": _FP8, "--fp8-param-gather": _FP8,
    "--te-rng-tracker": "Transformer Engine's RNG tracker: other random streams, not tested with CSBP",
    "--mock-data": "Megatron-LM's random mock dataset, which the plugin's datasets provider does not build",
    "--tokenizer-type": "Mixtral's Llama2Tokenizer (SentencePiece), a tokenizer the plugin does not build",
    "--cuda-graph-impl": "CUDA graphs, not tested with the CSBP attention",
    "--data-parallel-random-init": "another initialisation on each data-parallel replica, not implemented",
    "--dist-ckpt-strictness": "a checkpoint-loading mode outside the plugin's verified loading",
    **{flag: _RL for flag in (
        "--grpo-group-size", "--grpo-prompts-per-step", "--grpo-iterations", "--grpo-clamp-eps-lower",
        "--grpo-clamp-eps-upper", "--grpo-kl-beta", "--grpo-entropy-term-weight", "--langrl-env-config",
        "--langrl-inference-server-type", "--langrl-inference-server-conversation-template",
        "--rl-offload-optimizer-during-inference", "--rl-use-sequence-packing", "--rl-sequence-packing-algo")},
}
MEGATRON_LM_LOOP_ONLY = "is taken under --training-loop megatron-lm only"
# A flag the table refuses, given at Megatron-LM's own default: nothing to refuse there (its default changes nothing).
AT_DEFAULT = "refused flag at Megatron-LM's default (no effect)"
NEEDS_TRANSFORMER_ENGINE = {"--transformer-impl", "--moe-grouped-gemm"}  # refused where it is not installed
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
# The values a recipe leaves to its launcher or points at paths: stood in (a path flag always).
PATH_FLAGS = ("--save", "--load", "--tensorboard-dir", "--data-cache-path", "--pretrained-checkpoint", "--data-path")
LAUNCHER_VALUES = {"--expert-model-parallel-size": ["1"], "--langrl-env-config": ["env.yaml"],
                   "--tokenizer-model": ["the-tokenizer"]}
# What the recipes' launchers add and either loop needs to parse them (our loop: an iteration count, an lr, data).
FILLERS = {"--train-iters": ["10"], "--lr": ["1e-4"], "--tokenizer-model": ["the-tokenizer"]}
_JUNK = re.compile(r"^(if|then|else|elif|fi|\[\[?|\]\]?|!|-[a-z]|==|\)|;|.*=\(?)$")


def _resolved(text: str) -> str:
    """`text` with comments and line continuations gone and each variable at the default the file gives it: its
    `${NAME:-default}`, else its `NAME=value` or `NAME=${NAME:-value}`; an unknown one as @NAME@."""
    text = re.sub(r"\\\n", " ", text)
    text = "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in text.splitlines())
    known = {}
    for name, value in re.findall(r"^\s*(?:export\s+)?([A-Z_][A-Z0-9_]*)=(\S*)\s*$", text, re.M):
        default = re.fullmatch(r"\$\{[A-Z0-9_]+:-(.*)\}", value)
        known[name] = (default.group(1) if default else value).strip("\"'")
    text = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", lambda m: m.group(1).strip("\"'"), text)
    return re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: known.get(m.group(1), f"@{m.group(1)}@"), text)


NEWLINE = "\u2424"  # a word standing for a line break: a flag's values are on its line


def _words(text: str) -> list[str]:
    """The shell words of `text`, line breaks kept as NEWLINE words (inside a multi-line string too), a quoted word
    holding several (an array element "--flag value") split again."""
    words = []
    for word in shlex.split(text.replace("\n", f" {NEWLINE} "), posix=True):
        words.extend(_words(word) if re.search(r"\s", word.strip()) else [word.strip()] if word.strip() else [])
    return words


def recipe_flags(root: str, paths: list[str], parser: argparse.ArgumentParser) -> list[list[str]]:
    """The recipe's flags as Megatron-LM's script gets them, each [flag, values...]: the words after a flag on its
    line, as many as `parser` gives it."""
    text = "\n".join(open(os.path.join(root, path), encoding="utf-8").read() for path in paths)
    text = re.sub(r"DISTRIBUTED_ARGS=(\(.*?\)|\".*?\")", "", text, flags=re.S)  # torchrun's own arguments
    groups, open_group = [], False
    for word in _words(_resolved(text)):
        if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", word):
            flag, _, value = word.partition("=")
            assert flag in parser._option_string_actions, f"{paths}: {flag} is not a Megatron-LM flag"
            groups.append([flag] + ([value] if value else []))
            open_group = True
        elif word == NEWLINE or _JUNK.match(word):
            open_group = False
        elif open_group and _takes_more(groups[-1], parser):
            groups[-1].append(word)
    for group in groups:
        flag = group[0]
        if flag in PATH_FLAGS:
            group[1:] = ["{data}" if flag == "--data-path" else "{path}"]
        elif any(mark in value for value in group[1:] for mark in "@$") and flag in LAUNCHER_VALUES:
            group[1:] = LAUNCHER_VALUES[flag]
        assert not any(mark in value for value in group[1:] for mark in "@$"), (
            f"{paths}: {group} has a value the file does not give")
    return groups


def _takes_more(group: list[str], parser: argparse.ArgumentParser) -> bool:
    nargs = parser._option_string_actions[group[0]].nargs
    return nargs in ("+", "*") or (nargs is None and len(group) == 1) or (isinstance(nargs, int)
                                                                          and len(group) <= nargs)


def _flag_named(message: str, flags: list[str]) -> str | None:
    """The flag of `flags` a refusal names first."""
    found = [(match.start(), flag) for flag in set(flags)
             for match in [re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", message)] if match]
    return min(found)[1] if found else None


def _world_size(argv: list[str]) -> int:
    """TP x PP x CP of the recipe, times 8 data-parallel replicas (expert parallelism up to 8 fits)."""
    def size(flag):
        return int(argv[len(argv) - 1 - argv[::-1].index(flag) + 1]) if flag in argv else 1
    return 8 * size("--tensor-model-parallel-size") * size("--pipeline-model-parallel-size") * size(
        "--context-parallel-size")


def _outcomes(groups, parse):
    """{flag: None (taken) or the refusal's line}, and the argv finally taken: `parse(argv)` raises ConfigError with
    one line, each refusal names a flag of the recipe, which is taken out."""
    from megatron_csbp.core.rules import ConfigError

    refused = {}
    while True:
        kept = [group for group in groups if group[0] not in refused]
        argv = [word for group in kept for word in group]
        present = {group[0] for group in kept}
        for flag, values in FILLERS.items():
            if flag not in present and not (flag == "--train-iters" and "--train-samples" in present):
                argv += [flag, *values]
        try:
            parse(argv)
        except ConfigError as refusal:
            line = str(refusal)
            flag = _flag_named(line, [group[0] for group in kept])
            assert flag is not None and flag not in FILLERS and "\n" not in line, (line, argv)
            refused[flag] = line
            continue
        return {group[0]: refused.get(group[0]) for group in groups}


@pytest.fixture(scope="module")
def parsers(tmp_path_factory, monkeypatch_module):
    """Both loops' parse and validation of an argv, as on a GPU machine, with paths stood in."""
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.tools import prepare_data
    from megatron_csbp.training import arguments, flags, megatron_lm

    sys.path.append(MEGATRON_LM)
    assert megatron_lm.import_pretrain() is not None
    root = tmp_path_factory.mktemp("recipes")
    (root / "docs.jsonl").write_text('{"text": "a few words of text"}\n' * 8)
    data = str(root / "data")
    assert prepare_data.main(["--input", str(root / "docs.jsonl"), "--output-prefix", data]) == 0
    monkeypatch_module.setattr(arguments, "_on_accelerator", lambda: True)
    theirs, ours = megatron_lm.build_parser(), flags.build_parser()
    monkeypatch_module.setattr(megatron_lm, "build_parser", lambda: theirs)

    def refuse(message):
        raise ConfigError(message)
    ours.error = refuse  # an argparse error (a value outside a flag's choices): one line, as the script prints it

    def stood_in(argv):
        argv = [{"{path}": str(root / "dir"), "{data}": data}.get(word, word) for word in argv]
        return argv + (["--data-path", data] if "--data-path" not in argv else [])

    def megatron_lm_loop(argv):
        megatron_lm.parse_args(stood_in(argv), _world_size(argv))

    def our_loop(argv):
        arguments.validate(ours.parse_args(stood_in(argv)), _world_size(argv), on_accelerator=True,
                           check_paths=False)
    return theirs, {"megatron-lm": megatron_lm_loop, "megatron-core": our_loop}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


KINDS = ("honoured by the plugin", "honoured by Megatron-LM's loop", "neutral", AT_DEFAULT, "refused: not the same run",
         "refused: Megatron-LM's loop takes it", "refused here: needs Transformer Engine")


def _kind(flag, line, loop):
    """What a loop did with a recipe's flag (`line`: its refusal, None where taken), and whether that may be so."""
    from megatron_csbp.training import flag_table

    entry = flag_table.entry(flag)
    if line is None:
        return ("neutral" if isinstance(entry, flag_table.Neutral) else AT_DEFAULT if isinstance(
            entry, flag_table.Refused) else "honoured by the plugin" if entry.by == flag_table.PLUGIN
            else "honoured by Megatron-LM's loop"), True
    if flag in NEEDS_TRANSFORMER_ENGINE and not HAS_TE and "needs Transformer Engine" in line:
        return "refused here: needs Transformer Engine", True
    if loop == "megatron-core" and MEGATRON_LM_LOOP_ONLY in line:
        return "refused: Megatron-LM's loop takes it", True
    return "refused: not the same run", flag in NOT_THE_SAME_RUN


def test_every_flag_of_megatron_lms_recipes_is_honoured_neutral_or_refused_with_a_reason(parsers):
    parser, loops = parsers
    missing = [path for paths in RECIPES.values() for path in paths
               if not os.path.isfile(os.path.join(MEGATRON_LM, path))]
    assert not missing, f"MEGATRON_LM_PATH={MEGATRON_LM} lacks {missing}: not a core_v0.16.1 checkout?"
    kinds = {loop: {} for loop in loops}  # flag -> its kind in the recipes (a refusal anywhere wins)
    for recipe, paths in RECIPES.items():
        groups = recipe_flags(MEGATRON_LM, paths, parser)
        assert len(groups) >= 20, (recipe, groups)
        for loop, parse in loops.items():
            outcomes = _outcomes(groups, parse)
            for flag, line in outcomes.items():
                kind, allowed = _kind(flag, line, loop)
                assert allowed, f"{recipe}, {loop}: {flag} refused ({line}), which Megatron-LM would run the same way"
                if kind.startswith("refused") or flag not in kinds[loop]:
                    kinds[loop][flag] = kind
            refused = sorted(flag for flag, line in outcomes.items() if line is not None)
            print(f"{recipe}, {loop} loop: {len(outcomes)} flags, {len(refused)} refused ({', '.join(refused)})")
    stale = set(NOT_THE_SAME_RUN) - {flag for seen in kinds.values() for flag, kind in seen.items()
                                     if kind == "refused: not the same run"}
    assert not stale, f"NOT_THE_SAME_RUN explains flags no recipe has refused: {sorted(stale)}"
    for loop, seen in kinds.items():
        counts = collections.Counter(seen.values())
        print(f"the example-recipe sweep, {loop} loop: {len(seen)} distinct flags of {len(RECIPES)} recipes: "
              + ", ".join(f"{kind} {counts[kind]}" for kind in KINDS if counts[kind]))
    for flag, kind in sorted(kinds["megatron-lm"].items()):
        if kind == "refused: not the same run":
            print(f"  {flag}: {NOT_THE_SAME_RUN[flag]}")
    # Megatron-LM's example flags the issue names: taken by both loops
    for flag in ("--no-position-embedding", "--use-rotary-position-embeddings", "--recompute-modules",
                 "--recompute-activations", "--overlap-grad-reduce", "--overlap-param-gather"):
        assert kinds["megatron-lm"][flag] == kinds["megatron-core"][flag] == "honoured by the plugin", flag


def test_the_reader_takes_the_shells_words_and_the_files_defaults(parsers, tmp_path):
    """The recipe reader on a file of the recipes' forms: arrays, quoted elements holding a flag and its value,
    multi-line strings, ${NAME:-default}, a flag named through a variable, comments, torchrun's arguments aside."""
    parser, _ = parsers
    (tmp_path / "recipe.sh").write_text(
        'TP=${TP:-4}\nLR=3e-4\nDISTRIBUTED_ARGS=(\n  --nproc_per_node 8\n  --nnodes 1\n)\n'
        'ARGS=(\n  --num-layers 32  # a comment\n  --tensor-model-parallel-size $TP\n)\n'
        'if [[ "$X" == "y" ]]; then\n  ARGS+=(\n    "--split \'99,1,0\'"\n    "--fp8-format hybrid"\n  )\nfi\n'
        'MORE="\\\n  --lr $LR \\\n  --${PRECISION:-bf16} \\\n  --recompute-modules core_attn mlp \\\n'
        '  --save $CHECKPOINT \\\n  --cuda-graph-impl=local \\\n"\nLAST="\n  --attention-backend flash\n'
        '  --tokenizer-type "HuggingFaceTokenizer"\n  --recompute-modules core_attn\n"\n'
        'torchrun ${DISTRIBUTED_ARGS[@]} x.py ${ARGS[@]} $MORE\n')
    groups = recipe_flags(str(tmp_path), ["recipe.sh"], parser)
    assert groups == [["--num-layers", "32"], ["--tensor-model-parallel-size", "4"], ["--split", "99,1,0"],
                      ["--fp8-format", "hybrid"], ["--lr", "3e-4"], ["--bf16"],
                      ["--recompute-modules", "core_attn", "mlp"], ["--save", "{path}"],
                      ["--cuda-graph-impl", "local"], ["--attention-backend", "flash"],
                      ["--tokenizer-type", "HuggingFaceTokenizer"], ["--recompute-modules", "core_attn"]], groups
