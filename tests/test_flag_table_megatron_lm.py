"""The flag table against Megatron-LM's own parser and model (tag core_v0.16.1, `MEGATRON_LM_PATH`): every flag
classified, each set away from its default taken or refused in one line as the table says (alike in both loops),
and the honoured architecture flags building Megatron-LM's GPT model, name for name and shape for shape."""

import argparse
import os
import subprocess
import sys

import pytest

from conftest import megatron_lm_path
from pretrain_runs import REPO, SCRIPT, environment

MEGATRON_LM = megatron_lm_path()
pytestmark = pytest.mark.skipif(MEGATRON_LM is None, reason="Megatron-LM is absent: set MEGATRON_LM_PATH to a "
                                                            "Megatron-LM checkout of tag core_v0.16.1")
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "1", "--train-iters", "4", "--lr", "1e-3", "--bdlm-block-size", "8",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--transformer-impl", "local"]
# Values the generic rule below cannot make valid for these flags' parsers.
SAMPLE_VALUES = {
    "--moe-layer-freq": ["2"], "--no-rope-freq": ["2"], "--recompute-modules": ["mlp"], "--offload-modules": ["mlp"],
    "--cuda-graph-scope": ["attn"], "--iterations-to-skip": ["3"], "--profile-ranks": ["1"],
    "--high-priority-stream-groups": ["dp"], "--hierarchical-context-parallel-sizes": ["1", "1"],
    "--exit-signal": ["SIGINT"], "--mrope-section": ["1", "1"], "--rampup-batch-size": ["1", "1", "8"],
    "--cp-comm-type": ["a2a"], "--bdlm-noise-range": ["0.01", "0.5"], "--spec": ["megatron_csbp.mcore.spec", "x"],
    "--retriever-report-topk-accuracies": ["1"], "--data-path": ["1", "unused/a", "1", "unused/b"],
    "--attention-backend": ["flash"], "--tokenizer-type": ["HuggingFaceTokenizer"],
    "--offload-optimizer-states": ["x"], "--window-size": ["4,0"], "--hybrid-override-pattern": ["M*"],
    "--phase-transition-iterations": ["2"], "--kv-channels": ["32"], "--ffn-hidden-size": ["96"],
    "--num-query-groups": ["2"], "--seq-length": ["128"], "--max-position-embeddings": ["256"],
    "--micro-batch-size": ["2"], "--global-batch-size": ["2"], "--num-layers": ["4"], "--hidden-size": ["128"],
    "--num-attention-heads": ["8"], "--bdlm-block-size": ["32"], "--window-attn-skip-freq": ["2"], "--linear-attention-freq": ["2"], "--rotary-percent": ["0.5"],
    "--heterogeneous-layers-config-encoded-json": ["{}"], "--lr-warmup-fraction": ["0.1"],
}


@pytest.fixture(scope="module")
def megatron():
    sys.path.append(MEGATRON_LM)
    from megatron_csbp.training import megatron_lm

    assert megatron_lm.import_pretrain() is not None
    return megatron_lm


def test_the_table_classifies_every_flag_of_megatron_lms_parser(megatron):
    from megatron_csbp.training import flag_table

    parser = megatron.build_parser()
    assert flag_table.mismatches(parser) == ([], [])
    assert len(flag_table.parser_flags(parser)) == len(flag_table.TABLE)
    done = subprocess.run([sys.executable, "-m", "megatron_csbp.training.megatron_lm", "--check-flags"], cwd=REPO,
                          env=environment({"MEGATRON_LM_PATH": MEGATRON_LM}), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == flag_table.summary(), done.stdout + done.stderr[-2000:]
    print(done.stdout)


def _away_from_default(action: argparse.Action) -> list[str]:
    """Command-line words setting `action` to a valid value other than its default."""
    flag = action.option_strings[0]
    if flag in SAMPLE_VALUES:
        return [flag, *SAMPLE_VALUES[flag]]
    if action.nargs == 0:
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if not action.default else f"--no-{flag[2:]}"]
        return [flag]
    default = action.default
    if action.choices:
        value = next(str(choice) for choice in action.choices if choice != default)
    elif action.type is int:
        value = str((default or 0) + 2)
    elif action.type is float:
        value = str((default or 0.0) + 0.25)
    else:
        value = "x"
    return [flag, *([value] * (action.nargs if isinstance(action.nargs, int) else 1))]


