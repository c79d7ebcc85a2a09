"""Argument wiring, Megatron-LM defaults, derived values, and every refusal of `validate_args`."""

import argparse
import dataclasses

import pytest

from megatron_csbp.core.rules import MAX_LAYERS, ConfigError
from megatron_csbp.core.run_config import RunConfig
from megatron_csbp.training.arguments import validate_args
from megatron_csbp.data.datasets import parse_data_path
from megatron_csbp.training.flags import add_csbp_args, build_parser

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--data-path", "unused/prefix",
        "--bdlm-block-size", "8"]


def parse(*extra):
    return build_parser().parse_args(BASE + list(extra))


def validate(*extra, world=1, **kwargs):
    kwargs.setdefault("on_accelerator", False)
    kwargs.setdefault("check_paths", False)
    return validate_args(parse(*extra), world, **kwargs)


def test_plugin_flags_land_with_their_types():
    args = parse("--context-block-parallel", "4", "--context-block-parallel-clean-shards", "2",
                 "--bdlm-objective", "fast-dllm-v2", "--bdlm-loss-weighting", "inverse-t",
                 "--bdlm-noise-range", "0.05", "0.9", "--bdlm-noise-sampling", "iid", "--bdlm-parallel-mode", "bp",
                 "--csbp-transport", "streaming", "--csbp-block-schedule", "contiguous",
                 "--csbp-clean-layout", "contiguous", "--max-consecutive-bad-steps", "7",
                 "--distributed-timeout-minutes", "2", "--config", "x.yaml")
    assert args.context_block_parallel == 4 and args.context_parallel_size == 4
    assert args.context_block_parallel_clean_shards == 2 and args.bdlm_block_size == 8
    assert (args.bdlm_objective, args.bdlm_loss_weighting, args.bdlm_noise_sampling) == ("fast-dllm-v2", "inverse-t",
                                                                                          "iid")
    assert args.bdlm_noise_range == [0.05, 0.9] and all(isinstance(t, float) for t in args.bdlm_noise_range)
    assert (args.bdlm_parallel_mode, args.csbp_transport) == ("bp", "streaming")
    assert (args.csbp_block_schedule, args.csbp_clean_layout) == ("contiguous", "contiguous")
    assert args.max_consecutive_bad_steps == 7 and args.distributed_timeout_minutes == 2
    assert args.config == "x.yaml"


def test_megatron_defaults_and_ours():
    args = parse()
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size) == (1, 1, 1)
    assert (args.lr_decay_style, args.min_lr, args.lr_warmup_iters, args.weight_decay) == ("linear", 0.0, 0, 0.01)
    assert (args.adam_beta1, args.adam_beta2, args.clip_grad, args.seed) == (0.9, 0.999, 1.0, 1234)
    assert (args.eval_interval, args.eval_iters, args.log_interval) == (1000, 100, 100)
    assert (args.attention_dropout, args.hidden_dropout, args.init_method_std) == (0.0, 0.1, 0.02)  # BDLM: 0
    assert (args.num_query_groups, args.make_vocab_size_divisible_by, args.rotary_base) == (1, 128, 10000)
    assert args.normalization == "LayerNorm" and args.add_bias_linear and not args.bf16
    assert args.distributed_timeout_minutes == 10
    assert args.calculate_per_token_loss is True  # ours: always on (Megatron-LM's default is off)
    assert parse("--calculate-per-token-loss").calculate_per_token_loss is True
    assert parse("--disable-bias-linear").add_bias_linear is False
    assert (args.bdlm_objective, args.bdlm_parallel_mode, args.csbp_transport) == ("bd3lm", "csbp", "collective")


