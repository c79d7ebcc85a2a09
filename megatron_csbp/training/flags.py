"""The trainer's flags: the plugin's (`add_csbp_args`, also Megatron-LM's `extra_args_provider`) and, with
Megatron-LM's names, defaults and meanings, the subset of Megatron-LM's flags our own loop supports
(`build_parser`; Megatron-LM's parser is not installable from PyPI). They are checked in `arguments`.

`--seq-length` is the clean context length `L` ("256K context"). The model sees `2L` rows, `[x_t ; x_0]`;
each block-parallel rank holds `|owned noisy rows| + L/C` of them (`2L/P` when `P == C`), which is the
sequence dimension pipeline stages exchange, where Megatron would use `seq_length / cp`.
"""

import argparse

from megatron_csbp.core import clean_attention, modes, objectives, positions, rules, schedule, transports
from megatron_csbp.core.rules import BYTE_TOKENIZER, PARALLEL_MODES, TOKENIZERS, ConfigError
from megatron_csbp.training import layer_pattern
from megatron_csbp.data.datasets import MEGATRON_SPLIT_DEFAULT

TRAINING_LOOPS = ("auto", "megatron-lm", "megatron-core")
# --eval-interval when not given, in both loops (Megatron-LM's own None fails counting its validation samples).
EVAL_INTERVAL = 1000
TRANSFORMER_IMPLS = ("local", "transformer_engine")
# Megatron-LM's position types: only rope is taken (validation refuses the others with the reason).
# Megatron-LM's position types (its parser's choices), and YaRN's (ours: megatron-core builds it)
POSITION_EMBEDDING_TYPES = ("learned_absolute", positions.ROPE, "mrope", "relative", "none", positions.YARN)