def test_every_flag_set_away_from_its_default_is_honoured_neutral_or_refused_in_one_line(megatron, monkeypatch):
    """Each flag of Megatron-LM's parser in turn, under Megatron-LM's parse (validation only, no model): a refused
    flag stops the run with one line naming it, and with the same line under our loop; an honoured or neutral one
    is taken, or refused by a rule in one line."""
    from megatron_csbp.training import flag_table
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.training.flags import build_parser

    parser, ours = megatron.build_parser(), build_parser()
    monkeypatch.setattr(megatron, "build_parser", lambda: parser)  # built once: parsing does not change it
    ours_base = BASE + ["--data-path", "unused/prefix"]
    outcomes, fixed = {"honoured": 0, "neutral": 0, "refused": 0}, []
    for action in parser._actions:
        if (not action.option_strings or action.dest == "help" or action.option_strings[0] == "--config"
                or isinstance(action, flag_table._RefusedHere)):
            continue
        flag, words = action.option_strings[0], _away_from_default(action)
        entry = flag_table.entry(flag)
        try:
            parsed = parser.parse_args(BASE + words)
        except SystemExit:
            pytest.fail(f"{flag}: the sweep's value {words[1:]} does not parse; give one in SAMPLE_VALUES")
        if getattr(parsed, action.dest) == parser.get_default(action.dest):
            fixed.append(flag)  # a switch already on by the plugin's defaults, or sharing its dest with another
            continue
        try:
            megatron.parse_args(BASE + words, 1)
            message = None
        except ConfigError as refused:
            message = str(refused)
        if isinstance(entry, flag_table.Refused):
            assert message is not None and flag in message and "\n" not in message, (flag, words, message)
            if flag not in ours._option_string_actions or not isinstance(
                    ours._option_string_actions[flag], flag_table._RefusedHere):
                continue
            with pytest.raises(ConfigError) as refused_by_ours:
                ours.parse_args(ours_base + words)
            mine = str(refused_by_ours.value)  # the same line, but for the value Megatron-LM's parser typed
            assert mine.startswith(flag) and mine.split(": ", 1)[-1] == message.split(": ", 1)[-1], (flag, mine)
        else:
            assert message is None or "\n" not in message, (flag, message)
            if isinstance(entry, flag_table.Honoured) and entry.by == flag_table.MEGATRON_LM_LOOP:
                with pytest.raises(ConfigError, match="only"):
                    ours.parse_args(ours_base + words)
            if isinstance(entry, flag_table.Neutral):
                ours.parse_args(ours_base + words)  # taken by our loop too
        outcomes[entry.kind] += 1
    assert set(fixed) <= {"--calculate-per-token-loss", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
                          "--disable-chunked-prefill"}, fixed
    assert sum(outcomes.values()) == len(flag_table.TABLE) - 1 - len(fixed), outcomes  # all but --config
    print("flags set away from their defaults, by class:", outcomes)


