"""The flag table without Megatron-LM: our loop's flags are the plugin's honoured ones, every honoured flag names
a test that exists, and our loop takes, warns about or refuses Megatron-LM's other flags as the table says."""

import os
import re

import pytest

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.training import flag_table
from megatron_csbp.training.arguments import validate_args
from megatron_csbp.training.flags import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--data-path", "unused/prefix",
        "--bdlm-block-size", "8"]


def _ours(*extra):
    return validate_args(build_parser().parse_args(BASE + list(extra)), 1, on_accelerator=False, check_paths=False)


def test_our_loops_flags_are_exactly_the_plugins_honoured_flags():
    """Both loops take the flags our model, spec, data and forward step implement: each is in our loop's parser,
    and our loop's parser has nothing else (beyond its own extensions, which Megatron-LM's parser refuses)."""
    ours = set(flag_table.parser_flags(build_parser()))
    plugin = {flag for flag, entry in flag_table.TABLE.items()
              if isinstance(entry, flag_table.Honoured) and entry.by == flag_table.PLUGIN}
    assert ours - set(flag_table.OUR_LOOP_ONLY) == plugin, (sorted(plugin - ours), sorted(ours - plugin))
    assert not set(flag_table.OUR_LOOP_ONLY) & set(flag_table.TABLE)


