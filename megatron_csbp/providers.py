"""The providers a Megatron pretraining run is built from: model, datasets, forward step, embedding ranks.

Both loops call these very functions, with the contracts of Megatron-LM's `pretrain_gpt.py` (tag
`core_v0.16.1`): under Megatron-LM's `pretrain()` they read its global `args` (`megatron.training.get_args()`),
its tokenizer and `core_transformer_config_from_args`; our own loop (`megatron_csbp.training`) binds its
validated `args` with `functools.partial(..., args=args)` and builds the config with
`arguments.transformer_config_from_args`. Everything that depends on this rank's place in the
block-parallel dimension (the row layout) is worked out when a provider is called, after Megatron's
parallel state exists.

As in `pretrain_gpt.py`, the datasets are built only on the first and last pipeline stages at TP rank 0
(`is_dataset_built_on_rank`); the forward step broadcasts each micro-batch over the TP group.
"""

import argparse
from functools import partial

import torch

from megatron_csbp.arguments import ConfigError, clean_shards
from megatron_csbp.bdlm import BDLMForwardStep, BDLMObjective


def _megatron_lm_args() -> argparse.Namespace:
    from megatron.training import get_args
    return get_args()


def _tokenizer(args: argparse.Namespace, megatron_lm: bool):
    """Megatron-LM's global tokenizer under `pretrain()`, else the plugin's (`data.build_tokenizer`)."""
    if megatron_lm:
        from megatron.training import get_tokenizer
        return get_tokenizer()
    from megatron_csbp.data import build_tokenizer
    return build_tokenizer(args)


def fill_vocabulary(args: argparse.Namespace, megatron_lm: bool = False) -> None:
    """Fills `args.mask_token_id` / `args.padded_vocab_size` from the run's tokenizer (`data.vocabulary`)."""
    if getattr(args, "bdlm_vocabulary_filled", False):
        return
    from megatron_csbp.data import vocabulary

    args.mask_token_id, args.padded_vocab_size = vocabulary(args, _tokenizer(args, megatron_lm))
    args.bdlm_vocabulary_filled = True


def layout_from_args(args: argparse.Namespace, block_parallel_rank: int | None = None):
    """This rank's row layout (CSBP, conventional CP or pure BP) for the run's mode."""
    from megatron_csbp.layout import layout_for
    from megatron_csbp.parallel_state import get_block_parallel_rank

    rank = get_block_parallel_rank() if block_parallel_rank is None else block_parallel_rank
    options = {} if args.bdlm_parallel_mode == "cp" else dict(schedule=args.csbp_block_schedule,
                                                              clean_layout=args.csbp_clean_layout)
    return layout_for(args.bdlm_parallel_mode, args.seq_length, args.bdlm_block_size, args.context_parallel_size,
                      clean_shards(args), rank, **options)


def objective_from_args(args: argparse.Namespace) -> BDLMObjective:
    """The BDLM objective; noise times are stratified over each global batch (`antithetic_group`)."""
    weighting = args.bdlm_loss_weighting or ("unit" if args.bdlm_objective == "fast-dllm-v2" else "inverse-t")
    return BDLMObjective(
        block_size=args.bdlm_block_size, mask_token_id=args.mask_token_id, objective=args.bdlm_objective,
        loss_weighting=weighting, noise_range=tuple(args.bdlm_noise_range),
        antithetic=args.bdlm_noise_sampling == "antithetic", antithetic_group=args.global_batch_size,
        seed=args.seed)


def _for_bdlm(config):
    """What every BDLM model config needs, whichever loop built it."""
    if config.pipeline_model_parallel_size > 1:
        # Pipeline stages exchange this rank's CSBP rows (|owned noisy| + L/C, uneven when the blocks do not
        # split evenly; twice the samples under Fast-dLLM v2), not Megatron's `seq_length / cp` x
        # micro-batch: the schedule must send each message's shape.
        config.variable_seq_lengths = True
        # megatron-core refuses variable_seq_lengths beside its default MoE dispatcher, even without MoE.
        config.moe_token_dispatcher_type = "alltoall"
    return config


def layer_spec_from_args(args: argparse.Namespace):
    """The layer spec to build from: `--spec MODULE NAME` where given, else Megatron's local or Transformer
    Engine spec (`--transformer-impl`); the CSBP core attention is swapped in by the model provider."""
    if getattr(args, "spec", None):
        from megatron.core.transformer.spec_utils import import_module
        try:
            return import_module(tuple(args.spec))
        except (ImportError, AttributeError, KeyError) as error:
            raise ConfigError(f"--spec {' '.join(args.spec)}: cannot be imported ({error}); give a module and the "
                              f"name of a ModuleSpec in it, e.g. --spec megatron_csbp.spec csbp_layer_spec") from None
    return None


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None, *,
                   args=None, **unused):
    """This rank's `BDLMGPTModel` (Megatron-LM's `model_provider` contract)."""
    from megatron_csbp import comm, parallel_state
    from megatron_csbp import model as bdlm_model

    megatron_lm = args is None
    args = args or _megatron_lm_args()
    fill_vocabulary(args, megatron_lm)
    if config is None:
        if megatron_lm:
            from megatron.training.arguments import core_transformer_config_from_args
            config = core_transformer_config_from_args(args)
        else:
            from megatron_csbp.arguments import transformer_config_from_args
            config = transformer_config_from_args(args)
    if not parallel_state.is_initialized():  # under Megatron-LM's pretrain(): add the CSBP sub-groups
        parallel_state.initialize_block_parallel_groups(clean_shards(args), args.distributed_timeout_minutes)
    comm.set_link(comm.SimulatedLink(args.link_gbps, args.link_latency_us) if args.link_gbps else None)
    return bdlm_model.model_provider(
        pre_process, post_process, config=_for_bdlm(config), layout=layout_from_args(args),
        vocab_size=args.padded_vocab_size, mask_token_id=args.mask_token_id,
        group=parallel_state.get_block_parallel_groups(), transport=args.csbp_transport, vp_stage=vp_stage,
        use_transformer_engine=args.transformer_impl == "transformer_engine", base_spec=layer_spec_from_args(args),
        pg_collection=pg_collection, **gpt_model_kwargs(args))