@pytest.mark.parametrize("extra, message", [
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1; got 0"),
    (["--hidden-size", "66"], "--hidden-size 66 is not a multiple of --num-attention-heads 4; set --kv-channels"),
    (["--lr-warmup-fraction", "2"], "--lr-warmup-fraction 2.0 must be in [0, 1)"),
    (["--log-interval", "0"], "--log-interval must be >= 1; got 0"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor 1.0: token dropping"),
    (["--num-experts", "4", "--expert-model-parallel-size", "3"], "--expert-model-parallel-size 3 does not divide"),
    (["--sft"], "--sft: selects data the plugin's datasets provider does not build"),
    (["--load-fallback-to-previous"], "--load-fallback-to-previous is our loop's own"),
    # values Megatron-LM's own types run as Python (a SyntaxError, or all the memory there is), read first
    (["--num-experts", "4", "--moe-layer-freq", "[1,0"], "--moe-layer-freq '[1,0': the '[' at character 1 is not "
                                                         "closed"),
    (["--num-experts", "4", "--moe-layer-freq", "[1]*10**12"], "--moe-layer-freq '[1]*10**12': it builds the number "
                                                               "1000000000000, more than 10000"),
    (["--num-experts", "4", "--moe-layer-freq=[1]*9999*9999"], "--moe-layer-freq '[1]*9999*9999': it builds a list "
                                                               "of 99980001 layers"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"], "--moe-layer-freq [1, 0, 1] names 3 layers, but "
                                                            "--num-layers is 2"),
    (["--no-rope-freq", "[1]*10**12"], "--no-rope-freq '[1]*10**12': it builds the number 1000000000000"),
    (["--window-attn-skip-freq", "(((1"], "--window-attn-skip-freq '(((1': not an integer, and no list"),
    (["--linear-attention-freq", "[1]+"], "--linear-attention-freq '[1]+': expected a number, '[' or '(', found the "
                                          "end"),
    (["--no-rope-freq", "[1,0]"], "--no-rope-freq 1 0: is an architecture option"),  # well formed: the table's
    # sizes and the other numbers Megatron-LM takes and fails on later
    (["--num-experts", "4", "--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size must be >= 1; got 0"),
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "0"],
     "--moe-shared-expert-intermediate-size must be >= 1 (leave it unset for no shared expert); got 0"),
    (["--num-experts", "-1"], "--num-experts must be >= 0 (0: no experts); got -1"),
    (["--num-experts", "4", "--moe-router-topk", "0"], "--moe-router-topk must be >= 1; got 0"),
    (["--num-experts", "4", "--moe-aux-loss-coeff", "nan"], "--moe-aux-loss-coeff must be >= 0; got nan"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "0"], "--expert-tensor-parallel-size must be >= 1; got 0"),
    (["--num-experts", "4", "--expert-model-parallel-size", "0"], "--expert-model-parallel-size must be >= 1; got 0"),
    (["--rope-scaling-factor", "-8"], "--rope-scaling-factor must be > 0; got -8.0"),
    (["--num-layers", "100000"], "--num-layers must be <= 10000; got 100000"),
    (["--distributed-timeout-minutes", "10000000000"],
     "--distributed-timeout-minutes must be in [1, 527040]; got 10000000000"),
    (["--lr", "inf"], "--lr must be a finite number >= 0; got inf"),
    (["--lr-warmup-iters", "4"], "--lr-warmup-iters 4 must be below --lr-decay-iters 4 (default: --train-iters)"),
    (["--train-iters", "0"], "--train-iters (or --lr-decay-iters) must be >= 1 for the lr schedule"),
    # Megatron-LM's older spellings, where their meaning is not BDLM's; the modules a selective recompute names
    (["--position-embedding-type", "learned_absolute", "--no-position-embedding"],
     "--position-embedding-type learned_absolute: BDLM needs rope"),
    (["--rotary-seq-len-interpolation-factor", "4"], "--rotary-seq-len-interpolation-factor 4: RoPE position "
                                                     "interpolation is not implemented for BDLM"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
     "--recompute-modules mla_up_proj: mla_up_proj: the model has no multi-latent attention"),
    (["--recompute-activations", "--recompute-modules", "moe"], "--recompute-modules moe: moe: the model has no MoE "
                                                                "layers (--num-experts); drop it"),
    (["--moe-layer-recompute"], "--moe-layer-recompute: the model has no MoE layers (--num-experts); drop it"),
    (["--overlap-param-gather"], "--overlap-param-gather gathers the distributed optimizer's updated shards"),
])
def test_bad_values_and_refused_flags_stop_megatron_lm_before_its_asserts(megatron, extra, message):
    from megatron_csbp.core.rules import ConfigError

    with pytest.raises(ConfigError) as refused:
        megatron.parse_args(BASE + extra, 1)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), refused.value


