"""Reading one of our checkpoints for another launch: the one place its recorded arguments meet the launch's.

Every command that loads a trained model — sampling (`scripts/generate_bdlm.py`), the lm-evaluation-harness
model (`megatron_csbp.tools.harness`), the NELBO evaluator (`scripts/evaluate_bdlm.py`) and the HF export
(`scripts/convert_hf.py export`) — reads it here, the same way (as Megatron-LM reads one with its
`load_args_from_checkpoint`):

* `--load` has one meaning: an `iter_XXXXXXX` directory, or a `--save` directory, whose tracker names the
  iteration (`read_checkpoint`);
* the model, tokenizer, objective, block size and MASK id are the arguments the checkpoint recorded, over the
  trainer's defaults (for keys an older checkpoint lacks), then every key a training YAML (`--config`) sets,
  then what the launch says of its own run (its data, its mode), then its layout (`Launch`); a mixture of
  experts has every expert on each rank (torch_dist reshards the checkpoint's EP) (`launch_arguments`);
* the vocabulary is the checkpoint's MASK id and real ids, padded for this launch's TP size (the real rows load
  into any padding); a checkpoint recording no real ids keeps its padding, which the TP size must divide.

Refusals are `ConfigError`s of one line that name the flag.
"""

import argparse
import os
from dataclasses import dataclass

from megatron_csbp.core.rules import ConfigError


@dataclass(frozen=True)
class Checkpoint:
    """One of our checkpoints: its `iter_XXXXXXX` directory, iteration and recorded training arguments."""

    directory: str
    iteration: int
    recorded: dict


def read_checkpoint(load: str, *, verify: bool = True, log=print) -> Checkpoint:
    """The checkpoint `--load` names and the arguments it recorded (its common state, through the allow-list).
    `verify`: its files checked against their manifest now (a command with one process, before any work);
    without, when they are loaded (collectively, by every rank of a launch)."""
    from megatron_csbp.training import checkpointing

    if os.path.isfile(os.path.join(load, checkpointing.MANIFEST)):
        directory = load
    else:
        if not os.path.isdir(load):
            raise ConfigError(f"--load {load}: no such directory; give the --save directory of a training run")
        iteration = checkpointing.read_tracker(load)
        if iteration is None:
            raise ConfigError(f"--load {load}: no checkpoint there (no {checkpointing.TRACKER}); give the --save "
                              f"directory of a training run")
        directory = checkpointing.checkpoint_dir(load, iteration)
        if not os.path.isdir(directory):
            raise ConfigError(f"--load {load}: {checkpointing.TRACKER} names iteration {iteration}, but {directory} "
                              f"is missing; restore it or give another --load")
    if verify:
        checkpointing.verify(directory, log=log)
    common = checkpointing.common_state(directory)
    recorded = checkpointing.saved_args(common)
    if not recorded:
        raise ConfigError(f"checkpoint {directory} records no training arguments: it was not written by "
                          f"scripts/pretrain_bdlm.py (or Megatron-LM's pretrain with the plugin)")
    return Checkpoint(directory, int(common.get("iteration", 0)), recorded)


