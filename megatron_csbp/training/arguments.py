"""Validation of the training arguments, before any work: the plugin's rules for both loops
(`validate_plugin_args`, `check_shared_values`, `check_output_paths`) and our loop's (`validate_args`), each
refusal one line naming the flag and the fix. The flags themselves are in `flags`, their mapping to
megatron-core's configs in `megatron_config`.
"""

import argparse
import importlib.util
import math
import os
import re
import shutil
import sys

from megatron_csbp.core import positions, rules
from megatron_csbp.core.run_config import RunConfig
from megatron_csbp.core.rules import ConfigError, refused_features
from megatron_csbp.data.datasets import MEGATRON_SPLIT_DEFAULT, check_data_prefixes, parse_data_path
from megatron_csbp.data.tokenizers import tokenizer_file


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _refuse(problem: str | None) -> None:
    rules.refuse(problem, ConfigError)


def _on_accelerator() -> bool:
    from megatron_csbp.core.device import default_device
    return default_device().type != "cpu"


# A year: torch.distributed's stores break on far longer timeouts (at 10**10 minutes every wait fails at once).
MAX_TIMEOUT_MINUTES = 366 * 24 * 60

# Numeric flags and the values they accept: (flag, accepts, what the message says it must be).
_RANGES = (
    ("num_layers", lambda v: v <= rules.MAX_LAYERS, f"<= {rules.MAX_LAYERS}"),
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
    ("rope_scaling_factor", lambda v: v > 0, "> 0"),
    ("num_experts", lambda v: v >= 0, ">= 0 (0: no experts)"),
    ("moe_ffn_hidden_size", lambda v: v >= 1, ">= 1"),
    ("moe_shared_expert_intermediate_size", lambda v: v >= 1, ">= 1 (leave it unset for no shared expert)"),
    ("moe_router_topk", lambda v: v >= 1, ">= 1"), ("moe_aux_loss_coeff", lambda v: v >= 0, ">= 0"),
    ("expert_model_parallel_size", lambda v: v >= 1, ">= 1"),
    ("expert_tensor_parallel_size", lambda v: v >= 1, ">= 1"),
    ("context_block_parallel", lambda v: v >= 1, ">= 1"),
    ("context_block_parallel_clean_shards", lambda v: v >= 1, ">= 1"),
    ("bdlm_mask_token_id", lambda v: v >= 0, ">= 0"),
    ("link_gbps", lambda v: v > 0, "> 0"), ("link_latency_us", lambda v: v >= 0, ">= 0"),
    ("distributed_timeout_minutes", lambda v: 1 <= v <= MAX_TIMEOUT_MINUTES, f"in [1, {MAX_TIMEOUT_MINUTES}]"),
)


def check_ranges(args: argparse.Namespace) -> None:
    """Every numeric flag's range, and the pairs that must agree, refused with the flag named (one line).

    Flags this parser lacks (e.g. under Megatron-LM's own) or left unset (None) are skipped; NaN is
    refused everywhere (it fails every comparison), and so is an infinite float; a flag that takes several
    values has each checked.
    """
    for name, accepts, what in _RANGES:
        value = getattr(args, name, None)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is None or isinstance(item, bool):
                continue
            if not accepts(item):
                raise ConfigError(f"--{name.replace('_', '-')} must be {what}; got {item}")
            if not math.isfinite(item):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number {what}; got {item}")
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


def check_shared_values(args: argparse.Namespace) -> None:
    """The values both loops refuse, each with one line naming the flag, before any work: our loop's own checks,
    and under Megatron-LM's `pretrain()` the values its `validate_args` would stop on with a bare assert (or take
    and fail on later: `--log-interval 0`). A flag left unset (None) is skipped; required ones are each loop's.
    """
    check_ranges(args)
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "log_interval", "eval_interval"):
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
    if args.train_iters is not None:  # a schedule in iterations (Megatron-LM's in samples is its own)
        decay = args.lr_decay_iters or args.train_iters
        _require(decay >= 1, "--train-iters (or --lr-decay-iters) must be >= 1 for the lr schedule")
        _require(args.lr_warmup_iters < decay, f"--lr-warmup-iters {args.lr_warmup_iters} must be below "
                                               f"--lr-decay-iters {decay} (default: --train-iters); shorten the "
                                               f"warmup or give it as --lr-warmup-fraction")


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