def test_a_cpu_run_bigger_than_the_machine_is_refused_by_megatron_lm_too(megatron, monkeypatch):
    """Under Megatron-LM's parse (its sizes not yet filled in) the memory bound of our loop, with the same line."""
    from collections import namedtuple

    import psutil

    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.training import arguments
    from megatron_csbp.training.flags import build_parser

    memory = namedtuple("memory", "total")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(8 << 30))
    monkeypatch.setattr(psutil, "swap_memory", lambda: memory(2 << 30))
    monkeypatch.setattr(arguments, "_on_accelerator", lambda: False)
    for extra in (["--hidden-size", "4000000000"], ["--micro-batch-size", "100000000"],
                  ["--num-experts", "100000000", "--moe-token-dispatcher-type", "alltoall"]):
        with pytest.raises(ConfigError) as refused:
            megatron.parse_args(BASE + extra, 1)
        ours = build_parser().parse_args(BASE + extra + ["--data-path", "unused/prefix"])
        settings = arguments.validate(ours, 1, on_accelerator=False, check_paths=False)
        with pytest.raises(ConfigError) as refused_by_ours:
            arguments.check_host_memory(settings, ours, on_accelerator=False)
        assert str(refused.value) == str(refused_by_ours.value), extra
        assert str(refused.value).startswith("this model and micro-batch need over ") and "more than this machine's " \
            "10.0 GiB of memory and swap" in str(refused.value), str(refused.value)
    megatron.parse_args(BASE, 1)  # the control: the tiny model fits


@pytest.mark.parametrize("extra, line", [
    (["--num-experts", "4", "--moe-z-loss-coeff", "0.001"],
     "--moe-z-loss-coeff{}: is a mixture-of-experts option not supported with the BDLM model; drop it (supported MoE "
     "options: --num-experts, --moe-layer-freq, --moe-ffn-hidden-size, --moe-shared-expert-intermediate-size, "
     "--moe-router-topk, --moe-router-score-function, --moe-router-pre-softmax, --moe-router-dtype, "
     "--moe-router-load-balancing-type "
     "aux_loss|none, --moe-aux-loss-coeff, --moe-token-dispatcher-type alltoall|allgather, --moe-grouped-gemm, "
     "--expert-model-parallel-size, --expert-tensor-parallel-size)"),
    (["--sft"], "--sft: selects data the plugin's datasets provider does not build; give --data-path PREFIX (or a "
                "weighted blend) and --split"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1; got 0"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0"],
     "--moe-layer-freq '[1,0': the '[' at character 1 is not closed: the end where ']' should be; give an int N or a "
     "list of one 0 or 1 per layer, e.g. [0,1,1,1] or ([0]+[1]*3)*2"),
    (["--num-experts", "4", "--moe-layer-freq", "[1]*10**12"],
     "--moe-layer-freq '[1]*10**12': it builds the number 1000000000000, more than 10000; give an int N or a list of "
     "one 0 or 1 per layer, e.g. [0,1,1,1] or ([0]+[1]*3)*2"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size must be >= 1; got 0"),
    (["--lr-warmup-iters", "4"], "--lr-warmup-iters 4 must be below --lr-decay-iters 4 (default: --train-iters); "
                                 "shorten the warmup or give it as --lr-warmup-fraction"),
    (["--position-embedding-type", "yarn", "--yarn-original-max-position-embeddings", "16"],
     "--position-embedding-type yarn needs --yarn-rotary-scaling-factor F (how many times its original context the "
     "model extends to, e.g. 4)"),
    (["--llama-4-scaling-beta", "0.1"],
     "--llama-4-scaling-beta scales the queries past YaRN's original length (--yarn-original-max-position-embeddings), "
     "but --position-embedding-type is rope: give --position-embedding-type yarn, or drop --llama-4-scaling-beta"),
])
def test_refused_in_one_line_exit_2_under_both_loops(extra, line):
    for loop, value in (("megatron-lm", " 0.001"), ("megatron-core", "")):
        done = subprocess.run([sys.executable, SCRIPT, *BASE, "--data-path", "unused/prefix", "--training-loop", loop,
                               *extra], cwd=REPO, env=environment({"MEGATRON_LM_PATH": MEGATRON_LM}), timeout=300,
                              capture_output=True, text=True)
        errors = [text for text in done.stderr.splitlines() if "error" in text.lower()]
        assert done.returncode == 2 and errors == [f"pretrain_bdlm.py: error: {line.format(value)}"], (
            loop, done.returncode, done.stderr[-3000:])
        assert "initializ" not in done.stdout, loop  # refused before any work