class _ContextBlockParallel(argparse.Action):
    """`--context-block-parallel N` also fills Megatron's CP slot, where the block-parallel dimension lives."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, value)
        namespace.context_parallel_size = value


def _has_flag(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions


def add_csbp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The plugin's flags; usable as Megatron-LM's `extra_args_provider` (flags Megatron has are reused)."""
    group = parser.add_argument_group(title="context-block parallel / BDLM")
    group.add_argument("--context-block-parallel", type=int, default=None, action=_ContextBlockParallel,
                       metavar="P", help="Block-parallel size P: ranks that share the noisy blocks of one sample. "
                                         "Occupies Megatron's context-parallel slot (sets --context-parallel-size).")
    group.add_argument("--context-block-parallel-clean-shards", type=int, default=None, metavar="C",
                       help="Ranks the clean sequence is sharded over (a ring); divides P. Default: P.")
    group.add_argument("--bdlm-block-size", type=int, default=16, metavar="B", help="Diffusion block size B.")
    group.add_argument("--bdlm-objective", choices=rules.OBJECTIVES, default=objectives.BD3LM.name,
                       help="BD3-LM NELBO, Fast-dLLM v2 (complementary masks, shifted labels, unit weights), or "
                            "DiffusionGemma (uniform-state corruption, every canvas token scored, self-conditioning).")
    group.add_argument("--bdlm-clean-attention", choices=clean_attention.CLEAN_ATTENTIONS,
                       default=clean_attention.BLOCK_CAUSAL.name,
                       help="What a clean row sees of the clean copy: its own block whole (block-causal, BD3-LM's) "
                            "or the tokens up to its own (token-causal, an autoregressive clean stream, "
                            "Nemotron-Labs-Diffusion's).")
    group.add_argument("--bdlm-diffusion-loss-weight", type=float, default=1.0, metavar="W",
                       help="Weight of the diffusion loss (the noisy rows').")
    group.add_argument("--bdlm-ar-loss-weight", type=float, default=0.0, metavar="W",
                       help="Weight of an autoregressive co-loss: the clean rows predict the next token (needs "
                            "--bdlm-clean-attention token-causal; 0: off). The loss is the weighted sum of both "
                            "parts over the tokens of both (Megatron-Bridge's); each part is logged on its own.")
    group.add_argument("--bdlm-self-conditioning-probability", type=float, default=None, metavar="P",
                       help="Chance a sample is self-conditioned (a first, detached pass whose predicted "
                            "distribution the canvas then takes; DiffusionGemma's). Default: 0.5 for "
                            "diffusion-gemma, 0 (off) for the others.")
    group.add_argument("--final-logit-softcapping", type=float, default=None, metavar="CAP",
                       help="Cap the LM head's logits as CAP * tanh(logits / CAP) (Gemma's; 30 in DiffusionGemma). "
                            "Default: off.")
    group.add_argument("--scale-embeddings", action="store_true",
                       help="Multiply the input embeddings by sqrt(--hidden-size), as Gemma does.")
    group.add_argument("--gemma4-moe", action="store_true",
                       help="Gemma 4's MoE block in every layer (DiffusionGemma's): a dense MLP of "
                            "--moe-shared-expert-intermediate-size beside the routed experts, each branch between its "
                            "own RMSNorms, the router normalising and scaling its input, a learned per-expert scale "
                            "on the top-k weights; gated GELU-tanh MLPs.")
    group.add_argument("--gemma4-attention", action="store_true",
                       help="Gemma 4's attention (DiffusionGemma's): query, key and weightless value norms, softmax "
                            "scale 1, a norm of the attention's output before the residual, a fixed per-layer output "
                            "scalar; global layers (those without a window) with their own head size and K/V heads, "
                            "the key doubling as the value, and proportional RoPE.")
    group.add_argument("--global-kv-channels", type=int, default=None, metavar="D",
                       help="With --gemma4-attention: the global layers' head size. Default: --kv-channels.")
    group.add_argument("--global-num-query-groups", type=int, default=None, metavar="G",
                       help="With --gemma4-attention: the global layers' K/V heads. Default: --num-query-groups.")
    group.add_argument("--global-rotary-base", type=float, default=1_000_000.0, metavar="BASE",
                       help="With --gemma4-attention: the global layers' RoPE base.")
    group.add_argument("--global-rotary-percent", type=float, default=0.25, metavar="FRACTION",
                       help="With --gemma4-attention: the share of a global head's frequencies that rotate "
                            "(proportional RoPE: at the whole head's frequencies, the rest unrotated).")
    group.add_argument("--bdlm-loss-weighting", choices=rules.LOSS_WEIGHTINGS, default=None,
                       help="Per-block loss weight 1/t (the NELBO) or 1. Default: inverse-t for bd3lm, unit for "
                            "fast-dllm-v2.")
    group.add_argument("--bdlm-noise-range", type=float, nargs=2, default=[1e-3, 1.0], metavar=("T_MIN", "T_MAX"),
                       help="Noise times are drawn in [T_MIN, T_MAX], inside (0, 1].")
    group.add_argument("--bdlm-noise-sampling", choices=rules.NOISE_SAMPLINGS, default="antithetic",
                       help="Stratified noise times over the (sample, block) pairs of a batch, or i.i.d. uniform.")
    group.add_argument("--bdlm-parallel-mode", choices=PARALLEL_MODES, default=modes.CSBP.name,
                       help="csbp: context-sharded block parallelism; cp: conventional context parallelism over "
                            "[x_t ; x_0] as the field runs it, one masked attention call per rank (baseline); "
                            "cp-traffic: cp's rows and traffic computed with CSBP's kernels (an ablation of the "
                            "bytes); bp: pure block parallelism (C = 1, clean prefix replicated).")
    group.add_argument("--csbp-transport", choices=rules.TRANSPORTS, default=transports.COLLECTIVE.name,
                       help="All-gather the clean K/V (collective) or pass shards around the ring (bounded memory).")
    group.add_argument("--link-gbps", type=float, default=None, metavar="GBPS",
                       help="Simulate a link this slow for the attention collectives (comm.simulated_link).")
    group.add_argument("--link-latency-us", type=float, default=10.0, help="Latency of each simulated transfer.")
    group.add_argument("--csbp-block-schedule", choices=rules.SCHEDULES, default=schedule.DUAL_END.name,
                       help="How noisy blocks are dealt to ranks (contiguous is an ablation).")
    group.add_argument("--csbp-clean-layout", choices=rules.CLEAN_LAYOUTS, default=schedule.ZIGZAG.name,
                       help="How the clean sequence is sharded over a ring (contiguous is an ablation).")
    group.add_argument("--bdlm-mask-token-id", type=int, default=None, metavar="ID",
                       help="The MASK id: a new id right after the tokenizer's (the default), or an existing id "
                            "the data never uses (e.g. what scripts/convert_hf.py import chose).")
    group.add_argument("--cross-entropy-tile-rows", type=int, default=rules.CROSS_ENTROPY_TILE_ROWS, metavar="N",
                       help="With --cross-entropy-loss-fusion: rows per tile of the tiled linear cross-entropy (a "
                            "tile's logits are N x vocabulary / TP).")
    group.add_argument("--max-consecutive-bad-steps", type=int, default=3, metavar="N",
                       help="Steps with a NaN/Inf loss or grad norm are skipped; stop after N in a row.")
    group.add_argument("--config", type=str, default=None, metavar="FILE.yaml",
                       help="YAML of flag names; command-line key=value overrides and flags win over it.")
    group.add_argument("--training-loop", choices=TRAINING_LOOPS, default="auto",
                       help="megatron-lm: Megatron-LM's pretrain(); megatron-core: the plugin's own loop built from "
                            "megatron-core parts; auto: Megatron-LM's where megatron.training imports, else ours.")
    add_positions_args(parser)
    if not _has_flag(parser, "--distributed-timeout-minutes"):
        group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                           help="Timeout minutes for torch.distributed.")
    if _has_flag(parser, "--tokenizer-type") and BYTE_TOKENIZER not in parser._option_string_actions[
            "--tokenizer-type"].choices:
        parser._option_string_actions["--tokenizer-type"].choices.append(BYTE_TOKENIZER)  # see byte_tokenizer_as_null
    parser.set_defaults(**bdlm_defaults())
    return parser