# The test that shows each flag the plugin honours (`flag_table.Honoured`, by the plugin) doing what it says:
# the evidence the table's classification rests on, kept with the tests.
SHOWN_BY = {
    "tests/test_data.py::test_byte_tokenizer_and_padded_vocabulary":
        "--make-vocab-size-divisible-by",
    "tests/test_flag_table_megatron_lm.py::test_architecture_flags_build_megatron_lms_state_dict":
        "--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --kv-channels "
        "--group-query-attention --num-query-groups --normalization --norm-epsilon --swiglu "
        "--disable-bias-linear --add-qkv-bias --qk-layernorm --untie-embeddings-and-output-weights "
        "--max-position-embeddings --rotary-base --rotary-percent --use-rope-scaling --rope-scaling-factor "
        "--init-method-std --hidden-dropout --transformer-impl --use-rotary-position-embeddings "
        "--no-position-embedding --rotary-seq-len-interpolation-factor",
    "tests/test_megatron_lm.py::test_the_plugins_refusals_fire_under_megatron_lm":
        "--position-embedding-type --attention-dropout",
    "tests/test_spec_model.py::test_a_given_layer_spec_is_honoured_with_csbp_core_attention":
        "--spec",
    "tests/test_megatron_lm.py::test_both_loops_print_the_same_losses_and_grad_norms":
        "--seq-length --micro-batch-size --global-batch-size --train-iters --lr --min-lr --lr-decay-style "
        "--lr-decay-iters --lr-warmup-iters --lr-warmup-fraction --lr-wsd-decay-style --lr-wsd-decay-iters "
        "--weight-decay --clip-grad --adam-beta1 --adam-beta2 --adam-eps --seed --eval-iters --eval-interval "
        "--split --data-path --num-workers --tensor-model-parallel-size --pipeline-model-parallel-size "
        "--context-parallel-size --sequence-parallel --calculate-per-token-loss --distributed-timeout-minutes "
        "--log-interval --optimizer --reset-position-ids --reset-attention-mask --eod-mask-loss",
    "tests/test_training.py::test_every_layout_logs_the_same_losses":
        "--use-cpu-initialization",
    "tests/test_arguments.py::test_bf16_and_fp16_are_exclusive_even_on_a_gpu":
        "--bf16 --fp16 --use-distributed-optimizer",
    "tests/test_recompute.py::test_recompute_equals_no_recompute_and_sends_the_forward_twice":
        "--recompute-granularity --recompute-method --recompute-num-layers",
    "tests/test_recompute.py::test_recompute_modules_equal_no_recompute_and_rerun_the_named_modules":
        "--recompute-modules --moe-layer-recompute",
    "tests/test_recompute.py::test_recompute_flags_reach_the_config_as_megatron_lm_resolves_them":
        "--recompute-activations",
    "tests/test_ddp_overlap.py::test_overlapped_reductions_and_gathers_give_the_plain_step":
        "--overlap-grad-reduce --overlap-param-gather",
    "tests/test_megatron_lm.py::test_a_hugging_face_tokenizer_gives_the_same_numbers_in_both_loops":
        "--tokenizer-type --tokenizer-model --vocab-size",
    "tests/test_data.py::test_gpt_dataset_samples_are_clean_sequences_of_length_L":
        "--data-cache-path",
    "tests/test_megatron_lm.py::test_a_checkpoint_of_either_loop_resumes_in_the_other":
        "--save --load --save-interval --finetune --no-load-optim --no-load-rng --ckpt-format",
    "tests/test_checkpointing.py::test_damaged_or_mismatched_checkpoints_and_exit_conditions":
        "--exit-on-missing-checkpoint --exit-interval --exit-duration-in-mins",
    "tests/test_reliability.py::test_a_stop_signal_saves_at_the_next_iteration_and_the_requeued_run_matches":
        "--exit-signal-handler",
    "tests/test_training.py::test_log_lines_memory_and_tensorboard":
        "--tensorboard-dir",
    "tests/test_arguments.py::test_plugin_flags_land_with_their_types":
        "--context-block-parallel --context-block-parallel-clean-shards --bdlm-block-size --bdlm-objective "
        "--bdlm-loss-weighting --bdlm-noise-range --bdlm-noise-sampling --bdlm-parallel-mode --csbp-transport "
        "--link-gbps --link-latency-us --csbp-block-schedule --csbp-clean-layout --bdlm-mask-token-id "
        "--max-consecutive-bad-steps --config --training-loop",
    "tests/test_clean_stream.py::test_token_causal_attention_matches_the_dense_mask_and_the_block_causal_one_misses":
        "--bdlm-clean-attention",
    "tests/test_clean_stream_training.py::test_world_4_token_causal_ar_step_equals_one_rank":
        "--bdlm-diffusion-loss-weight --bdlm-ar-loss-weight",
    "tests/test_megatron_lm.py::test_sliding_windows_train_alike_in_both_loops":
        "--window-size --window-attn-skip-freq",
    "tests/test_moe.py::test_world_2_moe_compositions_and_negative_control":
        "--num-experts --moe-layer-freq --moe-ffn-hidden-size --moe-shared-expert-intermediate-size "
        "--moe-router-topk --moe-router-score-function --moe-router-dtype --moe-router-load-balancing-type "
        "--moe-aux-loss-coeff --moe-token-dispatcher-type --expert-model-parallel-size "
        "--expert-tensor-parallel-size",
    "tests/test_arguments.py::test_moe_flags_map_to_megatron_core_and_refusals":
        "--moe-grouped-gemm",
    "tests/test_hf_moe.py::test_logits_equal_huggingface":
        "--moe-router-pre-softmax",
    "tests/test_hf.py::test_logits_equal_huggingface":
        "--yarn-rotary-scaling-factor --yarn-original-max-position-embeddings --yarn-beta-fast --yarn-beta-slow "
        "--yarn-mscale --yarn-mscale-all-dim --no-yarn-correction-range-round-to-int --llama-4-scaling-beta",
    "tests/test_gated_delta_training.py::test_the_flags_reach_the_run_and_the_models_config":
        "--experimental-attention-variant --linear-attention-freq --linear-conv-kernel-dim --linear-key-head-dim "
        "--linear-value-head-dim --linear-num-key-heads --linear-num-value-heads --attention-output-gate "
        "--apply-layernorm-1p",
    "tests/test_diffusion_gemma.py::test_the_trainer_refuses_in_one_line_exit_2":
        "--bdlm-self-conditioning-probability --final-logit-softcapping --scale-embeddings",
    "tests/test_gemma4_moe.py::test_the_flag_refuses_in_one_line_exit_2_and_reaches_the_model_config":
        "--gemma4-moe",
    "tests/test_gemma4_attention.py::test_the_flags_refuse_in_one_line_exit_2_and_reach_the_model_config":
        "--gemma4-attention --global-kv-channels --global-num-query-groups --global-rotary-base "
        "--global-rotary-percent",
    "tests/test_linear_cross_entropy.py::test_the_fusion_flags_train_and_validate_as_the_whole_head":
        "--cross-entropy-loss-fusion --cross-entropy-fusion-impl --cross-entropy-tile-rows",
}


def test_every_flag_the_plugin_honours_is_shown_by_a_test_that_exists():
    shown = [flag for flags in SHOWN_BY.values() for flag in flags.split()]
    plugin = [flag for flag, entry in flag_table.TABLE.items()
              if isinstance(entry, flag_table.Honoured) and entry.by == flag_table.PLUGIN]
    assert sorted(shown) == sorted(plugin) and len(set(shown)) == len(shown), (
        sorted(set(plugin) - set(shown)), sorted(set(shown) - set(plugin)))
    for test in SHOWN_BY:
        path, _, name = test.partition("::")
        with open(os.path.join(REPO, path), encoding="utf-8") as handle:
            assert re.search(rf"^def {re.escape(name)}\(", handle.read(), re.M), f"no {test}"
    assert len(plugin) == flag_table.counts()["honoured by the plugin"] > 50