def checkpoint_bytes(settings: RunConfig, args: argparse.Namespace) -> tuple[int, int, int]:
    """(bytes, parameters, bytes per parameter) one checkpoint of the run takes: the weights, the optimizer's
    moments (Adam 2, SGD 1, fp32) and its fp32 master weights under --bf16/--fp16."""
    from megatron_csbp.bdlm.flops import parameter_count

    ids = (args.vocab_size or 256) + 1 + 1  # the tokenizer's ids, EOD, MASK (the data module has the exact count)
    padded = rules.padded_vocab_size(ids, args.make_vocab_size_divisible_by, settings.tensor_parallel_size)
    parameters = parameter_count(settings.shape, padded, settings.layer_windows)
    mixed = args.bf16 or args.fp16
    per_parameter = (2 if mixed else 4) + (8 if args.optimizer == "adam" else 4) + (4 if mixed else 0)
    return parameters * per_parameter, parameters, per_parameter


def check_host_memory(settings: RunConfig, args: argparse.Namespace, on_accelerator: bool | None = None) -> None:
    """A CPU run fits this machine: refused (one line) when even a bound below what a rank holds exceeds the
    machine's memory and swap. The bound is the fp32 weights split over every parallel dimension
    (TP x PP x EP x ETP) plus one layer's input for a micro-batch (at least 2L/P rows per rank, split over TP);
    gradients, optimizer state and the other activations come on top, so it never refuses a run that fits. An
    accelerator run's weights and activations are in device memory, not bounded here."""
    import psutil

    if _on_accelerator() if on_accelerator is None else on_accelerator:
        return
    _, parameters, _ = checkpoint_bytes(settings, args)
    TP = settings.tensor_parallel_size
    split = TP * settings.pipeline_parallel_size * settings.expert_parallel_size * settings.expert_tensor_parallel_size
    rows = 2 * settings.seq_length // settings.block_parallel_size
    layer_input = settings.micro_batch_size * rows * settings.shape.hidden_size // TP
    need = 4 * (parameters // split + layer_input)
    memory = psutil.virtual_memory().total + psutil.swap_memory().total
    _require(need <= memory,
             f"this model and micro-batch need over {need / 2**30:,.1f} GiB per rank ({parameters:,} fp32 parameters "
             f"over {split} model-parallel ranks, and a layer's input: --micro-batch-size {settings.micro_batch_size} "
             f"x {rows} rows x --hidden-size {settings.shape.hidden_size}), more than this machine's "
             f"{memory / 2**30:,.1f} GiB of memory and swap; shrink the model (--num-layers, --hidden-size, "
             f"--ffn-hidden-size, --num-experts, the vocabulary) or --micro-batch-size, or split it over more ranks")


def check_output_paths(args: argparse.Namespace, settings: RunConfig | None = None) -> None:
    """--save, --load, --tensorboard-dir, --data-cache-path usable as directories, and (given the run's
    `settings`) room at --save for a checkpoint (refused when one does not fit, a warning when a second would
    not), before any work."""
    for flag, name, written in (("--save", "save", True), ("--load", "load", False),
                                ("--tensorboard-dir", "tensorboard_dir", True),
                                ("--data-cache-path", "data_cache_path", True)):
        path = getattr(args, name, None)
        if path:
            _check_directory(flag, path, written=written)
    if not (args.save and settings):
        return
    need, parameters, per_parameter = checkpoint_bytes(settings, args)
    free = shutil.disk_usage(_existing_ancestor(args.save)).free
    sizes = (f"{free / 2**30:.2f} GiB free there; one checkpoint of this model takes about {need / 2**30:.2f} GiB "
             f"({parameters:,} parameters x {per_parameter} bytes: weights and optimizer state)")
    _require(free >= need, f"--save {args.save}: {sizes}; free space or give another --save")
    if free < 2 * need and os.environ.get("RANK", "0") == "0":
        print(f"WARNING: --save {args.save}: {sizes}: room for one checkpoint only", file=sys.stderr, flush=True)


def validate_plugin_args(args: argparse.Namespace, world_size: int) -> RunConfig:
    """The plugin's rules, on our loop's arguments and on Megatron-LM's alike (one line: flag and fix): the run
    (`RunConfig.from_args`: the model's sizes and RoPE variant, block size, layout geometry, world size, noise
    range, loss weighting), which it returns, then the simulated link, the refused ring-CP features, the experts,
    the position embedding type and the transformer implementation. The block-parallel
    size P lives in Megatron's CP slot alone (`--context-block-parallel` fills it); the defaults the run leaves
    are the `RunConfig`'s, resolved there.
    Writes nothing to `args`.
    """
    for flag in ("bdlm_block_size", "context_parallel_size", "max_consecutive_bad_steps"):
        _refuse(rules.at_least(f"--{flag.replace('_', '-')}", getattr(args, flag)))
    P = args.context_block_parallel
    _require(P is None or P == args.context_parallel_size,
             f"--context-block-parallel {P} contradicts --context-parallel-size {args.context_parallel_size}: "
             f"the block-parallel dimension lives in Megatron's CP slot; give only --context-block-parallel")
    _require(args.seq_length is not None, "--seq-length is required")
    if getattr(args, "num_experts", None):
        _refuse(rules.moe_layer_freq_problem(args.moe_layer_freq, args.num_layers))
    settings = RunConfig.from_args(args, world_size)
    # Megatron-LM's virtual pipeline (its flags; our loop has none): middle chunks never read the batch
    virtual_pipeline = getattr(args, "num_layers_per_virtual_pipeline_stage", None) or getattr(
        args, "virtual_pipeline_model_parallel_size", None)
    _refuse(rules.packing_problem(settings.reset_position_ids, settings.reset_attention_mask,
                                  settings.pipeline_parallel_size, bool(virtual_pipeline)))

    for message in refused_features(args):
        raise ConfigError(message)
    if getattr(args, "num_experts", None):
        _refuse(rules.moe_problem(
            args.num_experts, args.moe_router_topk, args.moe_router_load_balancing_type,
            args.moe_token_dispatcher_type, args.tensor_model_parallel_size, args.expert_model_parallel_size,
            args.sequence_parallel, args.pipeline_model_parallel_size,
            shared_expert=bool(args.moe_shared_expert_intermediate_size), bias=args.add_bias_linear,
            score_function=args.moe_router_score_function,
            pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False))))
        _require(not args.moe_grouped_gemm or importlib.util.find_spec("transformer_engine") is not None,
                 "--moe-grouped-gemm needs Transformer Engine (its grouped GEMM); drop it to run the experts one "
                 "by one (megatron-core's SequentialMLP)")
    if getattr(args, "gemma4_moe", False):
        _refuse(rules.gemma4_moe_problem(
            getattr(args, "num_experts", None),
            rules.moe_layer_pattern(args.moe_layer_freq, args.num_layers) if getattr(args, "num_experts", None) else (),
            args.moe_shared_expert_intermediate_size, args.swiglu, args.moe_router_score_function,
            bool(getattr(args, "moe_router_pre_softmax", False))))
    kind = positions.position_embedding_type(args)
    _require(kind in (positions.ROPE, positions.YARN),
             f"--position-embedding-type {args.position_embedding_type}: BDLM needs rope (or yarn: a token's noisy "
             f"and clean copy share one position); use --position-embedding-type rope")
    _require(getattr(args, "add_position_embedding", True) or kind == positions.ROPE,
             f"--no-position-embedding (Megatron-LM's older switch for no learned positions) is taken beside rope "
             f"only, as Megatron-LM takes it; with --position-embedding-type {kind} drop it")
    factor = getattr(args, "rotary_seq_len_interpolation_factor", None)
    _require(factor in (None, 1), f"--rotary-seq-len-interpolation-factor {factor}: RoPE position interpolation is "
                                  f"not implemented for BDLM (1, no interpolation, is taken); drop it")
    _refuse(rules.recompute_problem(
        recompute_granularity(args), getattr(args, "recompute_modules", None),
        bool(getattr(args, "moe_layer_recompute", False)), moe_layers=bool(settings.shape.moe),
        dense_layers=not settings.shape.moe or settings.shape.moe.num_moe_layers < settings.shape.num_layers,
        shared_experts=bool(settings.shape.moe and settings.shape.moe.shared_expert_ffn_hidden_size),
        grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)),
        transformer_engine=importlib.util.find_spec("transformer_engine") is not None))
    if getattr(args, "overlap_param_gather", False):
        _require(args.use_distributed_optimizer and args.overlap_grad_reduce,
                 "--overlap-param-gather gathers the distributed optimizer's updated shards bucket by bucket: it "
                 "needs --use-distributed-optimizer and --overlap-grad-reduce (Megatron-LM's rule); add them or "
                 "drop it")
    if args.transformer_impl == "transformer_engine":
        _require(importlib.util.find_spec("transformer_engine") is not None,
                 "--transformer-impl transformer_engine needs Transformer Engine (pip install -e '.[gpu]' on a GPU "
                 "machine); use --transformer-impl local")
    return settings