def test_a_moe_layer_freq_in_a_yaml_is_refused_alike_under_both_loops(tmp_path):
    """A malformed or enormous pattern in a `--config` YAML: one line naming the file, exit 2, in both loops."""
    from megatron_csbp.training.layer_pattern import HINT

    for text, why in (("'[1]*10**12'", "it builds the number 1000000000000, more than 10000"),
                      ("'[1,0'", "the '[' at character 1 is not closed: the end where ']' should be")):
        config = tmp_path / "run.yaml"
        config.write_text(f"num-experts: 4\nmoe-layer-freq: {text}\n")
        for loop in ("megatron-lm", "megatron-core"):
            done = subprocess.run([sys.executable, SCRIPT, *BASE, "--data-path", "unused/prefix", "--training-loop",
                                   loop, "--config", str(config)], cwd=REPO, timeout=300, capture_output=True,
                                  text=True, env=environment({"MEGATRON_LM_PATH": MEGATRON_LM}))
            errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
            line = f"pretrain_bdlm.py: error: {config}: 'moe-layer-freq' {text}: {why}; {HINT}"
            assert done.returncode == 2 and errors == [line], (loop, done.stderr[-3000:])


def test_megatron_lms_type_reads_our_patterns_alike_and_gets_only_plain_lists(megatron):
    """Every pattern of the grammar's test has the value Megatron-LM's own `moe_freq_type` gives it, and what
    `pretrain()` re-parses is the plain list (or int) we read, never the user's expression."""
    from megatron.training.arguments import moe_freq_type

    from megatron_csbp.training import layer_pattern
    from test_arguments import LAYER_PATTERNS

    for text in LAYER_PATTERNS:
        assert layer_pattern.parse(text) == moe_freq_type(text.replace(" ", "")), text
    expanded, args = megatron.parse_args(BASE + ["--num-layers", "8", "--num-experts", "4",
                                                 "--moe-token-dispatcher-type", "alltoall", "--moe-layer-freq",
                                                 "([0]+[1]*3)*2"], 1)
    assert expanded[expanded.index("--moe-layer-freq") + 1] == "[0,1,1,1,0,1,1,1]"
    assert args.moe_layer_freq == [0, 1, 1, 1, 0, 1, 1, 1]


# (flags, what they change) checked against Megatron-LM's GPT model built from the same arguments.
ARCHITECTURES = {
    "default (LayerNorm, GeLU, biases, tied)": [],
    "--normalization RMSNorm --norm-epsilon 1e-6": ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6"],
    "--swiglu": ["--swiglu"],
    "--qk-layernorm": ["--qk-layernorm"],
    "--add-qkv-bias --disable-bias-linear": ["--add-qkv-bias", "--disable-bias-linear"],
    "--disable-bias-linear": ["--disable-bias-linear"],
    "--untie-embeddings-and-output-weights": ["--untie-embeddings-and-output-weights"],
    "--group-query-attention --num-query-groups 2": ["--group-query-attention", "--num-query-groups", "2"],
    "--kv-channels 32": ["--kv-channels", "32"],
    "--ffn-hidden-size 96 --num-layers 3 --hidden-size 48 --num-attention-heads 6": [
        "--ffn-hidden-size", "96", "--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "6"],
    "--rotary-percent 0.5 --rotary-base 500000": ["--rotary-percent", "0.5", "--rotary-base", "500000"],
    "--use-rope-scaling": ["--use-rope-scaling"],
    "--max-position-embeddings 256": ["--max-position-embeddings", "256"],
    "--init-method-std 0.05 --hidden-dropout 0.2": ["--init-method-std", "0.05", "--hidden-dropout", "0.2"],
    "Megatron-LM's older RoPE spellings": ["--position-embedding-type", "learned_absolute",
                                           "--use-rotary-position-embeddings", "--no-position-embedding",
                                           "--rotary-seq-len-interpolation-factor", "1"],
    "Qwen3-like": ["--normalization", "RMSNorm", "--swiglu", "--qk-layernorm", "--disable-bias-linear",
                   "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
                   "--kv-channels", "32", "--rotary-base", "1000000"],
}
CONFIG_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                 "ffn_hidden_size", "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func",
                 "add_bias_linear", "qk_layernorm", "init_method_std", "hidden_dropout",
                 "attention_dropout")


