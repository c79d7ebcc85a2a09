"""The providers a Megatron pretraining run is built from: model, datasets, forward step, embedding ranks.

Both loops call the same providers, with the contracts of Megatron-LM's `pretrain_gpt.py` (tag
`core_v0.16.1`): they are the bound methods of one `RunProviders`, made at the loop's entry. Our own loop
(`megatron_csbp.training.loop`) makes `RunProviders(args)` with its validated `args` (the config comes from
`megatron_config.transformer_config_from_args`); Megatron-LM's `pretrain()`, which parses its arguments itself, is
given the methods of a `RunProviders()`, which reads Megatron-LM's global `args`, tokenizer and
`core_transformer_config_from_args` when first called.

The run is built once. The first provider call that needs it assembles the `BDLMRun` of this rank, after
Megatron's parallel state exists (the row layout depends on this rank's place in the block-parallel
dimension): the vocabulary and MASK id, the layout, the objective, the attention context, the
`TransformerConfig` and the forward step. The model and the forward step are both made from it, so nothing
downstream rebuilds or cross-checks any of it.

As in `pretrain_gpt.py`, the datasets are built only on the first and last pipeline stages at TP rank 0
(`is_dataset_built_on_rank`); the forward step broadcasts each micro-batch over the TP group.
"""

import argparse
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from megatron_csbp.core.positions import RotaryPositions
from megatron_csbp.core.rules import ConfigError
from megatron_csbp.core.run_config import RunConfig
from megatron_csbp.bdlm.forward_step import BDLMForwardStep, Packing
from megatron_csbp.bdlm.objective import BDLMObjective
from megatron_csbp.data.tokenizers import Vocabulary

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.mcore.spec import AttentionContext


def _megatron_lm_args() -> argparse.Namespace:
    from megatron.training import get_args
    return get_args()


def objective_for(settings: RunConfig, mask_token_id: int, vocab_ids: int | None = None) -> BDLMObjective:
    """The BDLM objective of the run; noise times are stratified over each global batch (`antithetic_group`);
    `vocab_ids`: the model's real ids (MASK included), which a uniform-state corruption draws from."""
    return BDLMObjective(
        block_size=settings.block_size, mask_token_id=mask_token_id, objective=settings.objective,
        loss_weighting=settings.loss_weighting, noise_range=settings.noise_range,
        antithetic=settings.antithetic_noise, antithetic_group=settings.global_batch_size, seed=settings.seed,
        diffusion_loss_weight=settings.diffusion_loss_weight, ar_loss_weight=settings.ar_loss_weight,
        vocab_ids=vocab_ids, self_conditioning_probability=settings.self_conditioning_probability)


def for_bdlm(config):
    """What every BDLM model config needs, whichever loop built it."""
    if config.pipeline_model_parallel_size > 1:
        # Pipeline stages exchange this rank's CSBP rows (|owned noisy| + L/C, uneven when the blocks do not
        # split evenly; twice the samples under Fast-dLLM v2), not Megatron's `seq_length / cp` x
        # micro-batch: the schedule must send each message's shape.
        config.variable_seq_lengths = True
        # megatron-core refuses variable_seq_lengths beside its default MoE dispatcher, even without MoE (with
        # MoE the flag chose alltoall: `rules.moe_problem` refuses allgather under PP).
        if not config.num_moe_experts:
            config.moe_token_dispatcher_type = "alltoall"
    return config


def layer_spec_from_args(args: argparse.Namespace):
    """The layer spec to build from: `--spec MODULE NAME` where given, else Megatron's local or Transformer
    Engine spec (`--transformer-impl`); the CSBP core attention is swapped in by the model provider."""
    if args.spec:
        from megatron.core.transformer.spec_utils import import_module
        try:
            return import_module(tuple(args.spec))
        except (ImportError, AttributeError, KeyError) as error:
            raise ConfigError(f"--spec {' '.join(args.spec)}: cannot be imported ({error}); give a module and the "
                              f"name of a ModuleSpec in it, e.g. --spec megatron_csbp.mcore.spec csbp_layer_spec") from None
    return None


def gpt_model_kwargs(args: argparse.Namespace, positions: RotaryPositions | None = None) -> dict:
    """The `GPTModel` keywords the flags decide (embeddings, RoPE): training's model and the sampler's alike;
    `positions` (YaRN, the query scaling: the run's, else read off `args`, a checkpoint's record) is ours, which
    both models take."""
    positions = positions or RotaryPositions.from_args(args)
    return dict(share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                max_sequence_length=args.max_position_embeddings, rotary_base=args.rotary_base,
                rotary_percent=args.rotary_percent, rope_scaling=args.use_rope_scaling,
                rope_scaling_factor=args.rope_scaling_factor, position_embedding_type=positions.embedding_type,
                positions=positions)