def add_positions_args(parser: argparse.ArgumentParser) -> None:
    """YaRN and Llama 4's query scaling (`core.positions`): megatron-core's `TransformerConfig.yarn_*` fields, which
    Megatron-LM's parser (core_v0.16.1) has no flags for, and `--position-embedding-type yarn`, which its choices
    lack."""
    if _has_flag(parser, "--position-embedding-type"):
        choices = parser._option_string_actions["--position-embedding-type"].choices
        if positions.YARN not in choices:
            choices.append(positions.YARN)
    group = parser.add_argument_group(title="YaRN and Llama 4 query scaling (with --position-embedding-type yarn)")
    group.add_argument("--yarn-rotary-scaling-factor", type=float, default=None, metavar="F",
                       help="YaRN's factor: the context the model extends to, in multiples of "
                            "--yarn-original-max-position-embeddings (transformers' rope_parameters factor). Required.")
    group.add_argument("--yarn-original-max-position-embeddings", type=int, default=None, metavar="N",
                       help="The context the model was trained at before YaRN. Required.")
    group.add_argument("--yarn-beta-fast", type=float, default=None,
                       help="Channels turning more than this many times in the original context keep their "
                            "frequency. Default: 32.")
    group.add_argument("--yarn-beta-slow", type=float, default=None,
                       help="Channels turning fewer times are interpolated by the factor. Default: 1.")
    group.add_argument("--yarn-mscale", type=float, default=None,
                       help="cos and sin are multiplied by (0.1 mscale ln F + 1) / (0.1 mscale_all_dim ln F + 1). "
                            "Default: 1.")
    group.add_argument("--yarn-mscale-all-dim", type=float, default=None, help="Default: 0.")
    group.add_argument(positions.NO_ROUNDING, action="store_false", dest="yarn_correction_range_round_to_int",
                       help="Do not round the ramp's channel range to whole channels (transformers' truncate false).")
    group.add_argument("--llama-4-scaling-beta", type=float, default=None, metavar="BETA",
                       help="Llama 4's query scaling: the query at RoPE position p times 1 + BETA ln(1 + floor(p / "
                            "N)), N the YaRN original length (transformers' rope_parameters llama_4_scaling_beta). "
                            "Default: none.")


