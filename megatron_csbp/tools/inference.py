"""Loading one of our checkpoints for inference: its directory, the training arguments it recorded, the model.

Shared by `scripts/generate_bdlm.py` (sampling) and `megatron_csbp.tools.harness` (lm-evaluation-harness), so
both read a checkpoint the same way: the model, tokenizer, block size, MASK id and objective come from the
arguments the checkpoint recorded (`--config FILE.yaml` overrides every key it sets), set up for one model
replica over `--tensor-model-parallel-size` ranks (no pipeline, context or block parallelism).
Refusals are `ConfigError`s of one line that name the flag.
"""

import argparse
import os

from megatron_csbp.core.rules import ConfigError


def checkpoint_directory(load: str) -> str:
    """The checkpoint `--load` names: a `--save` directory's latest (verified complete later), or one
    `iter_XXXXXXX` directory itself."""
    from megatron_csbp.training import checkpointing

    if os.path.isfile(os.path.join(load, checkpointing.MANIFEST)):
        return load
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load}: no such directory; give the --save directory of a training run")
    return checkpointing.checkpoint_dir(load, checkpointing.find_checkpoint(load, fallback=False))


def model_args(directory: str, config: str | None, tensor_parallel: int) -> argparse.Namespace:
    """The training arguments of the checkpoint (then `--config`), set up for one model replica over TP."""
    from megatron_csbp.training import checkpointing
    from megatron_csbp.training.flags import build_parser as training_parser
    from megatron_csbp.training.flags import null_as_byte_tokenizer
    from megatron_csbp.training.config import parse_args
    from megatron_csbp.core import rules
    from megatron_csbp.training.tokenizers import build_tokenizer

    checkpointing.check_complete(directory)
    try:
        saved = checkpointing.saved_args(checkpointing.common_state(directory))
    except Exception as error:
        raise ConfigError(f"checkpoint {directory} is corrupt: its common state cannot be read ({error})") from None
    if not saved:
        raise ConfigError(f"checkpoint {directory} records no training arguments: it was not written by "
                          f"megatron_csbp's training loop (scripts/pretrain_bdlm.py)")
    args = training_parser().parse_args([])
    vars(args).update(saved)
    if config is not None:  # every key the YAML sets, whatever its value (the parser's default too)
        from megatron_csbp.training.config import load_config

        parser = training_parser()
        given = vars(parse_args(["--config", config]))
        vars(args).update({parser_dest(parser, name): given[parser_dest(parser, name)]
                           for name in load_config(config, parser)})
    args.tensor_model_parallel_size = tensor_parallel
    args.tokenizer = build_tokenizer(null_as_byte_tokenizer(args))
    # The MASK id and the real ids are the checkpoint's; the padding is this TP size's (the real rows load into
    # any padding, and no padding id is ever produced). A checkpoint recording no real ids keeps its padding.
    args.mask_token_id, args.padded_vocab_size = saved["mask_token_id"], saved["padded_vocab_size"]
    if "vocab_ids" in saved:
        args.padded_vocab_size = rules.padded_vocab_size(saved["vocab_ids"], args.make_vocab_size_divisible_by,
                                                         tensor_parallel)
    args.pipeline_model_parallel_size = args.context_parallel_size = 1
    args.context_block_parallel, args.context_block_parallel_clean_shards = 1, None
    # every expert on this rank, split over TP as the dense layers are (torch_dist reshards the checkpoint's EP)
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = 1, tensor_parallel
    args.sequence_parallel = False
    problem = rules.tensor_parallel_problem(args.num_attention_heads, args.num_query_groups, tensor_parallel)
    if problem is None and args.padded_vocab_size % tensor_parallel:  # padded for the TP size it was trained at
        problem = (f"--tensor-model-parallel-size {tensor_parallel} does not divide the padded vocabulary "
                   f"{args.padded_vocab_size}; use a TP size dividing it")
    if problem:
        raise ConfigError(f"checkpoint {directory}: {problem}")
    return args


def parser_dest(parser: argparse.ArgumentParser, flag: str) -> str:
    """The attribute a flag name (`bdlm-objective`) is stored under."""
    return next(action.dest for action in parser._actions if f"--{flag}" in action.option_strings)


def build_model(args, directory: str | None):
    """The sampling model over this rank's TP shard, with the weights of checkpoint `directory` (None:
    freshly initialised, an untrained model)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.training import checkpointing, providers
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.core.clean_attention import CLEAN_ATTENTIONS
    from megatron_csbp.tools import sampling
    from megatron_csbp.training.megatron_config import transformer_config_from_args
    from megatron_csbp.core.device import default_device

    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, 1, context_block_parallel_size=1,
                                             clean_shards=1, distributed_timeout_minutes=args.distributed_timeout_minutes)
    model_parallel_cuda_manual_seed(args.seed)
    model = sampling.sampling_model(  # the GPTModel keywords RunProviders.model_provider gives the training model
        transformer_config_from_args(args), args.padded_vocab_size, args.bdlm_block_size,
        clean_attention=CLEAN_ATTENTIONS(args.bdlm_clean_attention),
        **providers.gpt_model_kwargs(args)).to(default_device())
    if directory is not None:
        checkpointing.load_checkpoint(directory, model, None, None, args, load_optimizer=False, load_rng=False,
                                      log=lambda *_: None)
    return model