def embedding_ranks(pp_ranks: list[int], tied: bool) -> list[int]:
    """The ranks holding word embeddings: the first stage, and the last where the output layer shares them."""
    return sorted({pp_ranks[0], *([pp_ranks[-1]] if tied else [])})


def is_dataset_built_on_rank(vp_stage=None) -> bool:
    """`pretrain_gpt.py`'s rule: first or last pipeline stage, TP rank 0 (the others get batches by broadcast)."""
    from megatron.core import parallel_state as mpu

    first = mpu.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = mpu.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    return (first or last) and mpu.get_tensor_model_parallel_rank() == 0


class SampleIndexed(torch.utils.data.Dataset):
    """A GPTDataset whose samples also carry their index: BDLM noise is drawn from (seed, sample index); and
    their loss mask where the data has one (`loss_masks`: the same samples of the mask files, SFT data)."""

    def __init__(self, dataset, loss_masks=None):
        self.dataset = dataset
        self.loss_masks = loss_masks

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        sample = {"tokens": torch.as_tensor(self.dataset[index]["tokens"]), "sample_index": torch.tensor(index)}
        if self.loss_masks is not None:
            sample["loss_mask"] = torch.as_tensor(self.loss_masks[index]["tokens"]).bool()
        return sample


@dataclass(frozen=True)
class BDLMRun:
    """One run on this rank, assembled once (`build_run`) and handed to the model and the forward step."""

    settings: RunConfig  # the run's model shape, sequence, objective and layout, validated
    vocabulary: Vocabulary  # the tokenizer, the MASK id, the padded vocabulary
    attention: "AttentionContext"  # this rank's layout, the block-parallel groups, the K/V transport
    config: "TransformerConfig"  # the model's (`for_bdlm` applied); the schedule reads it off the model
    forward_step: BDLMForwardStep  # the objective and this rank's layout

    @property
    def layout(self):
        return self.attention.layout

    @property
    def objective(self) -> BDLMObjective:
        return self.forward_step.objective


def build_run(settings: RunConfig, vocabulary: Vocabulary, config: "TransformerConfig", *,
              check_results: bool = False, check_spiky_loss: bool = False) -> BDLMRun:
    """This rank's run, once Megatron's parallel state (with the CSBP sub-groups) exists: `settings` says what
    the run is; `check_results` and `check_spiky_loss` (Megatron-LM's flags) what its forward step checks."""
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.model import set_shape_config
    from megatron_csbp.mcore.spec import AttentionContext

    layout = settings.layout(parallel_state.get_block_parallel_rank())
    step = BDLMForwardStep(objective_for(settings, vocabulary.mask_token_id, vocabulary.num_ids), layout,
                           check_results=check_results, check_spiky_loss=check_spiky_loss,
                           packing=Packing(vocabulary.tokenizer.eod, settings.reset_position_ids,
                                           settings.reset_attention_mask, settings.eod_mask_loss))
    attention = AttentionContext(layout=layout, group=parallel_state.get_block_parallel_groups(),
                                 transport=settings.transport)
    config = for_bdlm(config)
    set_shape_config(config, settings.shape)
    return BDLMRun(settings, vocabulary, attention, config, step)