def bdlm_defaults() -> dict:
    """Defaults a BDLM run needs where Megatron-LM's differ, set on whichever parser takes the plugin's flags.

    Attention dropout is 0 (the CSBP kernel has none; Megatron-LM's 0.1 would be refused), positions are
    RoPE (a token's noisy and clean copy share one), the loss is per-token (the BDLM normaliser), and the
    transformer implementation is Transformer Engine where it is installed, else megatron-core's local one
    (and then without the RoPE fusion and the fused weight-gradient accumulation: Transformer Engine and
    apex CUDA kernels).
    """
    import importlib.util

    has_te = importlib.util.find_spec("transformer_engine") is not None
    has_apex_wgrad = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    return dict(attention_dropout=0.0, position_embedding_type="rope", calculate_per_token_loss=True,
                transformer_impl="transformer_engine" if has_te else "local",
                **({} if has_te else {"apply_rope_fusion": False}),
                **({} if has_te or has_apex_wgrad else {"gradient_accumulation_fusion": False}))


def null_as_byte_tokenizer(args: argparse.Namespace) -> argparse.Namespace:
    """The inverse of `byte_tokenizer_as_null`, for a checkpoint Megatron-LM saved: NullTokenizer over 256 ids
    reads back as the byte tokenizer (text in and out), which numbers exactly alike."""
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size == 256:
        args.tokenizer_type = BYTE_TOKENIZER
    return args


def byte_tokenizer_as_null(argv: list[str]) -> list[str]:
    """Megatron-LM has no byte tokenizer, but its NullTokenizer over 256 ids is ours exactly (ids 0..255 are
    the bytes, EOD is 256): under `pretrain()` the plugin's `--tokenizer-type ByteLevelTokenizer` becomes that,
    and so does no `--tokenizer-type` at all (the byte tokenizer is our loop's default: one command, both loops)."""
    argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--tokenizer-type=") else [arg])]
    if "--tokenizer-type" not in argv:
        argv += ["--tokenizer-type", BYTE_TOKENIZER]
    for index in range(len(argv) - 1):
        if argv[index] == "--tokenizer-type" and argv[index + 1] == BYTE_TOKENIZER:
            argv[index + 1] = "NullTokenizer"
            if "--vocab-size" not in argv:
                argv += ["--vocab-size", "256"]
    return argv


