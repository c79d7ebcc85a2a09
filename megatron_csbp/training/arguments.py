"""Command-line arguments: the plugin's flags, the Megatron-LM subset our own loop supports, and validation.

`add_csbp_args` is Megatron-LM's `extra_args_provider`; `build_parser` rebuilds, with Megatron-LM's names,
defaults and meanings, the flags our CPU loop needs (Megatron-LM's parser is not installable from PyPI).
`validate_args` refuses a bad combination with one line naming the flag and the fix, before any work.

`--seq-length` is the clean context length `L` ("256K context"). The model sees `2L` rows, `[x_t ; x_0]`;
each block-parallel rank holds `|owned noisy rows| + L/C` of them (`2L/P` when `P == C`), which is the
sequence dimension pipeline stages exchange, where Megatron would use `seq_length / cp`.
"""

import argparse
import os
import re
import shutil
import sys

from megatron_csbp.core import rules
from megatron_csbp.core.rules import BYTE_TOKENIZER, PARALLEL_MODES, TOKENIZERS, ConfigError, refused_features
from megatron_csbp.training.datasets import MEGATRON_SPLIT_DEFAULT, check_data_prefixes, parse_data_path
from megatron_csbp.training.tokenizers import tokenizer_file

TRAINING_LOOPS = ("auto", "megatron-lm", "megatron-core")
TRANSFORMER_IMPLS = ("local", "transformer_engine")


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
    group.add_argument("--bdlm-objective", choices=rules.OBJECTIVES, default="bd3lm",
                       help="BD3-LM NELBO, or Fast-dLLM v2 (complementary masks, shifted labels, unit weights).")
    group.add_argument("--bdlm-loss-weighting", choices=rules.LOSS_WEIGHTINGS, default=None,
                       help="Per-block loss weight 1/t (the NELBO) or 1. Default: inverse-t for bd3lm, unit for "
                            "fast-dllm-v2.")
    group.add_argument("--bdlm-noise-range", type=float, nargs=2, default=[1e-3, 1.0], metavar=("T_MIN", "T_MAX"),
                       help="Noise times are drawn in [T_MIN, T_MAX], inside (0, 1].")
    group.add_argument("--bdlm-noise-sampling", choices=rules.NOISE_SAMPLINGS, default="antithetic",
                       help="Stratified noise times over the (sample, block) pairs of a batch, or i.i.d. uniform.")
    group.add_argument("--bdlm-parallel-mode", choices=PARALLEL_MODES, default="csbp",
                       help="csbp: context-sharded block parallelism; cp: conventional context parallelism over "
                            "[x_t ; x_0] (baseline); bp: pure block parallelism (C = 1, clean prefix replicated).")
    group.add_argument("--csbp-transport", choices=rules.TRANSPORTS, default="collective",
                       help="All-gather the clean K/V (collective) or pass shards around the ring (bounded memory).")
    group.add_argument("--link-gbps", type=float, default=None, metavar="GBPS",
                       help="Simulate a link this slow for the attention collectives (comm.simulated_link).")
    group.add_argument("--link-latency-us", type=float, default=10.0, help="Latency of each simulated transfer.")
    group.add_argument("--csbp-block-schedule", choices=rules.SCHEDULES, default="dual_end",
                       help="How noisy blocks are dealt to ranks (contiguous is an ablation).")
    group.add_argument("--csbp-clean-layout", choices=rules.CLEAN_LAYOUTS, default="zigzag",
                       help="How the clean sequence is sharded over a ring (contiguous is an ablation).")
    group.add_argument("--bdlm-mask-token-id", type=int, default=None, metavar="ID",
                       help="The MASK id: a new id right after the tokenizer's (the default), or an existing id "
                            "the data never uses (e.g. what scripts/convert_hf.py import chose).")
    group.add_argument("--max-consecutive-bad-steps", type=int, default=3, metavar="N",
                       help="Steps with a NaN/Inf loss or grad norm are skipped; stop after N in a row.")
    group.add_argument("--config", type=str, default=None, metavar="FILE.yaml",
                       help="YAML of flag names; command-line key=value overrides and flags win over it.")
    group.add_argument("--training-loop", choices=TRAINING_LOOPS, default="auto",
                       help="megatron-lm: Megatron-LM's pretrain(); megatron-core: the plugin's own loop built from "
                            "megatron-core parts; auto: Megatron-LM's where megatron.training imports, else ours.")
    if not _has_flag(parser, "--distributed-timeout-minutes"):
        group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                           help="Timeout minutes for torch.distributed.")
    if _has_flag(parser, "--tokenizer-type") and BYTE_TOKENIZER not in parser._option_string_actions[
            "--tokenizer-type"].choices:
        parser._option_string_actions["--tokenizer-type"].choices.append(BYTE_TOKENIZER)  # see byte_tokenizer_as_null
    parser.set_defaults(**bdlm_defaults())
    return parser


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
    the bytes, EOD is 256): under `pretrain()` the plugin's `--tokenizer-type ByteLevelTokenizer` becomes that."""
    argv = list(argv)
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
    group.add_argument("--position-embedding-type", choices=("rope",), default="rope",
                       help="Only rope: a token's noisy and clean copy share its RoPE position. (Megatron-LM's "
                            "default, learned_absolute, is not supported.)")
    group.add_argument("--rotary-base", type=int, default=10000)
    group.add_argument("--rotary-percent", type=float, default=1.0)
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
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Timeout minutes for torch.distributed: a dead rank stops the others within it.")