def test_extra_args_provider_reuses_megatron_flags():
    megatron_like = argparse.ArgumentParser()
    megatron_like.add_argument("--context-parallel-size", type=int, default=1)
    megatron_like.add_argument("--distributed-timeout-minutes", type=int, default=10)
    add_csbp_args(megatron_like)  # no conflicting-option error
    args = megatron_like.parse_args(["--context-block-parallel", "4", "--distributed-timeout-minutes", "3"])
    assert (args.context_parallel_size, args.context_block_parallel, args.distributed_timeout_minutes) == (4, 4, 3)
    bare = add_csbp_args(argparse.ArgumentParser()).parse_args([])
    assert bare.distributed_timeout_minutes == 10


def test_validate_fills_derived_values():
    args = validate("--context-block-parallel", "2", "--tensor-model-parallel-size", "2", "--swiglu",
                    "--micro-batch-size", "2", "--sequence-parallel", world=8)
    assert args.context_block_parallel == 2
    assert (args.data_parallel_size, args.global_batch_size) == (2, 4)
    assert args.ffn_hidden_size == int(4 * 64 * 2 / 3 / 64) * 64 and args.kv_channels == 16
    assert args.num_query_groups == 4 and args.max_position_embeddings == 64 and args.lr_decay_iters == 10
    assert args.split == "969, 30, 1" and args.sequence_parallel


def test_the_run_config_resolves_what_the_flags_leave_to_defaults():
    """The defaults the run leaves (C, the weighting) are resolved once, in the RunConfig, not written to args;
    the sizes Megatron's code reads off args are written back from it (`RunConfig.write_back`)."""
    args = validate("--context-block-parallel", "2", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                    world=8)
    settings = RunConfig.from_args(args)
    assert (settings.block_parallel_size, settings.clean_shards, settings.data_parallel_size) == (2, 2, 2)
    assert (settings.loss_weighting, settings.global_batch_size, settings.shape.kv_channels) == ("inverse-t", 4, 16)
    assert (args.kv_channels, args.num_query_groups, args.global_batch_size) == (16, 4, 4)  # written back
    assert args.context_block_parallel_clean_shards is None and args.bdlm_loss_weighting is None  # args untouched
    assert RunConfig.from_args(validate("--bdlm-objective", "fast-dllm-v2")).loss_weighting == "unit"
    assert RunConfig.from_args(validate("--context-block-parallel", "4", "--bdlm-parallel-mode", "bp", world=4)).clean_shards == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.clean_shards = 1
    assert validate("--sequence-parallel").sequence_parallel is False  # as Megatron-LM: no SP without TP
    cp_slot_only = validate("--context-parallel-size", "2", world=2)  # P has one home: Megatron's CP slot
    assert RunConfig.from_args(cp_slot_only).block_parallel_size == 2 and cp_slot_only.context_block_parallel is None
    assert validate("--bf16", "--use-distributed-optimizer", on_accelerator=True).bf16