def _add_model_args(parser):
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-layers", type=int, default=None)
    group.add_argument("--hidden-size", type=int, default=None)
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="Default: 4 x hidden-size, or 2/3 of that rounded down to a multiple of 64 with --swiglu.")
    group.add_argument("--num-attention-heads", type=int, default=None)
    group.add_argument("--group-query-attention", action="store_true")
    group.add_argument("--num-query-groups", type=int, default=1)
    group.add_argument("--kv-channels", type=int, default=None, help="Default: hidden-size / num-attention-heads.")
    group.add_argument("--max-position-embeddings", type=int, default=None, help="Default: --seq-length.")
    group.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES, default="rope",
                       help="rope, or yarn (RoPE with YaRN's frequencies: the --yarn-* flags): a token's noisy and "
                            "clean copy share its position. (Megatron-LM's default, learned_absolute, and its other "
                            "types are refused.)")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="Megatron-LM's older spelling of --position-embedding-type rope (it wins over the type).")
    group.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                       help="Megatron-LM's older switch for no learned absolute positions: nothing to do beside "
                            "rope, which has none (refused with another type, as Megatron-LM refuses it).")
    group.add_argument("--window-size", type=window_size, default=None, metavar="LEFT,0",
                       help="Sliding-window attention: a token sees the LEFT positions before its own and itself "
                            "(transformers' sliding_window = LEFT + 1), a noisy block the LEFT clean positions before "
                            "it and itself (docs/algorithm.md §3); only the clean rows a rank's rows see travel.")
    group.add_argument("--window-attn-skip-freq", type=window_attn_skip_freq, default=None,
                       help="Which layers keep global attention with --window-size: N (every N-th layer, counting "
                            "from 1) or a 0 (global) / 1 (sliding) pattern per layer, e.g. '([1]*5+[0])*4'. "
                            "Default: every layer slides.")
    group.add_argument("--experimental-attention-variant", choices=("gated_delta_net",), default=None,
                       help="gated_delta_net: a hybrid of Gated DeltaNet layers (megatron-core's GatedDeltaNet) and "
                            "full-attention layers (--linear-attention-freq); under block diffusion each noisy block "
                            "starts from the clean stream's state at its start (docs/algorithm.md).")
    group.add_argument("--linear-attention-freq", type=linear_attention_freq, default=None,
                       help="With --experimental-attention-variant: N (every N-th layer, counting from 1, full "
                            "attention, the others Gated DeltaNet) or a 1 (Gated DeltaNet) / 0 pattern per layer.")
    for name, default in (("conv-kernel-dim", 4), ("key-head-dim", 128), ("value-head-dim", 128),
                          ("num-key-heads", 16), ("num-value-heads", 32)):
        group.add_argument(f"--linear-{name}", type=int, default=default,
                           help=f"Gated DeltaNet's {name.replace('-', ' ')} (megatron-core's default {default}).")
    group.add_argument("--attention-output-gate", action="store_true",
                       help="A sigmoid gate on each full-attention layer's output (megatron-core's, Qwen3.5's).")
    group.add_argument("--apply-layernorm-1p", action="store_true",
                       help="Every norm's weight scales by 1 + w (starting at zero): Qwen3.5's RMSNorm.")
    group.add_argument("--rotary-base", type=int, default=10000)
    group.add_argument("--rotary-percent", type=float, default=1.0)
    group.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                       help="Only 1, no interpolation (as Megatron-LM's Qwen3 recipes write it); other values are "
                            "refused.")
    group.add_argument("--use-rope-scaling", action="store_true",
                       help="Llama 3.x RoPE frequency scaling (megatron-core's: low/high frequency factors 1/4, "
                            "original context 8192).")
    group.add_argument("--rope-scaling-factor", type=float, default=8.0, help="Its factor (Llama 3.1: 8).")
    group.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    group.add_argument("--norm-epsilon", type=float, default=1e-5)
    group.add_argument("--swiglu", action="store_true")
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--add-qkv-bias", action="store_true",
                       help="Bias on the QKV projection only (Qwen2), even with --disable-bias-linear.")
    group.add_argument("--qk-layernorm", action="store_true",
                       help="Normalise each head's query and key (Qwen3's QK-norm), with --normalization.")
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--attention-dropout", type=float, default=0.0,
                       help="Must be 0: the CSBP attention kernel has no attention-probability dropout.")
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default=None,
                       help="transformer_engine: Transformer Engine layers; local: megatron-core's own. "
                            "Default: transformer_engine where it is installed, else local.")
    group.add_argument("--spec", nargs=2, default=None, metavar=("MODULE", "NAME"),
                       help="A layer ModuleSpec to start from (its core attention becomes CSBP's).")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=rules.MAKE_VOCAB_SIZE_DIVISIBLE_BY,
                       help="Pad the vocabulary (data ids + MASK) to a multiple of this x TP.")
    group.add_argument("--cross-entropy-loss-fusion", action="store_true",
                       help="The LM head and its loss as a tiled linear cross-entropy: the same loss, the logits "
                            "never held whole (tiles of --cross-entropy-tile-rows rows).")
    group.add_argument("--cross-entropy-fusion-impl", choices=rules.CROSS_ENTROPY_FUSION_IMPLS,
                       default=rules.CROSS_ENTROPY_FUSION_IMPLS[0],
                       help="native only: the plugin's tiled linear cross-entropy (Transformer Engine's kernel, te, "
                            "takes the whole logits).")