def _architecture_rank(rank, world_size, cases):
    """On one gloo rank: for each case, Megatron-LM's `gpt_builder` model and ours under both loops, all built
    under the same seed from the same flags; what differs between them."""
    import contextlib
    import io

    import torch

    from megatron_csbp.mcore import cpu_backend, parallel_state
    from megatron_csbp.training import arguments, flags, megatron_lm, providers
    from megatron_csbp.data.tokenizers import Vocabulary

    megatron_lm.import_pretrain()
    sys.path.append(os.environ["MEGATRON_LM_PATH"])
    import gpt_builders
    import megatron.training.arguments as megatron_arguments
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.training.global_vars import set_args

    def seeded(build):
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        return build()

    def tensors(model):
        return {name: value for name, value in model.state_dict().items()
                if isinstance(value, torch.Tensor) and not name.endswith("_extra_state")}

    def inverse_frequencies(model):
        rotary = model.rotary_pos_emb
        return getattr(rotary, "rotary", rotary).inv_freq

    def qkv_bias(config):  # Megatron-LM records add_qkv_bias=True beside add_bias_linear; the layers take either
        return config.add_bias_linear or config.add_qkv_bias

    results = {}
    with cpu_backend.active():
        parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=1)
        for name, extra in cases.items():
            argv = BASE + ["--use-cpu-initialization", "--no-persist-layer-norm"] + extra
            expanded, _ = megatron_lm.parse_args(argv, 1)  # our validation under Megatron-LM's parser
            sys.argv = ["pretrain_bdlm.py", *expanded]
            args = megatron_arguments.parse_args(extra_args_provider=flags.add_csbp_args)
            with contextlib.redirect_stdout(io.StringIO()):
                megatron_arguments.validate_args(args, {"max_position_embeddings": args.seq_length})
            our_args = arguments.validate_args(flags.build_parser().parse_args(argv + ["--data-path", "x"]), 1,
                                               on_accelerator=False, check_paths=False)
            vocabulary = Vocabulary.from_args(our_args)
            args.padded_vocab_size = vocabulary.padded_vocab_size
            set_args(args)
            models = {"megatron-lm gpt_builder": seeded(lambda: gpt_builders.gpt_builder(args, True, True)),
                      "ours under megatron-lm": seeded(lambda: providers.RunProviders(
                          vocabulary=vocabulary).model_provider()),
                      "ours under megatron-core": seeded(lambda: providers.RunProviders(
                          our_args, vocabulary=vocabulary).model_provider())}
            reference = models.pop("megatron-lm gpt_builder")
            expected = tensors(reference)
            # Megatron-LM's gpt_builder does not pass --rope-scaling-factor on (it keeps GPTModel's 8.0); ours does.
            rope = RotaryEmbedding(args.kv_channels, args.rotary_percent, rotary_base=args.rotary_base,
                                   rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor)
            case = {"parameters": sum(value.numel() for value in expected.values())}
            for label, model in models.items():
                got = tensors(model)
                case[label] = {
                    "names and shapes": {key: tuple(value.shape) for key, value in got.items()}
                                        == {key: tuple(value.shape) for key, value in expected.items()},
                    "initial values": got.keys() == expected.keys() and all(
                        torch.equal(got[key], expected[key]) for key in expected),
                    "config": [field for field in CONFIG_FIELDS
                               if getattr(model.config, field) != getattr(reference.config, field)]
                              + (["QKV bias"] if qkv_bias(model.config) != qkv_bias(reference.config) else []),
                    "tied": model.share_embeddings_and_output_weights == reference.share_embeddings_and_output_weights,
                    "max sequence length": model.max_sequence_length == reference.max_sequence_length,
                    "rope": torch.equal(inverse_frequencies(model), inverse_frequencies(reference))
                            and torch.equal(inverse_frequencies(model), rope.inv_freq),
                }
            dropped = [word for word in argv if word not in ("--swiglu", "--qk-layernorm", "--add-qkv-bias")]
            if dropped != argv:  # negative control: the same comparison, our model built without the flag
                control = arguments.validate_args(flags.build_parser().parse_args(dropped + ["--data-path", "x"]),
                                                  1, on_accelerator=False, check_paths=False)
                got = tensors(seeded(lambda: providers.RunProviders(control, vocabulary=vocabulary).model_provider()))
                case["control"] = ({key: tuple(value.shape) for key, value in got.items()}
                                   == {key: tuple(value.shape) for key, value in expected.items()})
            results[name] = case
    return results


