"""The three providers a Megatron pretraining run is built from: model, datasets, forward step.

Both entry paths call these very functions: Megatron-LM's `pretrain()` (where `args` is Megatron-LM's
global namespace, `megatron.training.get_args()`) and our own loop (`megatron_csbp.training`, which binds
its validated `args` with `functools.partial`). Everything that depends on this rank's place in the
block-parallel dimension (the row layout) is worked out when a provider is called, after Megatron's
parallel state exists.
"""

import argparse

import torch

from megatron_csbp.bdlm import BDLMForwardStep, BDLMObjective


def _megatron_lm_args() -> argparse.Namespace:
    from megatron.training import get_args
    return get_args()


def fill_vocabulary(args: argparse.Namespace) -> None:
    """Fills `args.mask_token_id` / `args.padded_vocab_size` (the MASK id follows the tokenizer's ids)."""
    if getattr(args, "mask_token_id", None) is None:
        from megatron_csbp.data import build_tokenizer
        build_tokenizer(args)


def clean_shards(args: argparse.Namespace) -> int:
    """`C`: the clean shards of the run's mode (1 for pure BP, `P` for the CP baseline)."""
    P = args.context_parallel_size
    if args.bdlm_parallel_mode == "bp":
        return 1
    if args.bdlm_parallel_mode == "cp":
        return P
    return getattr(args, "context_block_parallel_clean_shards", None) or P


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
    fill_vocabulary(args)
    return BDLMObjective(
        block_size=args.bdlm_block_size, mask_token_id=args.mask_token_id, objective=args.bdlm_objective,
        loss_weighting=args.bdlm_loss_weighting, noise_range=tuple(args.bdlm_noise_range),
        antithetic=args.bdlm_noise_sampling == "antithetic", antithetic_group=args.global_batch_size,
        seed=args.seed)


def model_provider(pre_process=True, post_process=True, vp_stage=None, *, args=None, config=None, **_):
    """This rank's `BDLMGPTModel` (Megatron-LM's `model_provider` signature)."""
    from megatron_csbp import model as bdlm_model
    from megatron_csbp import parallel_state
    from megatron_csbp.arguments import transformer_config_from_args

    args = args or _megatron_lm_args()
    fill_vocabulary(args)
    if not parallel_state.is_initialized():  # under Megatron-LM's pretrain(): add the CSBP sub-groups
        parallel_state.initialize_block_parallel_groups(clean_shards(args), args.distributed_timeout_minutes)
    return bdlm_model.model_provider(
        pre_process, post_process, config=config or transformer_config_from_args(args),
        layout=layout_from_args(args), vocab_size=args.padded_vocab_size, mask_token_id=args.mask_token_id,
        group=parallel_state.get_block_parallel_groups(), transport=args.csbp_transport, vp_stage=vp_stage,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        max_sequence_length=args.max_position_embeddings, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent)


class SampleIndexed(torch.utils.data.Dataset):
    """A GPTDataset whose samples also carry their index: BDLM noise is drawn from (seed, sample index)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return {"tokens": torch.as_tensor(self.dataset[index]["tokens"]), "sample_index": torch.tensor(index)}


def train_valid_test_datasets_provider(train_val_test_num_samples=None, *, args=None):
    """(train, valid, test) datasets of clean `L`-token samples with their indices (None: empty split)."""
    from megatron_csbp.data import build_datasets, build_tokenizer

    args = args or _megatron_lm_args()
    datasets = build_datasets(args, build_tokenizer(args))
    return tuple(None if dataset is None else SampleIndexed(dataset) for dataset in datasets)


train_valid_test_datasets_provider.is_distributed = True  # Megatron-LM: every rank calls it


_forward_steps = {}  # id(args) -> (args, step): a run's layout and objective are fixed, so build them once


def bdlm_forward_step(args: argparse.Namespace) -> BDLMForwardStep:
    """This run's BDLM forward step (objective and this rank's layout), built on first use."""
    if id(args) not in _forward_steps:
        _forward_steps[id(args)] = (args, BDLMForwardStep(objective_from_args(args), layout_from_args(args)))
    return _forward_steps[id(args)][1]


def forward_step(data_iterator, model, *, args=None):
    """Megatron's `forward_step(data_iterator, model) -> (output, loss_func)` for the BDLM objective."""
    return bdlm_forward_step(args or _megatron_lm_args())(data_iterator, model)