class RunProviders:
    """One run's providers, as bound methods (Megatron-LM's `model_provider`, `forward_step`,
    `train_valid_test_datasets_provider`, `get_embedding_ranks`).

    `args`: our loop's validated arguments; None under Megatron-LM's `pretrain()`, whose global `args` and
    tokenizer are read once it has parsed them. `settings`: the run's `RunConfig` where validation built it
    already (else built from the arguments, once). `vocabulary`: a vocabulary already fixed (a checkpoint's, on
    another TP size), else worked out from the tokenizer, once. The run (`run`) is built on first use.
    """

    def __init__(self, args: argparse.Namespace | None = None, vocabulary: Vocabulary | None = None,
                 settings: RunConfig | None = None):
        self._args = args
        self._vocabulary = vocabulary
        self._settings = settings
        self._run = None

    @property
    def megatron_lm(self) -> bool:
        return self._args is None

    @property
    def args(self) -> argparse.Namespace:
        return _megatron_lm_args() if self.megatron_lm else self._args

    @property
    def vocabulary(self) -> Vocabulary:
        """The run's tokenizer (Megatron-LM's under `pretrain()`, else `tokenizers.build_tokenizer`'s), MASK id and
        padded vocabulary: needs no parallel state, so the datasets provider may come first."""
        if self._vocabulary is None:
            if self.megatron_lm:
                from megatron.training import get_tokenizer

                args = self.args
                self._vocabulary = Vocabulary.from_args(args, get_tokenizer())
                # Megatron-LM's args are its checkpoints' record and its FLOPs count's input: they hold the
                # model's vocabulary (MASK included), as our loop's checkpoints do (`Vocabulary.recorded`).
                for name, value in self._vocabulary.arguments().items():
                    setattr(args, name, value)
            else:
                self._vocabulary = Vocabulary.from_args(self.args)
        return self._vocabulary

    @property
    def settings(self) -> RunConfig:
        """The run's `RunConfig`, built once from the (validated) arguments; needs no parallel state."""
        if self._settings is None:
            self._settings = RunConfig.from_args(self.args)
        return self._settings

    @property
    def run(self) -> BDLMRun:
        if self._run is None:
            self._run = self._build_run()
        return self._run

    def _build_run(self) -> BDLMRun:
        from megatron_csbp.core import comm
        from megatron_csbp.mcore import parallel_state

        args = self.args
        if not parallel_state.is_initialized():  # under Megatron-LM's pretrain(): add the CSBP sub-groups
            parallel_state.initialize_block_parallel_groups(self.settings.clean_shards,
                                                            args.distributed_timeout_minutes)
        comm.set_link(comm.SimulatedLink(args.link_gbps, args.link_latency_us) if args.link_gbps else None)
        if self.megatron_lm:
            from megatron.training.arguments import core_transformer_config_from_args as config_from_args
        else:
            from megatron_csbp.training.megatron_config import transformer_config_from_args as config_from_args
        # Megatron-LM's result checks (its flags; our loop checks every step's loss and grad norm itself)
        checks = dict(check_results=args.check_for_nan_in_loss_and_grad,
                      check_spiky_loss=args.check_for_spiky_loss) if self.megatron_lm else {}
        return build_run(self.settings, self.vocabulary, config_from_args(args), **checks)

    def model_provider(self, pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None,
                       **unused):
        """This rank's `BDLMGPTModel`, on the run's config unless Megatron-LM gives one (`get_model(config=)`)."""
        from megatron_csbp.mcore import model as bdlm_model

        args, run = self.args, self.run
        return bdlm_model.model_provider(
            pre_process, post_process, config=run.config if config is None else for_bdlm(config),
            context=run.attention, vocab_size=run.vocabulary.padded_vocab_size,
            mask_token_id=run.vocabulary.mask_token_id, vocab_ids=run.vocabulary.num_ids, vp_stage=vp_stage,
            use_transformer_engine=args.transformer_impl == "transformer_engine",
            base_spec=layer_spec_from_args(args), pg_collection=pg_collection,
            per_sample_positions=self.settings.packed, clean_logits=self.settings.clean_logits,
            logits_tile_rows=self.settings.logits_tile_rows, **self.settings.model_ends,
            **gpt_model_kwargs(args, self.settings.positions))

    def train_valid_test_datasets_provider(self, train_val_test_num_samples=None, vp_stage=None):
        """(train, valid, test) datasets of clean `L`-token samples with their indices and, for SFT data, their loss
        masks (None: empty split, or not built on this rank), sized by Megatron-LM's sample counts."""
        from megatron_csbp.data.datasets import build_datasets, build_loss_mask_datasets, split_sizes

        args = self.args
        sizes = list(train_val_test_num_samples) if train_val_test_num_samples is not None else split_sizes(args)
        on_rank = partial(is_dataset_built_on_rank, vp_stage)
        datasets = build_datasets(args, self.vocabulary, sizes=sizes, is_built_on_rank=on_rank)
        masks = build_loss_mask_datasets(args, self.vocabulary, sizes=sizes, is_built_on_rank=on_rank)
        masks = masks or (None,) * len(datasets)
        return tuple(None if dataset is None else SampleIndexed(dataset, mask)
                     for dataset, mask in zip(datasets, masks))

    train_valid_test_datasets_provider.is_distributed = True  # Megatron-LM: every rank calls it

    def forward_step(self, data_iterator, model, checkpoint_activations_microbatch=None, return_schedule_plan=False):
        """Megatron's `forward_step(data_iterator, model) -> (output, loss_func)`: the run's BDLM forward step.

        Takes the extra arguments Megatron-LM's schedules may pass, refusing those the BDLM step cannot honour.
        """
        if checkpoint_activations_microbatch is not None:
            raise ConfigError("--num-microbatches-with-partial-activation-checkpoints is not supported by the BDLM "
                              "forward step; use --recompute-granularity full (all micro-batches) or drop it")
        if return_schedule_plan:
            raise ConfigError("--overlap-moe-expert-parallel-comm (schedule plans) is not supported with BDLM; "
                              "drop it")
        return self.run.forward_step(data_iterator, model)

    def get_embedding_ranks(self, pp_ranks: list[int]) -> list[int]:
        """Megatron's `get_embedding_ranks` hook: untied embeddings under PP need no first/last-stage group."""
        return embedding_ranks(list(pp_ranks), not self.args.untie_embeddings_and_output_weights)