def window_size(text):
    """`--window-size`'s argparse type, as Megatron-LM's `tuple_type` reads it: `LEFT,RIGHT` (parentheses allowed)."""
    if isinstance(text, (tuple, list)):
        return tuple(text)
    try:
        return tuple(int(part) for part in str(text).strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give two integers LEFT,RIGHT, e.g. 511,0") from None


def window_attn_skip_freq(text):
    """`--window-attn-skip-freq`'s argparse type: an int N (every N-th layer global) or a list pattern of 0
    (global) and 1 (sliding) per layer, read without running it (`layer_pattern`)."""
    try:
        return layer_pattern.parse(text, "--window-attn-skip-freq")
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def linear_attention_freq(text):
    """`--linear-attention-freq`'s argparse type: an int N (every N-th layer full attention) or a list pattern of 1
    (Gated DeltaNet) and 0 (full attention) per layer, read without running it (`layer_pattern`)."""
    try:
        return layer_pattern.parse(text, "--linear-attention-freq")
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def moe_layer_freq(text):
    """`--moe-layer-freq`'s argparse type: an int N (one MoE layer every N layers, the first one MoE) or a list
    pattern of 0 (dense) and 1 (MoE) per layer, read without running it (`layer_pattern`)."""
    try:
        return layer_pattern.parse(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_moe_args(parser):
    group = parser.add_argument_group(title="mixture of experts (megatron-core's MoE layers)")
    group.add_argument("--num-experts", type=int, default=None, help="Experts per MoE layer (None: a dense model).")
    group.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1,
                       help="One MoE layer every N layers (N), or a 0/1 pattern per layer, e.g. '([0]+[1]*3)*2'.")
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="Each expert's FFN size. Default: "
                                                                                "--ffn-hidden-size.")
    group.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                       help="FFN size of the shared expert(s) every token also goes through (None: none).")
    group.add_argument("--moe-router-topk", type=int, default=2, help="Experts each token is routed to.")
    group.add_argument("--moe-router-score-function", choices=rules.MOE_SCORE_FUNCTIONS, default="softmax")
    group.add_argument("--moe-router-pre-softmax", action="store_true",
                       help="Softmax over all experts, then the top k (their weights do not sum to 1: Qwen-MoE's "
                            "norm_topk_prob false); default: the top k logits, then a softmax over them.")
    group.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                       help="Router logits' precision (default: the model's).")
    group.add_argument("--moe-router-load-balancing-type", nargs="+", type=str, default="aux_loss",
                       choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
                       help="aux_loss (GShard/Switch load-balancing loss over every row of the rank, noisy and "
                            "clean) or none; the others are refused with CSBP.")
    group.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                       help="Weight of the load-balancing loss (1e-2 is a usual start).")
    group.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall", "flex"), default="allgather",
                       help="How tokens reach their experts' ranks (alltoall scales with EP; flex is refused).")
    group.add_argument("--moe-grouped-gemm", action="store_true",
                       help="All local experts in one grouped GEMM (Transformer Engine); else one by one.")
    group.add_argument("--moe-layer-recompute", action="store_true",
                       help="Megatron-LM's older spelling of selective recompute of the MoE layers: "
                            "--recompute-granularity selective, moe added to --recompute-modules.")
    group.add_argument("--expert-model-parallel-size", type=int, default=1,
                       help="EP: ranks the experts are spread over, carved from each stage's TP x CSBP x DP ranks.")
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="ETP: ranks each expert is split over. Default: --tensor-model-parallel-size.")


def _add_training_args(parser):
    group = parser.add_argument_group(title="training")
    group.add_argument("--seq-length", type=int, default=None, help="Clean context length L (tokens of x0).")
    group.add_argument("--micro-batch-size", type=int, default=None)
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Default: micro-batch-size x data-parallel size.")
    group.add_argument("--train-iters", type=int, default=None)
    group.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    group.add_argument("--lr", type=float, default=None)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
                       default="linear")
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--lr-warmup-fraction", type=float, default=None,
                       help="Warmup as a share of the decay length (exclusive with --lr-warmup-iters).")
    group.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                       help="With --lr-decay-style WSD: the final iterations over which the lr anneals.")
    group.add_argument("--lr-wsd-decay-style", choices=("exponential", "linear", "cosine", "minus_sqrt"),
                       default="exponential", help="With --lr-decay-style WSD: the anneal's shape.")
    group.add_argument("--lr-decay-iters", type=int, default=None, help="Default: --train-iters.")
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--fp16", action="store_true")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--calculate-per-token-loss", action="store_true", default=True,
                       help="Always on here (Megatron-LM's default is off): the BDLM loss is a per-token NELBO over "
                            "the global batch, which sharded rows only reproduce with per-token normalisation.")
    group.add_argument("--use-cpu-initialization", action="store_true", default=None)
    group.add_argument("--recompute-granularity", choices=rules.RECOMPUTE_GRANULARITIES, default=None)
    group.add_argument("--recompute-activations", action="store_true",
                       help="Megatron-LM's shorthand for --recompute-granularity selective.")
    group.add_argument("--recompute-modules", nargs="+", type=str, default=None, metavar="MODULE",
                       help="With --recompute-granularity selective: the submodules recomputed in the backward, by "
                            "megatron-core's names: core_attn (the default), mlp, layernorm, moe, shared_experts, "
                            "moe_act (with --moe-grouped-gemm); those the model lacks are refused.")
    group.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    group.add_argument("--recompute-num-layers", type=int, default=None)
    group.add_argument("--exit-duration-in-mins", type=int, default=None)
    group.add_argument("--exit-signal-handler", action="store_true")
    group.add_argument("--exit-interval", type=int, default=None, help="Save and exit when the iteration is a multiple of this.")
    group.add_argument("--seed", type=int, default=1234)