def test_counts_per_class_cover_the_table():
    counts = flag_table.counts()
    assert sum(counts[kind] for kind in flag_table.KINDS) == len(flag_table.TABLE)
    assert counts["honoured"] == counts["honoured by the plugin"] + counts["honoured by Megatron-LM's loop"]
    assert all(counts[kind] > 0 for kind in flag_table.KINDS)
    assert flag_table.summary().startswith(f"honoured: {counts['honoured']}, neutral: {counts['neutral']}")


def test_a_refusal_reads_flag_value_what_and_instead():
    entry = flag_table.entry("--moe-expert-capacity-factor")
    assert flag_table.refusal("--moe-expert-capacity-factor", 1.0, entry).startswith(
        "--moe-expert-capacity-factor 1.0: token dropping keeps each expert's first tokens in the rank's row order, "
        "which CSBP's [noisy ; clean] rows change, so no layout would train like another; drop it (supported MoE "
        "options: --num-experts")
    assert flag_table.refusal("--sft", None, flag_table.entry("--sft")).startswith(
        "--sft: selects data the plugin's datasets provider does not build")
    assert flag_table.entry("--a-flag-megatron-lm-may-add-later") is flag_table.UNCLASSIFIED


@pytest.mark.parametrize("extra, message", [
    (["--num-experts", "4", "--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor: token dropping"),
    (["--sft"], "--sft: selects data the plugin's datasets provider does not build"),
    (["--trust-remote-code"], "--trust-remote-code: would run code"),
    (["--cp-comm-type", "a2a"], "--cp-comm-type selects a ring-CP transport"),  # rules.RING_CP_REFUSALS' line
    (["--lr-warmup-init", "0.1"], "--lr-warmup-init is taken under --training-loop megatron-lm only"),
])
def test_our_loop_refuses_what_it_does_not_take_in_one_line(extra, message):
    with pytest.raises(ConfigError) as refused:
        _ours(*extra)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), refused.value


def test_our_loop_refuses_a_yaml_key_the_table_refuses(tmp_path):
    from megatron_csbp.training.config import parse_args

    config = tmp_path / "moe.yaml"
    config.write_text("num-experts: 4\nmoe-z-loss-coeff: 0.001\n")
    with pytest.raises(ConfigError, match=r"^--moe-z-loss-coeff: is a mixture-of-experts option not supported"):
        parse_args(["--config", str(config), *BASE])


def test_our_loop_takes_a_neutral_flag_saying_so(capsys):
    args = _ours("--log-throughput", "--timing-log-level", "2")
    assert not hasattr(args, "log_throughput") and not hasattr(args, "timing_log_level")
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and warnings[0].startswith("WARNING: --log-throughput: logging"), warnings


@pytest.mark.parametrize("extra, message", [
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1; got 0"),
    (["--hidden-size", "66"], "--hidden-size 66 is not a multiple of --num-attention-heads 4; set --kv-channels"),
    (["--lr-warmup-fraction", "2"], "--lr-warmup-fraction 2.0 must be in [0, 1)"),
    (["--log-interval", "0"], "--log-interval must be >= 1; got 0"),
])
def test_bad_values_megatron_lm_asserts_on_are_refused_by_our_loop(extra, message):
    with pytest.raises(ConfigError) as refused:
        _ours(*extra)
    assert str(refused.value).startswith(message), refused.value


def test_megatron_lms_older_spellings_are_taken_with_its_meanings():
    """As Megatron-LM's `validate_args` reads them: --use-rotary-position-embeddings makes the position type rope
    (whatever --position-embedding-type says), --no-position-embedding is nothing beside rope (refused with another
    type), --recompute-activations is --recompute-granularity selective, and --rotary-seq-len-interpolation-factor 1
    is no interpolation (other factors are refused)."""
    args = _ours("--position-embedding-type", "learned_absolute", "--use-rotary-position-embeddings",
                 "--no-position-embedding", "--recompute-activations", "--rotary-seq-len-interpolation-factor", "1")
    assert (args.position_embedding_type, args.add_position_embedding, args.recompute_granularity) == (
        "rope", False, "selective")
    assert _ours().position_embedding_type == "rope" and _ours().recompute_granularity is None  # the controls
    for extra, line in (
            (["--position-embedding-type", "learned_absolute", "--no-position-embedding"],
             "--position-embedding-type learned_absolute: BDLM needs rope"),
            (["--position-embedding-type", "none"], "--position-embedding-type none: BDLM needs rope"),
            (["--rotary-seq-len-interpolation-factor", "4"], "--rotary-seq-len-interpolation-factor 4: RoPE position "
                                                             "interpolation is not implemented for BDLM")):
        with pytest.raises(ConfigError) as refused:
            _ours(*extra)
        assert str(refused.value).startswith(line) and "\n" not in str(refused.value), refused.value