def _add_data_and_io_args(parser):
    group = parser.add_argument_group(title="data and checkpoints")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="Dataset prefix(es) of .bin/.idx files, optionally weighted: 'w1 prefix1 w2 prefix2'.")
    group.add_argument("--split", type=str, default=None,
                       help=f"Train,valid,test proportions of documents. Default: '{MEGATRON_SPLIT_DEFAULT}'.")
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
    group.add_argument("--eval-interval", type=int, default=1000)
    group.add_argument("--eval-iters", type=int, default=100)
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--tensorboard-dir", type=str, default=None)


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's flags (names, defaults, meanings) for the subset we support, plus the plugin's."""
    parser = argparse.ArgumentParser(description="Block diffusion LM pretraining with context-sharded block "
                                                 "parallelism (CSBP) on Megatron-Core.", allow_abbrev=False)
    _add_model_args(parser)
    _add_training_args(parser)
    _add_parallel_args(parser)
    _add_data_and_io_args(parser)
    from megatron_csbp.training import flag_table
    return flag_table.add_refusals(add_csbp_args(parser))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _refuse(problem: str | None) -> None:
    rules.refuse(problem, ConfigError)


def _on_accelerator() -> bool:
    from megatron_csbp.core.device import default_device
    return default_device().type != "cpu"


# Numeric flags and the values they accept: (flag, accepts, what the message says it must be).
_RANGES = (
    ("kv_channels", lambda v: v >= 1, ">= 1"), ("ffn_hidden_size", lambda v: v >= 1, ">= 1"),
    ("num_query_groups", lambda v: v >= 1, ">= 1"), ("vocab_size", lambda v: v >= 1, ">= 1"),
    ("make_vocab_size_divisible_by", lambda v: v >= 1, ">= 1"),
    ("max_position_embeddings", lambda v: v >= 1, ">= 1"),
    ("rotary_base", lambda v: v >= 1, ">= 1"), ("rotary_percent", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("norm_epsilon", lambda v: v > 0, "> 0"), ("init_method_std", lambda v: v >= 0, ">= 0"),
    ("attention_dropout", lambda v: 0 <= v < 1, "in [0, 1)"), ("hidden_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("global_batch_size", lambda v: v >= 1, ">= 1"),
    ("lr", lambda v: v >= 0, ">= 0"), ("min_lr", lambda v: v >= 0, ">= 0"),
    ("lr_warmup_iters", lambda v: v >= 0, ">= 0"), ("lr_decay_iters", lambda v: v >= 1, ">= 1"),
    ("lr_wsd_decay_iters", lambda v: v >= 1, ">= 1"),
    ("weight_decay", lambda v: v >= 0, ">= 0"), ("clip_grad", lambda v: v >= 0, ">= 0 (0: no clipping)"),
    ("adam_beta1", lambda v: 0 <= v < 1, "in [0, 1)"), ("adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("adam_eps", lambda v: v > 0, "> 0"),
    ("seed", lambda v: 0 <= v < 2 ** 32, "in [0, 2**32)"),
    ("save_interval", lambda v: v >= 1, ">= 1"), ("exit_interval", lambda v: v >= 1, ">= 1"),
    ("exit_duration_in_mins", lambda v: v >= 0, ">= 0"), ("num_workers", lambda v: v >= 0, ">= 0"),
    ("recompute_num_layers", lambda v: v >= 1, ">= 1"),
)


def check_ranges(args: argparse.Namespace) -> None:
    """Every numeric flag's range, and the pairs that must agree, refused with the flag named (one line).

    Flags this parser lacks (e.g. under Megatron-LM's own) or left unset (None) are skipped; NaN is
    refused everywhere (it fails every comparison).
    """
    for name, accepts, what in _RANGES:
        value = getattr(args, name, None)
        if value is not None and not isinstance(value, bool) and not accepts(value):
            raise ConfigError(f"--{name.replace('_', '-')} must be {what}; got {value}")
    lr, min_lr = getattr(args, "lr", None), getattr(args, "min_lr", None)
    _require(lr is None or min_lr is None or lr >= min_lr,
             f"--lr {lr} is below --min-lr {min_lr}: the schedule decays from --lr down to --min-lr; raise --lr or "
             f"lower --min-lr")
    if getattr(args, "lr_decay_style", None) == "WSD":
        wsd, decay = getattr(args, "lr_wsd_decay_iters", None), args.lr_decay_iters or args.train_iters
        _require(wsd is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters N (the final iterations over "
                                  "which the lr anneals; --lr-wsd-decay-style picks its shape)")
        _require(decay is None or wsd <= decay, f"--lr-wsd-decay-iters {wsd} exceeds --lr-decay-iters {decay} "
                                                f"(default: --train-iters); shorten the anneal")
    split, eval_iters = getattr(args, "split", None), getattr(args, "eval_iters", 0)
    if split and eval_iters:
        try:
            shares = [float(part) for part in re.split(r"[,/]", split)]
        except ValueError:
            shares = []  # malformed: the data module names it
        _require(len(shares) < 2 or shares[1] != 0 or not sum(shares) > 0,
                 f"--split '{split}' gives validation no share, but --eval-iters {eval_iters} asks for it: give "
                 f"it a share (e.g. --split 98,2,0) or set --eval-iters 0")


def query_groups(args: argparse.Namespace) -> int:
    """The K/V heads: `--num-query-groups` with `--group-query-attention`, else one per attention head."""
    return args.num_query_groups if args.group_query_attention else args.num_attention_heads


def check_shared_values(args: argparse.Namespace) -> None:
    """The values both loops refuse, each with one line naming the flag, before any work: our loop's own checks,
    and under Megatron-LM's `pretrain()` the values its `validate_args` would stop on with a bare assert (or take
    and fail on later: `--log-interval 0`). A flag left unset (None) is skipped; required ones are each loop's.
    """
    check_ranges(args)
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "distributed_timeout_minutes",
                 "log_interval", "eval_interval"):
        value = getattr(args, flag, None)
        if value is not None:
            _refuse(rules.at_least(f"--{flag.replace('_', '-')}", value))
    for flag in ("train_iters", "eval_iters"):
        value = getattr(args, flag, None)
        _require(value is None or value >= 0, f"--{flag.replace('_', '-')} must be >= 0; got {value}")
    _require(not (args.lr_warmup_fraction is not None and args.lr_warmup_iters),
             "--lr-warmup-fraction and --lr-warmup-iters are exclusive (Megatron-LM takes one); keep one")
    if args.lr_warmup_fraction is not None:
        _require(0 <= args.lr_warmup_fraction < 1, f"--lr-warmup-fraction {args.lr_warmup_fraction} must be in "
                                                   f"[0, 1) (a share of --lr-decay-iters)")
    heads, TP, PP = args.num_attention_heads, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if heads is None:
        return
    groups = query_groups(args)
    _refuse(rules.query_groups_problem(heads, groups) or rules.tensor_parallel_problem(heads, groups, TP)
            or (args.num_layers is not None and rules.pipeline_problem(args.num_layers, PP)) or None)
    if args.kv_channels is None and args.hidden_size is not None:
        _refuse(rules.kv_channels_problem(args.hidden_size, heads))


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _check_directory(flag: str, path: str, *, written: bool) -> None:
    """`path` is, or can become, a directory this run can read (and write, when `written`)."""
    if os.path.exists(path) and not os.path.isdir(path):
        fix = "give a directory (it is created when missing)" if written else "give the --save directory of a run"
        raise ConfigError(f"{flag} {path} is a file, not a directory; {fix}")
    existing = _existing_ancestor(path)
    _require(os.path.isdir(existing), f"{flag} {path}: {existing} is a file, so {path} cannot be created; give "
                                      f"another directory")
    access = (os.W_OK | os.X_OK) if written else (os.R_OK | os.X_OK)
    _require(os.access(existing, access),
             f"{flag} {path} is not {'writable' if written else 'readable'} ({existing}: permissions or a read-only "
             f"file system); fix that or give another directory")


def checkpoint_bytes(args: argparse.Namespace) -> tuple[int, int, int]:
    """(bytes, parameters, bytes per parameter) one checkpoint of validated `args` takes: the weights, the
    optimizer's moments (Adam 2, SGD 1, fp32) and its fp32 master weights under --bf16/--fp16."""
    from megatron_csbp.bdlm.flops import parameter_count

    ids = (args.vocab_size or 256) + 1 + 1  # the tokenizer's ids, EOD, MASK (the data module has the exact count)
    padded = rules.padded_vocab_size(ids, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    parameters = parameter_count(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        padded_vocab_size=padded, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, swiglu=args.swiglu,
        add_bias_linear=args.add_bias_linear, layernorm_bias=args.normalization == "LayerNorm",
        untied_output=args.untie_embeddings_and_output_weights)
    mixed = args.bf16 or args.fp16
    per_parameter = (2 if mixed else 4) + (8 if args.optimizer == "adam" else 4) + (4 if mixed else 0)
    return parameters * per_parameter, parameters, per_parameter


def check_output_paths(args: argparse.Namespace, free_space: bool = True) -> None:
    """--save, --load, --tensorboard-dir, --data-cache-path usable as directories, and (`free_space`, our loop's
    validated arguments) room at --save for a checkpoint (refused when one does not fit, a warning when a
    second would not), before any work."""
    for flag, name, written in (("--save", "save", True), ("--load", "load", False),
                                ("--tensorboard-dir", "tensorboard_dir", True),
                                ("--data-cache-path", "data_cache_path", True)):
        path = getattr(args, name, None)
        if path:
            _check_directory(flag, path, written=written)
    if not (args.save and free_space):
        return
    need, parameters, per_parameter = checkpoint_bytes(args)
    free = shutil.disk_usage(_existing_ancestor(args.save)).free
    sizes = (f"{free / 2**30:.2f} GiB free there; one checkpoint of this model takes about {need / 2**30:.2f} GiB "
             f"({parameters:,} parameters x {per_parameter} bytes: weights and optimizer state)")
    _require(free >= need, f"--save {args.save}: {sizes}; free space or give another --save")
    if free < 2 * need and os.environ.get("RANK", "0") == "0":
        print(f"WARNING: --save {args.save}: {sizes}: room for one checkpoint only", file=sys.stderr, flush=True)


def clean_shards(args: argparse.Namespace) -> int:
    """`C`: the clean shards of the run's mode (1 for pure BP, `P` for the CP baseline, else the flag or `P`)."""
    return rules.clean_shards(args.bdlm_parallel_mode, args.context_block_parallel or args.context_parallel_size,
                              args.context_block_parallel_clean_shards)


def validate_plugin_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """The plugin's rules, on our loop's arguments and on Megatron-LM's alike (one line: flag and fix).

    Block size and layout geometry, block-parallel vs CP sizes, the refused ring-CP features, the noise
    range, RoPE and the transformer implementation. Fills `context_block_parallel` (P),
    `context_block_parallel_clean_shards` (C) and `bdlm_loss_weighting` where they are left to defaults.
    """
    for flag in ("bdlm_block_size", "context_parallel_size", "max_consecutive_bad_steps"):
        _refuse(rules.at_least(f"--{flag.replace('_', '-')}", getattr(args, flag)))
    _require(args.link_gbps is None or (args.link_gbps > 0 and args.link_latency_us >= 0),
             f"--link-gbps {args.link_gbps} / --link-latency-us {args.link_latency_us}: a simulated link needs "
             f"a speed > 0 and a latency >= 0 (or drop --link-gbps)")
    P = args.context_block_parallel or args.context_parallel_size
    _require(P == args.context_parallel_size,
             f"--context-block-parallel {P} contradicts --context-parallel-size {args.context_parallel_size}: "
             f"the block-parallel dimension lives in Megatron's CP slot; give only --context-block-parallel")
    mode = args.bdlm_parallel_mode
    _refuse(rules.clean_shards_problem(mode, P, args.context_block_parallel_clean_shards))
    C = clean_shards(args)
    args.context_block_parallel, args.context_block_parallel_clean_shards = P, C
    TP, PP = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _refuse(rules.world_size_problem(TP, PP, P, world_size))
    _require(args.seq_length is not None, "--seq-length is required")
    _refuse(rules.sequence_problem(mode, args.seq_length, args.bdlm_block_size, P, C, args.csbp_clean_layout))

    for message in refused_features(args):
        raise ConfigError(message)
    _require(args.position_embedding_type == "rope",
             f"--position-embedding-type {args.position_embedding_type}: BDLM needs rope (a token's noisy and clean "
             f"copy share one position); use --position-embedding-type rope")
    if args.transformer_impl == "transformer_engine":
        import importlib.util
        _require(importlib.util.find_spec("transformer_engine") is not None,
                 "--transformer-impl transformer_engine needs Transformer Engine (pip install -e '.[gpu]' on a GPU "
                 "machine); use --transformer-impl local")
    _refuse(rules.noise_range_problem(*args.bdlm_noise_range))
    _refuse(rules.loss_weighting_problem(args.bdlm_objective, args.bdlm_loss_weighting))
    args.bdlm_loss_weighting = args.bdlm_loss_weighting or rules.default_loss_weighting(args.bdlm_objective)
    return args


def validate_args(args: argparse.Namespace, world_size: int, *, on_accelerator: bool | None = None,
                  check_paths: bool = True) -> argparse.Namespace:
    """Our loop's validation: Megatron-LM's checks for the flags we support, then the plugin's rules.

    Fills, as Megatron-LM's does: `data_parallel_size`, `global_batch_size`, `ffn_hidden_size`, `kv_channels`,
    `num_query_groups`, `max_position_embeddings`, `lr_decay_iters`,
    `split`, `data_prefixes`, `data_weights`, `world_size`; and what `validate_plugin_args` fills.
    """
    on_accelerator = _on_accelerator() if on_accelerator is None else on_accelerator
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "lr"):
        _require(getattr(args, flag) is not None, f"--{flag.replace('_', '-')} is required")
    check_shared_values(args)
    validate_plugin_args(args, world_size)
    TP, PP, P = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    args.world_size, args.data_parallel_size = world_size, world_size // (TP * PP * P)

    L = args.seq_length
    _require(args.max_position_embeddings is None or args.max_position_embeddings >= L,
             f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length {L}; "
             f"raise it or drop it (default: --seq-length)")
    args.max_position_embeddings = args.max_position_embeddings or L

    args.num_query_groups = query_groups(args)
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = rules.default_ffn_hidden_size(args.hidden_size, args.swiglu)
    if TP == 1:
        args.sequence_parallel = False

    micro, dp = args.micro_batch_size, args.data_parallel_size
    args.global_batch_size = args.global_batch_size or micro * dp
    _refuse(rules.batch_problem(args.global_batch_size, micro, dp))

    _require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are exclusive; choose one")
    for flag, on in (("--bf16", args.bf16), ("--fp16", args.fp16),
                     ("--use-distributed-optimizer", args.use_distributed_optimizer)):
        _require(on_accelerator or not on, f"{flag} needs a GPU (megatron-core's mixed-precision and distributed "
                                           f"optimizers cannot run on CPU); drop {flag} for a CPU run")
    _require(args.recompute_method is None or args.recompute_granularity == "full",
             f"--recompute-method {args.recompute_method} needs --recompute-granularity full")
    if args.recompute_granularity == "full":
        _require(args.recompute_method is not None and args.recompute_num_layers is not None,
                 "--recompute-granularity full needs --recompute-method (uniform|block) and --recompute-num-layers")
    _validate_lr_schedule(args)

    args.data_prefixes, args.data_weights = parse_data_path(args.data_path)
    _require(bool(args.data_prefixes), "--data-path is required (scripts/prepare_data.py builds the default "
                                       "dataset, data/stdlib_bytes_text_document)")
    args.split = args.split or MEGATRON_SPLIT_DEFAULT
    if args.tokenizer_type == "HuggingFaceTokenizer":
        _require(args.tokenizer_model is not None, "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
                                                   "path/to/tokenizer.json")
    if args.tokenizer_type == "NullTokenizer":
        _require(args.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size (ids before EOD)")
    if check_paths:
        check_data_prefixes(args.data_prefixes)
        if args.tokenizer_model is not None:
            tokenizer_file(args.tokenizer_model)
        check_output_paths(args)
    return args


def _validate_lr_schedule(args: argparse.Namespace) -> None:
    """Megatron-LM's warmup length: iterations, or a fraction of the decay length (`--lr-warmup-fraction`)."""
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    _require(args.lr_decay_iters >= 1, "--train-iters (or --lr-decay-iters) must be >= 1 for the lr schedule")
    _require(args.lr_warmup_iters < args.lr_decay_iters,
             f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters {args.lr_decay_iters} "
             f"(default: --train-iters); shorten the warmup or give it as --lr-warmup-fraction")


def lr_schedule_steps(args: argparse.Namespace) -> tuple[float, int]:
    """(warmup, decay) lengths in samples, as Megatron-LM's `get_optimizer_param_scheduler` computes them."""
    decay = args.lr_decay_iters * args.global_batch_size
    if args.lr_warmup_fraction is not None:
        return args.lr_warmup_fraction * decay, decay
    return args.lr_warmup_iters * args.global_batch_size, decay


def transformer_config_kwargs(args: argparse.Namespace) -> dict:
    """megatron-core `TransformerConfig` fields from validated args (Megatron-LM's mapping, our subset)."""
    import torch
    import torch.nn.functional as F

    params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size, sequence_parallel=args.sequence_parallel,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=getattr(args, "add_qkv_bias", False),
        qk_layernorm=getattr(args, "qk_layernorm", False), init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        bf16=args.bf16, fp16=args.fp16, params_dtype=params_dtype, pipeline_dtype=params_dtype,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        calculate_per_token_loss=args.calculate_per_token_loss,
        use_cpu_initialization=bool(args.use_cpu_initialization),
        # Pipeline stages exchange this rank's CSBP rows (|owned noisy| + L/C, uneven when the blocks do not
        # split evenly), not Megatron's `seq_length / cp`: let the schedule send each message's shape.
        variable_seq_lengths=args.pipeline_model_parallel_size > 1,
        # megatron-core refuses variable_seq_lengths beside its default MoE dispatcher, even without MoE.
        **({"moe_token_dispatcher_type": "alltoall"} if args.pipeline_model_parallel_size > 1 else {}),
    )


def transformer_config_from_args(args: argparse.Namespace):
    """A megatron-core `TransformerConfig` from validated args."""
    from megatron.core.transformer import TransformerConfig
    return TransformerConfig(**transformer_config_kwargs(args))


def optimizer_config_from_args(args: argparse.Namespace):
    """A megatron-core `OptimizerConfig` from validated args."""
    from megatron.core.optimizer import OptimizerConfig
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