def _add_parallel_args(parser):
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="Megatron's CP slot; holds the block-parallel size (prefer --context-block-parallel).")
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="Reduce each gradient bucket as soon as its gradients are ready, overlapping the "
                            "backward (megatron-core's DDP).")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="With --use-distributed-optimizer and --overlap-grad-reduce: gather each bucket's "
                            "updated parameters as the next forward reaches them (megatron-core's DDP).")
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Timeout minutes for torch.distributed: a dead rank stops the others within it.")


def _add_data_and_io_args(parser):
    group = parser.add_argument_group(title="data and checkpoints")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="Dataset prefix(es) of .bin/.idx files, optionally weighted: 'w1 prefix1 w2 prefix2'.")
    group.add_argument("--split", type=str, default=None,
                       help=f"Train,valid,test proportions of documents. Default: '{MEGATRON_SPLIT_DEFAULT}'.")
    group.add_argument("--reset-position-ids", action="store_true",
                       help="Packed documents (ending at EOD): RoPE positions restart at each document.")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="Packed documents: no row of either copy attends across a document (EOD).")
    group.add_argument("--eod-mask-loss", action="store_true", help="EOD tokens are never supervised.")
    group.add_argument("--data-cache-path", type=str, default=None,
                       help="Where dataset indices are cached. Default: a 'cache' folder beside the first dataset.")
    group.add_argument("--num-workers", type=int, default=2)
    group.add_argument("--tokenizer-type", choices=TOKENIZERS, default="ByteLevelTokenizer",
                       help="ByteLevelTokenizer: 256 byte ids + EOD. HuggingFaceTokenizer: a local tokenizer.json.")
    group.add_argument("--tokenizer-model", type=str, default=None, help="Local tokenizer.json (HuggingFaceTokenizer).")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="Tokenizer ids before EOD, MASK and padding (byte tokenizer: 256, the default).")
    group.add_argument("--save", type=str, default=None)
    group.add_argument("--load", type=str, default=None)
    group.add_argument("--save-interval", type=int, default=None)
    group.add_argument("--no-load-optim", action="store_true", default=None)
    group.add_argument("--no-load-rng", action="store_true", default=None)
    group.add_argument("--finetune", action="store_true")
    group.add_argument("--exit-on-missing-checkpoint", action="store_true")
    group.add_argument("--load-fallback-to-previous", action="store_true",
                       help="If the latest checkpoint under --load is incomplete or corrupt, load the newest complete older one.")
    group.add_argument("--ckpt-format", choices=("torch_dist",), default="torch_dist")
    group.add_argument("--eval-interval", type=int, default=EVAL_INTERVAL)
    group.add_argument("--eval-iters", type=int, default=100)
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--tensorboard-dir", type=str, default=None)


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's flags (names, defaults, meanings) for the subset we support, plus the plugin's."""
    parser = argparse.ArgumentParser(description="Block diffusion LM pretraining with context-sharded block "
                                                 "parallelism (CSBP) on Megatron-Core.", allow_abbrev=False)
    _add_model_args(parser)
    add_moe_args(parser)
    _add_training_args(parser)
    _add_parallel_args(parser)
    _add_data_and_io_args(parser)
    from megatron_csbp.training import flag_table
    return flag_table.add_refusals(add_csbp_args(parser))