def test_architecture_flags_build_megatron_lms_state_dict():
    """For each honoured architecture flag, our model (under both loops) has the state-dict names and shapes of
    the GPT model Megatron-LM's own `gpt_builders.gpt_builder` builds from the same arguments, the same initial
    weights under the same seed, the same TransformerConfig fields, tying, maximum length and RoPE frequencies.
    Negative control: our model built without --swiglu / --qk-layernorm / --add-qkv-bias fails the comparison."""
    from spawn import run_ranks

    os.environ["MEGATRON_LM_PATH"] = MEGATRON_LM
    (results,) = run_ranks(_architecture_rank, 1, ARCHITECTURES, timeout=600)
    for name, case in results.items():
        for label in ("ours under megatron-lm", "ours under megatron-core"):
            assert case[label] == {"names and shapes": True, "initial values": True, "config": [], "tied": True,
                                   "max sequence length": True, "rope": True}, (name, label, case[label])
    controls = {name: case["control"] for name, case in results.items() if "control" in case}
    assert len(controls) == 4 and not any(controls.values()), controls  # a dropped flag shows
    sizes = [case["parameters"] for case in results.values()]
    assert len(set(sizes)) >= len(sizes) - 5, sizes  # most cases change the parameters (the RoPE/init ones do not)


YARN = ["--position-embedding-type", "yarn", "--yarn-rotary-scaling-factor", "4",
        "--yarn-original-max-position-embeddings", "16", "--yarn-beta-fast", "8", "--yarn-mscale-all-dim", "1",
        "--no-yarn-correction-range-round-to-int",
        "--llama-4-scaling-beta", "0.5", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]