def recompute_granularity(args: argparse.Namespace) -> str | None:
    """The recompute granularity Megatron-LM resolves: `--recompute-activations` (its shorthand) is selective."""
    return "selective" if getattr(args, "recompute_activations", False) else args.recompute_granularity


def validate(args: argparse.Namespace, world_size: int, *, on_accelerator: bool | None = None,
             check_paths: bool = True) -> RunConfig:
    """Our loop's validation: Megatron-LM's checks for the flags we support, then the plugin's rules; the run.

    Fills on `args`, as Megatron-LM's `validate_args` does: the run's resolved sizes, batch and world
    (`RunConfig.write_back`), `max_position_embeddings`, `lr_decay_iters`, `split`, `data_prefixes`,
    `data_weights`. `check_paths`: this machine's paths, free space and (a CPU run) memory; False where the run
    is elsewhere.
    """
    on_accelerator = _on_accelerator() if on_accelerator is None else on_accelerator
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "lr"):
        _require(getattr(args, flag) is not None, f"--{flag.replace('_', '-')} is required")
    check_shared_values(args)
    # Megatron-LM's older spellings, resolved as its `validate_args` resolves them
    args.position_embedding_type = positions.position_embedding_type(args)
    args.recompute_granularity = recompute_granularity(args)
    settings = validate_plugin_args(args, world_size)
    settings.write_back(args)

    L = args.seq_length
    _require(args.max_position_embeddings is None or args.max_position_embeddings >= L,
             f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length {L}; "
             f"raise it or drop it (default: --seq-length)")
    args.max_position_embeddings = args.max_position_embeddings or L
    if settings.tensor_parallel_size == 1:
        args.sequence_parallel = False

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
        check_host_memory(settings, args, on_accelerator)
        check_output_paths(args, settings)
    return settings


def validate_args(args: argparse.Namespace, world_size: int, **options) -> argparse.Namespace:
    """`validate`, for callers that need only the filled-in arguments."""
    validate(args, world_size, **options)
    return args


def _validate_lr_schedule(args: argparse.Namespace) -> None:
    """Megatron-LM's decay length when not given: `--train-iters` (its warmup is checked in `check_shared_values`:
    iterations, or a fraction of the decay length, `--lr-warmup-fraction`)."""
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