def gpt_model_kwargs(args: argparse.Namespace) -> dict:
    """The `GPTModel` keywords the flags decide (embeddings, RoPE): training's model and the sampler's alike."""
    return dict(share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                max_sequence_length=args.max_position_embeddings, rotary_base=args.rotary_base,
                rotary_percent=args.rotary_percent, rope_scaling=getattr(args, "use_rope_scaling", False),
                rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0))


def embedding_ranks(pp_ranks: list[int], tied: bool) -> list[int]:
    """The ranks holding word embeddings: the first stage, and the last where the output layer shares them."""
    return sorted({pp_ranks[0], *([pp_ranks[-1]] if tied else [])})


def get_embedding_ranks(pp_ranks: list[int], *, args=None) -> list[int]:
    """Megatron's `get_embedding_ranks` hook: untied embeddings under PP need no first/last-stage group."""
    args = args or _megatron_lm_args()
    return embedding_ranks(list(pp_ranks), not args.untie_embeddings_and_output_weights)


def is_dataset_built_on_rank(vp_stage=None) -> bool:
    """`pretrain_gpt.py`'s rule: first or last pipeline stage, TP rank 0 (the others get batches by broadcast)."""
    from megatron.core import parallel_state as mpu

    first = mpu.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = mpu.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    return (first or last) and mpu.get_tensor_model_parallel_rank() == 0


class SampleIndexed(torch.utils.data.Dataset):
    """A GPTDataset whose samples also carry their index: BDLM noise is drawn from (seed, sample index)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return {"tokens": torch.as_tensor(self.dataset[index]["tokens"]), "sample_index": torch.tensor(index)}


def train_valid_test_datasets_provider(train_val_test_num_samples=None, vp_stage=None, *, args=None):
    """(train, valid, test) datasets of clean `L`-token samples with their indices (None: empty split, or not
    built on this rank), sized by Megatron-LM's sample counts."""
    from megatron_csbp.data import build_datasets, split_sizes

    megatron_lm = args is None
    args = args or _megatron_lm_args()
    sizes = list(train_val_test_num_samples) if train_val_test_num_samples is not None else split_sizes(args)
    datasets = build_datasets(args, _tokenizer(args, megatron_lm), sizes=sizes,
                              is_built_on_rank=partial(is_dataset_built_on_rank, vp_stage))
    return tuple(None if dataset is None else SampleIndexed(dataset) for dataset in datasets)


train_valid_test_datasets_provider.is_distributed = True  # Megatron-LM: every rank calls it


_forward_steps = {}  # id(args) -> (args, step): a run's layout and objective are fixed, so build them once


def bdlm_forward_step(args: argparse.Namespace, megatron_lm: bool = False) -> BDLMForwardStep:
    """This run's BDLM forward step (objective and this rank's layout), built on first use."""
    if id(args) not in _forward_steps:
        fill_vocabulary(args, megatron_lm)
        step = BDLMForwardStep(objective_from_args(args), layout_from_args(args),
                               check_results=getattr(args, "check_for_nan_in_loss_and_grad", False),
                               check_spiky_loss=getattr(args, "check_for_spiky_loss", False))
        _forward_steps[id(args)] = (args, step)
    return _forward_steps[id(args)][1]


def forward_step(data_iterator, model, checkpoint_activations_microbatch=None, return_schedule_plan=False, *,
                 args=None):
    """Megatron's `forward_step(data_iterator, model) -> (output, loss_func)` for the BDLM objective.

    Takes the extra arguments Megatron-LM's schedules may pass, refusing those the BDLM step cannot honour.
    """
    if checkpoint_activations_microbatch is not None:
        raise ConfigError("--num-microbatches-with-partial-activation-checkpoints is not supported by the BDLM "
                          "forward step; use --recompute-granularity full (all micro-batches) or drop it")
    if return_schedule_plan:
        raise ConfigError("--overlap-moe-expert-parallel-comm (schedule plans) is not supported with BDLM; drop it")
    megatron_lm = args is None
    return bdlm_forward_step(args or _megatron_lm_args(), megatron_lm)(data_iterator, model)