def _yarn_rank(rank, world_size, argv):
    """On one gloo rank: our model from the same YaRN flags under Megatron-LM's parse and config, and under ours;
    what each holds of YaRN and the query scaling."""
    import contextlib
    import io

    import torch

    from megatron_csbp.mcore import cpu_backend, parallel_state
    from megatron_csbp.training import arguments, flags, megatron_lm, providers
    from megatron_csbp.data.tokenizers import Vocabulary

    megatron_lm.import_pretrain()
    import megatron.training.arguments as megatron_arguments
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config
    from megatron.training.global_vars import set_args

    def seeded(build):
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        return build()

    with cpu_backend.active():
        parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=1)
        argv = BASE + ["--use-cpu-initialization", "--no-persist-layer-norm"] + argv
        expanded, _ = megatron_lm.parse_args(argv, 1)
        sys.argv = ["pretrain_bdlm.py", *expanded]
        args = megatron_arguments.parse_args(extra_args_provider=flags.add_csbp_args)
        with contextlib.redirect_stdout(io.StringIO()):
            megatron_arguments.validate_args(args, {"max_position_embeddings": args.seq_length})
        our_args = arguments.validate_args(flags.build_parser().parse_args(argv + ["--data-path", "x"]), 1,
                                           on_accelerator=False, check_paths=False)
        vocabulary = Vocabulary.from_args(our_args)
        args.padded_vocab_size = vocabulary.padded_vocab_size
        set_args(args)
        models = {"megatron-lm": seeded(lambda: providers.RunProviders(vocabulary=vocabulary).model_provider()),
                  "megatron-core": seeded(lambda: providers.RunProviders(our_args, vocabulary=vocabulary)
                                          .model_provider())}
        reference = YarnRotaryEmbedding(16, rotary_base=10000, scaling_factor=4.0, original_max_position_embeddings=16,
                                        beta_fast=8.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                        correction_range_round_to_int=False, use_cpu_initialization=True)
        expected_table, expected_factor = reference.get_emb(64)
        positions = torch.arange(64).repeat(2)[None]
        results = {}
        for label, model in models.items():
            table, factor = model.rotary_pos_emb()
            scales = model.positions.query_scaling.scales(positions)
            results[label] = {
                "state dict": {key: value for key, value in model.state_dict().items()
                               if isinstance(value, torch.Tensor) and not key.endswith("_extra_state")},
                "yarn config": {key: value for key, value in vars(model.config).items() if key.startswith("yarn_")},
                "table": torch.equal(table, expected_table), "factor": factor == expected_factor
                and _yarn_get_concentration_factor_from_config(model.config) == expected_factor,
                "scales": scales}
    return results


def test_yarn_and_the_query_scaling_build_the_same_model_under_both_loops():
    """Megatron-LM's own GPT model cannot be built with YaRN at this tag (its config has no `yarn_*` fields, which
    megatron-core's GPTModel reads): ours, from the same flags under Megatron-LM's parse and ours, has the same
    weights, the same `yarn_*` config fields, the RoPE table and concentration factor of megatron-core's
    `YarnRotaryEmbedding` built from the flags' values, and the same query scales (1 + 0.5 ln(1 + floor(p / 16)))."""
    from spawn import run_ranks

    import torch

    os.environ["MEGATRON_LM_PATH"] = MEGATRON_LM
    (results,) = run_ranks(_yarn_rank, 1, YARN, timeout=600)
    lm, core = results["megatron-lm"], results["megatron-core"]
    assert lm["state dict"].keys() == core["state dict"].keys()
    assert all(torch.equal(lm["state dict"][key], core["state dict"][key]) for key in lm["state dict"])
    assert lm["yarn config"] == core["yarn config"] == {
        "yarn_rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 16, "yarn_beta_fast": 8.0,
        "yarn_beta_slow": 1.0, "yarn_mscale": 1.0, "yarn_mscale_all_dim": 1.0,
        "yarn_correction_range_round_to_int": False}
    assert lm["table"] and core["table"] and lm["factor"] and core["factor"]
    positions = torch.arange(64).repeat(2)[None]
    expected = 1 + 0.5 * torch.log(1 + torch.floor(positions / 16))
    assert torch.equal(lm["scales"], core["scales"]) and torch.allclose(core["scales"], expected, rtol=0, atol=1e-6)
    assert not torch.equal(core["scales"], torch.ones_like(core["scales"]))  # positions past 16 are scaled


def test_gated_delta_net_under_block_parallelism_is_our_loops_only(megatron):
    """megatron-core's TransformerConfig asserts context_parallel_size == 1 beside Gated DeltaNet, and Megatron-LM's
    loop builds it from its flags: refused in one line before it; one block-parallel rank is taken."""
    from megatron_csbp.core.rules import ConfigError

    hybrid = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
              "--normalization", "RMSNorm"]
    with pytest.raises(ConfigError) as refused:
        megatron.parse_args(BASE + hybrid + ["--context-parallel-size", "2"], 2)
    assert str(refused.value).startswith("--experimental-attention-variant gated_delta_net with "
                                         "--context-parallel-size 2: megatron-core's TransformerConfig")
    _, args = megatron.parse_args(BASE + hybrid, 1)
    assert args.experimental_attention_variant == "gated_delta_net" and args.linear_attention_freq == 2