@pytest.mark.parametrize("extra, world, needles", [
    (["--seq-length", "100"], 1, ["--seq-length 100 is not a multiple of --bdlm-block-size 8", "--seq-length 96"]),
    (["--seq-length", "32", "--context-block-parallel", "8"], 8,
     ["--seq-length 32 has 4 blocks", "--context-block-parallel 8", ">= 64"]),
    (["--context-block-parallel", "2"], 3, ["--context-block-parallel 2", "does not divide the world size 3"]),
    (["--tensor-model-parallel-size", "2", "--context-block-parallel", "2"], 6, ["= 4 does not divide the world size 6"]),
    (["--context-block-parallel", "4", "--context-block-parallel-clean-shards", "3"], 4,
     ["--context-block-parallel 4 is not a multiple of --context-block-parallel-clean-shards 3"]),
    (["--tensor-model-parallel-size", "3"], 3, ["--tensor-model-parallel-size 3 does not divide --num-attention-heads 4"]),
    (["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
      "--tensor-model-parallel-size", "4"], 4, ["does not divide --num-query-groups 2"]),
    (["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "3"], 1,
     ["--num-attention-heads 8 is not a multiple of --num-query-groups 3"]),
    (["--micro-batch-size", "2", "--global-batch-size", "5"], 1,
     ["--global-batch-size 5 is not a multiple of --micro-batch-size 2 x data-parallel size 1"]),
    (["--micro-batch-size", "2", "--global-batch-size", "6"], 2, ["use a multiple of 4"]),
    (["--bdlm-noise-range", "0", "0.5"], 1, ["--bdlm-noise-range 0.0 0.5", "0 < T_MIN <= T_MAX <= 1"]),
    (["--bdlm-noise-range", "0.6", "0.2"], 1, ["--bdlm-noise-range 0.6 0.2"]),
    (["--bdlm-noise-range", "0.1", "1.5"], 1, ["--bdlm-noise-range 0.1 1.5"]),
    (["--seq-length", "18", "--bdlm-block-size", "3", "--context-block-parallel", "2"], 2,
     ["cannot be cut into 4 equal clean chunks", "--csbp-clean-layout zigzag", "multiple of 4"]),
    (["--seq-length", "48", "--bdlm-block-size", "16", "--context-block-parallel", "2", "--bdlm-parallel-mode", "cp"], 2,
     ["--bdlm-parallel-mode cp", "multiple of 32"]),
    (["--context-block-parallel", "2", "--context-block-parallel-clean-shards", "2", "--bdlm-parallel-mode", "bp"], 2,
     ["--bdlm-parallel-mode bp", "clean-shards 2"]),
    (["--context-block-parallel", "4", "--context-parallel-size", "2"], 4,
     ["--context-block-parallel 4 contradicts --context-parallel-size 2"]),
    (["--bf16"], 1, ["--bf16 needs a GPU", "drop --bf16"]),
    (["--fp16"], 1, ["--fp16 needs a GPU"]),
    (["--use-distributed-optimizer"], 1, ["--use-distributed-optimizer needs a GPU"]),
    (["--pipeline-model-parallel-size", "3"], 3, ["--pipeline-model-parallel-size 3 does not divide --num-layers 2"]),
    (["--max-position-embeddings", "32"], 1, ["--max-position-embeddings 32 is below --seq-length 64"]),
    (["--recompute-granularity", "full"], 1, ["--recompute-granularity full needs --recompute-method"]),
    (["--micro-batch-size", "0"], 1, ["--micro-batch-size must be >= 1"]),
    (["--lr-warmup-iters", "10"], 1, ["--lr-warmup-iters 10 must be below --lr-decay-iters 10"]),
    (["--tokenizer-type", "HuggingFaceTokenizer"], 1, ["needs --tokenizer-model"]),
])
def test_refusals_name_the_flag_and_the_fix(extra, world, needles):
    with pytest.raises(ConfigError) as caught:
        validate(*extra, world=world)
    message = str(caught.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


YARN = ["--position-embedding-type", "yarn", "--yarn-rotary-scaling-factor", "4",
        "--yarn-original-max-position-embeddings", "16"]


def test_yarn_flags_land_as_positions_and_refusals_are_one_line():
    """The YaRN flags make megatron-core's `yarn_*` fields (defaults 32, 1, 1, 0, rounded) and the query scaling
    YaRN's original length; each bad combination is one line naming the flag."""
    from megatron_csbp.core.positions import QueryScaling, RotaryPositions, YaRN

    assert RotaryPositions.from_args(validate()) == RotaryPositions()  # plain RoPE
    positions = RotaryPositions.from_args(validate(*YARN, "--llama-4-scaling-beta", "0.1", "--yarn-beta-fast", "8",
                                                   "--no-yarn-correction-range-round-to-int"))
    assert positions == RotaryPositions(YaRN(4.0, 16, beta_fast=8.0, correction_range_round_to_int=False),
                                        QueryScaling(0.1, 16))
    assert positions.yarn.config_fields() == {
        "yarn_rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 16, "yarn_beta_fast": 8.0,
        "yarn_beta_slow": 1.0, "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0,
        "yarn_correction_range_round_to_int": False}
    assert positions.embedding_type == "yarn" and RotaryPositions.from_args(parse(*positions_flags(positions))) \
        == positions  # its flags give it back
    for extra, line in (
            (YARN[:2], "--position-embedding-type yarn needs --yarn-rotary-scaling-factor F (how many times its "
                       "original context the model extends to, e.g. 4)"),
            (YARN[:4], "--position-embedding-type yarn needs --yarn-original-max-position-embeddings N (the context "
                       "the model was trained at before YaRN)"),
            (["--yarn-beta-fast", "8"], "--yarn-beta-fast is a YaRN setting, but --position-embedding-type is rope: "
                                        "give --position-embedding-type yarn, or drop --yarn-beta-fast"),
            (["--no-yarn-correction-range-round-to-int"], "--no-yarn-correction-range-round-to-int is a YaRN setting"),
            (["--llama-4-scaling-beta", "0.1"],
             "--llama-4-scaling-beta scales the queries past YaRN's original length (--yarn-original-max-position-"
             "embeddings), but --position-embedding-type is rope: give --position-embedding-type yarn, or drop "
             "--llama-4-scaling-beta"),
            (YARN + ["--llama-4-scaling-beta", "-0.1"],
             "--llama-4-scaling-beta must be a finite number >= 0; got -0.1"),
            (YARN + ["--yarn-beta-slow", "0"], "--yarn-beta-slow must be a finite number > 0; got 0.0"),
            (YARN + ["--yarn-beta-slow", "64"], "--yarn-beta-fast 32.0 is below --yarn-beta-slow 64.0"),
            (YARN + ["--yarn-mscale", "-1"], "--yarn-mscale must be a finite number >= 0; got -1.0"),
            (YARN + ["--yarn-mscale-all-dim", "inf"], "--yarn-mscale-all-dim must be a finite number >= 0; got inf"),
            (YARN[:3] + ["0.5"] + YARN[4:], "--yarn-rotary-scaling-factor must be a finite number >= 1; got 0.5"),
            (YARN[:5] + ["0"], "--yarn-original-max-position-embeddings must be an integer >= 1; got 0"),
            (YARN + ["--use-rope-scaling"], "--use-rope-scaling (Llama 3's frequency scaling) and "
                                            "--position-embedding-type yarn would scale the same frequencies twice"),
            (YARN + ["--rotary-percent", "0.5"], "--rotary-percent 0.5 with --position-embedding-type yarn"),
    ):
        with pytest.raises(ConfigError) as caught:
            validate(*extra)
        assert str(caught.value).startswith(line) and "\n" not in str(caught.value), (extra, str(caught.value))


def positions_flags(positions) -> list[str]:
    """`RotaryPositions.flags()` as command-line words."""
    words = []
    for key, value in positions.flags().items():
        words += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return words


def test_bf16_and_fp16_are_exclusive_even_on_a_gpu():
    with pytest.raises(ConfigError, match="--bf16 and --fp16 are exclusive"):
        validate("--bf16", "--fp16", on_accelerator=True)


def test_required_flags():
    args = build_parser().parse_args(["--num-layers", "2"])
    with pytest.raises(ConfigError, match="--hidden-size is required"):
        validate_args(args, 1, on_accelerator=False, check_paths=False)
    with pytest.raises(ConfigError, match="--data-path is required"):
        validate_args(build_parser().parse_args(BASE[:-4] + ["--bdlm-block-size", "8"]), 1, check_paths=False)


@pytest.mark.parametrize("flag, value", [("--bdlm-objective", "bd4lm"), ("--bdlm-loss-weighting", "sqrt"),
                                         ("--bdlm-parallel-mode", "ring"), ("--csbp-transport", "p2p")])
def test_unknown_choices_are_refused_by_argparse(flag, value, capsys):
    with pytest.raises(SystemExit):
        parse(flag, value)
    error = capsys.readouterr().err
    assert flag in error and f"invalid choice: '{value}'" in error


def test_data_path_weights_and_files(tmp_path):
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ConfigError, match="weighted datasets come in pairs"):
        parse_data_path(["0.3", "a", "0.7"])
    with pytest.raises(ConfigError, match="w1 prefix1 w2 prefix2"):
        parse_data_path(["a", "b"])
    prefix = str(tmp_path / "corpus")
    with pytest.raises(ConfigError, match=f"--data-path {prefix}: no {prefix}.bin"):
        validate("--data-path", prefix, check_paths=True)
    (tmp_path / "corpus.bin").write_bytes(b"\0\0")
    with pytest.raises(ConfigError, match=r"corpus.bin has no .*corpus.idx beside it"):
        validate("--data-path", prefix, check_paths=True)
    with pytest.raises(ConfigError, match="without the extension"):
        validate("--data-path", prefix + ".bin", check_paths=True)
    (tmp_path / "corpus.idx").write_bytes(b"")
    assert validate("--data-path", prefix, check_paths=True).data_prefixes == [prefix]
    with pytest.raises(ConfigError, match="--tokenizer-model .*: no such file"):
        validate("--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                 str(tmp_path / "tokenizer.json"), check_paths=True)


def test_config_error_is_one_line_and_an_ordinary_value_error():
    """A library call refuses with an ordinary `ValueError` (a `SystemExit` would end its caller); the entries
    print it as one line, exit 2 (tests/test_refusals.py)."""
    with pytest.raises(ValueError) as caught:
        validate_args(build_parser().parse_args(BASE + ["--seq-length", "100"]), 1, check_paths=False)
    assert isinstance(caught.value, ConfigError) and not isinstance(caught.value, SystemExit)
    assert str(caught.value).splitlines() == [
        "--seq-length 100 is not a multiple of --bdlm-block-size 8; use --seq-length 96 or a block size dividing 100"]


def test_simulated_link_flags():
    args = validate("--link-gbps", "2.5", "--link-latency-us", "20")
    assert (args.link_gbps, args.link_latency_us) == (2.5, 20.0)
    assert validate().link_gbps is None
    with pytest.raises(ConfigError, match="--link-gbps"):
        validate("--link-gbps", "0")


MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall")


def test_moe_flags_map_to_megatron_core_and_refusals():
    """The MoE flags land in megatron-core's TransformerConfig fields as Megatron-LM maps them (defaults filled as it
    fills them), and every MoE refusal is one line naming the flag, before any work."""
    from megatron_csbp.training.megatron_config import transformer_config_kwargs

    args = validate(*MOE, "--moe-layer-freq", "([0]+[1])*1", "--num-layers", "2", "--moe-aux-loss-coeff", "1e-2",
                    "--disable-bias-linear",
                    "--moe-shared-expert-intermediate-size", "32", "--expert-model-parallel-size", "2",
                    "--context-block-parallel", "2", world=4)
    kwargs = transformer_config_kwargs(args)
    assert (kwargs["num_moe_experts"], kwargs["moe_router_topk"], kwargs["moe_layer_freq"]) == (4, 2, [0, 1])
    assert kwargs["moe_ffn_hidden_size"] == args.ffn_hidden_size == 256  # Megatron-LM's default: --ffn-hidden-size
    assert (kwargs["moe_aux_loss_coeff"], kwargs["moe_router_load_balancing_type"]) == (1e-2, "aux_loss")
    assert (kwargs["expert_model_parallel_size"], kwargs["expert_tensor_parallel_size"]) == (2, 1)
    assert (kwargs["moe_token_dispatcher_type"], kwargs["moe_shared_expert_intermediate_size"]) == ("alltoall", 32)
    settings = RunConfig.from_args(args)
    assert (settings.shape.moe.num_experts, settings.expert_parallel_size, settings.expert_tensor_parallel_size) == (4, 2, 1)
    assert "num_moe_experts" not in transformer_config_kwargs(validate())  # dense: no MoE fields at all
    assert kwargs["moe_router_pre_softmax"] is False
    pre_softmax = transformer_config_kwargs(validate(*MOE[:2], "--moe-router-topk", "1", "--moe-router-pre-softmax"))
    assert (pre_softmax["moe_router_topk"], pre_softmax["moe_router_pre_softmax"]) == (1, True)

    refusals = [
        ((*MOE, "--expert-model-parallel-size", "3"), 3, "--expert-model-parallel-size 3 does not divide --num-experts 4"),
        ((*MOE, "--expert-model-parallel-size", "4", "--context-block-parallel", "2"), 2,
         "--expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 x --pipeline-model-parallel-size 1 = 4 "
         "does not divide the world size 2"),
        (("--expert-model-parallel-size", "2"), 2, "--expert-model-parallel-size 2 needs experts"),
        ((*MOE, "--moe-router-topk", "5"), 1, "--moe-router-topk 5 must be in"),
        ((*MOE, "--moe-router-topk", "1"), 1, "--moe-router-topk 1 with a softmax over the top k"),
        ((*MOE, "--moe-router-load-balancing-type", "seq_aux_loss"), 1, "--moe-router-load-balancing-type seq_aux_loss"),
        ((*MOE[:4], "--moe-token-dispatcher-type", "allgather", "--pipeline-model-parallel-size", "2"), 2,
         "--moe-token-dispatcher-type allgather cannot"),
        ((*MOE, "--moe-token-dispatcher-type", "flex"), 1, "--moe-token-dispatcher-type 'flex'"),
        ((*MOE, "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"), 4, "needs --sequence-parallel"),
        ((*MOE, "--moe-grouped-gemm"), 1, "--moe-grouped-gemm needs Transformer Engine"),
        ((*MOE, "--moe-shared-expert-intermediate-size", "32"), 1, "shared expert has no biases; add --disable-bias"),
        ((*MOE, "--moe-layer-freq", "[0,1,1]"), 1, "--moe-layer-freq [0, 1, 1] names 3 layers, but --num-layers is 2"),
    ]
    import importlib.util
    for extra, world, needle in refusals:
        if needle.startswith("--moe-grouped-gemm") and importlib.util.find_spec("transformer_engine"):
            continue  # honoured where Transformer Engine is installed
        with pytest.raises(ConfigError) as raised:
            validate(*extra, world=world)
        assert needle in str(raised.value) and "\n" not in str(raised.value), (extra, str(raised.value))
    for flag in ("--moe-expert-capacity-factor", "--moe-z-loss-coeff"):  # not ours: refused by name, one line
        with pytest.raises(ConfigError, match=flag):
            parse(*MOE, flag, "1.0")


# Texts Megatron-LM's `moe_freq_type` would evaluate, each with the value Python gives it.
LAYER_PATTERNS = ["2", " 3 ", "[1,0,1]", "([1]*3+[0]*1)*3", "[1]*2**3", "2*[0]+[1]", "[]", "[1,]", "[ 1 , 0 ]",
                  "[(1)]", "[1*1,0+0]", "[1]*(2+2)*2", "[0]*0+[1]", "(([1]))", "[1]*2**2**2", "[0]+[1]*23",
                  f"[1]*{MAX_LAYERS}", f"{MAX_LAYERS}*[0]", "[0]*50+[1]*50"]
# (text, why it is refused): malformed, not a 0/1 pattern, or bigger than any model (checked before it is built).
BAD_LAYER_PATTERNS = [
    ("[1,0", "the '[' at character 1 is not closed: the end where ']' should be"),
    ("[1]*10**12", "it builds the number 1000000000000, more than 10000"),
    ("[1]*1000000000000", "the number 1000000000000 exceeds 10000"),
    ("[1]*" + "9" * 5000, "the number 99999999999999999999... exceeds 10000"),
    ("[1]*9999*9999", "it builds a list of 99980001 layers, more than 10000"),
    ("[0,1]*5001", "it builds a list of 10002 layers, more than 10000"),
    ("[1]*2**100000", "the number 100000 exceeds 10000"),
    ("[1]*9**9**9", "it builds the number 387420489, more than 10000"),
    ("[1]*2**20", "2**20 exceeds 10000"),
    ("(" * 1000 + "[1]" + ")" * 1000, "brackets or powers are nested more than 32 deep"),
    ("[" * 1000 + "1" + "]" * 1000, "brackets or powers are nested more than 32 deep"),
    ("[1]*2" + "**2" * 1000, "brackets or powers are nested more than 32 deep"),
    ("abc", "not an integer, and no list"),
    ("1.5", "not an integer, and no list"),
    ("", "not an integer, and no list"),
    ("__import__('os').system('true')", "not an integer, and no list"),
    ("[__import__('os')]", "'_' at character 2 is not part of a pattern (digits , [ ] ( ) + *)"),
    ("[1]*1e3", "'e' at character 6 is not part of a pattern (digits , [ ] ( ) + *)"),
    ("[2,0]", "layer 0 is 2; each layer is 0 (dense) or 1 (MoE)"),
    ("[1,0,5]", "layer 2 is 5; each layer is 0 (dense) or 1 (MoE)"),
    ("(1,0)", "not an integer, and no list"),
    ("[(1,0)]", "the '(' at character 2 is not closed: ',' at character 4 where ')' should be"),
    ("[[1]]", "the list at character 1 holds a list; it holds one 0 or 1 per layer"),
    ("[1]+2", "'+' joins two lists or adds two numbers, not a list and a number"),
    ("[1]*[1]", "'*' repeats a list a number of times; two lists cannot be multiplied"),
    ("[1]**2", "'**' raises a number to a power, not a list"),
    ("[01]", "the number 01 has a leading zero (Python refuses it)"),
    ("[1]]", "']' at character 4 follows a whole expression"),
    ("[1][0]", "'[' at character 4 follows a whole expression"),
    ("[,]", "expected a number, '[' or '(', found ',' at character 2"),
    ("[", "expected a number, '[' or '(', found the end"),
    ("[1]*(2", "the '(' at character 5 is not closed: the end where ')' should be"),
]


def test_moe_layer_freq_is_parsed_as_python_reads_it_without_running_it():
    """The grammar gives every pattern Megatron-LM's type evaluates the value Python gives it (the texts are
    this test's own), and refuses the rest in one line naming the flag: at once, however large the pattern."""
    import time

    from megatron_csbp.training import layer_pattern
    from megatron_csbp.training.flags import moe_layer_freq

    for text in LAYER_PATTERNS:
        value = layer_pattern.parse(text)
        assert value == eval(text) and moe_layer_freq(text) == value, text  # noqa: S307 - the test's own literals
        assert layer_pattern.parse(layer_pattern.canonical(value)) == value and " " not in layer_pattern.canonical(
            value), text
    assert layer_pattern.parse(3) == 3 and layer_pattern.canonical([0, 1]) == "[0,1]"
    for text, why in BAD_LAYER_PATTERNS:
        started = time.monotonic()
        with pytest.raises(ConfigError) as refused:
            layer_pattern.parse(text, "--moe-layer-freq")
        shown = text if len(text) <= 60 else text[:57] + "..."
        assert str(refused.value) == f"--moe-layer-freq {shown!r}: {why}; {layer_pattern.HINT}", shown
        assert time.monotonic() - started < 0.5, shown
        with pytest.raises(argparse.ArgumentTypeError, match="^--moe-layer-freq "):  # argparse shows it as it is
            moe_layer_freq(text)