@dataclass(frozen=True)
class Launch:
    """How this launch lays a checkpoint's model out (the trainer's flag meanings): any layout it loads into."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    block_parallel_size: int = 1
    clean_shards: int | None = None
    sequence_parallel: bool = False


def launch_arguments(checkpoint: Checkpoint, launch: Launch = Launch(), *, config: str | None = None, **values):
    """`(args, vocabulary)`: the checkpoint's recorded training arguments for this launch (the module docstring's
    order: recorded, `config`'s keys, `values`, `launch`'s layout) and its vocabulary (`tokenizers.Vocabulary`)."""
    from megatron_csbp.core import rules
    from megatron_csbp.training.config import load_config, parse_args
    from megatron_csbp.training.flags import build_parser as training_parser
    from megatron_csbp.training.flags import null_as_byte_tokenizer
    from megatron_csbp.data.tokenizers import Vocabulary, build_tokenizer

    recorded, TP = checkpoint.recorded, launch.tensor_parallel_size
    args = training_parser().parse_args([])
    vars(args).update(recorded)
    if config is not None:  # every key the YAML sets, whatever its value (the parser's default too)
        parser = training_parser()
        given = vars(parse_args(["--config", config]))
        vars(args).update({parser_dest(parser, name): given[parser_dest(parser, name)]
                           for name in load_config(config, parser)})
    vars(args).update(values)
    P = launch.block_parallel_size
    vars(args).update(tensor_model_parallel_size=TP, pipeline_model_parallel_size=launch.pipeline_parallel_size,
                      context_block_parallel=P, context_parallel_size=P,
                      context_block_parallel_clean_shards=launch.clean_shards,
                      sequence_parallel=launch.sequence_parallel and TP > 1,
                      expert_model_parallel_size=1, expert_tensor_parallel_size=None)
    null_as_byte_tokenizer(args)
    padded = recorded["padded_vocab_size"]
    if "vocab_ids" in recorded:  # the real rows load into any TP's padding
        padded = rules.padded_vocab_size(recorded["vocab_ids"], args.make_vocab_size_divisible_by, TP)
    elif padded % TP:
        raise ConfigError(f"checkpoint {checkpoint.directory}: --tensor-model-parallel-size {TP} does not divide "
                          f"its padded vocabulary {padded}; use a TP size dividing it")
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    problem = rules.tensor_parallel_problem(args.num_attention_heads, groups, TP)
    if problem:
        raise ConfigError(f"checkpoint {checkpoint.directory}: {problem}")
    vocabulary = Vocabulary(build_tokenizer(args), recorded["mask_token_id"], padded)
    return args, vocabulary


def model_args(checkpoint: Checkpoint, config: str | None, tensor_parallel: int) -> argparse.Namespace:
    """The checkpoint's arguments (then `--config`) for one sampling replica over `tensor_parallel` ranks (no
    pipeline, context or block parallelism), its vocabulary on them (`tokenizer`, `mask_token_id`,
    `padded_vocab_size`), as the sampler and the harness read them."""
    from megatron_csbp.core.run_config import RunConfig

    args, vocabulary = launch_arguments(checkpoint, Launch(tensor_parallel), config=config)
    settings = RunConfig.from_args(args, world_size=tensor_parallel)
    settings.write_back(args)  # the sizes its configs read
    if settings.shape.linear is not None or settings.shape.attention_output_gate or settings.shape.layernorm_1p:
        raise ConfigError(f"checkpoint {checkpoint.directory} is a Gated DeltaNet hybrid (--experimental-attention-"
                          f"variant, --attention-output-gate or --apply-layernorm-1p): the sampler and the harness do "
                          f"not decode it yet; evaluate its loss with scripts/evaluate_bdlm.py")
    args = vocabulary.recorded(args)
    args.tokenizer = vocabulary.tokenizer
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
    from megatron_csbp.core.run_config import RunConfig
    from megatron_csbp.mcore.model import set_shape_config

    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, 1, context_block_parallel_size=1,
                                             clean_shards=1, distributed_timeout_minutes=args.distributed_timeout_minutes)
    model_parallel_cuda_manual_seed(args.seed)
    run = RunConfig.from_args(args, world_size=args.tensor_model_parallel_size)
    config = transformer_config_from_args(args)
    set_shape_config(config, run.shape)  # as training's (Gemma 4's layers)
    model = sampling.sampling_model(  # the GPTModel keywords RunProviders.model_provider gives the training model
        config, args.padded_vocab_size, args.bdlm_block_size,
        clean_attention=CLEAN_ATTENTIONS(args.bdlm_clean_attention), **run.model_ends,
        **providers.gpt_model_kwargs(args)).to(default_device())
    if directory is not None:
        checkpointing.load_checkpoint(directory, model, None, None, args, load_optimizer=False, load_rng=False,
                                      log=lambda *_: None)
    return model


