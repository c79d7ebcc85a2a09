"""The megatron-core forward step of the BDLM objective: a micro-batch read on this rank, its rows through the
model, the loss (with Megatron's rerun checks).

API::

    forward_step = BDLMForwardStep(objective, layout)   # layout: this rank's CSBPLayout / CPLayout
    forward_step(data_iterator, model) -> (per_token_ce, partial(loss_func, loss_weights, num_tokens, parts=...))
                                           # each model checked against the step on its first micro-batch

The batch that `data_iterator` yields is a dict with `tokens [b, L]` (clean `x0`), `sample_index [b]`
(global sample indices, e.g. the `idx` a GPTDataset was asked for) and optionally `loss_mask [b, L]`
(1 where token `j` of `x0` is supervised; aligned with `tokens`, NOT with shifted AR labels — the
GPTDataset's own `loss_mask` is shifted and always drops the last token). Every rank of a model replica
(TP, block-parallel, first and last pipeline stage) must get the same samples; the noise is then the
same everywhere because it depends on `(seed, sample index)` alone.
"""

from dataclasses import dataclass
from functools import partial

import torch

from megatron_csbp.bdlm.objective import BDLMObjective, loss_func
from megatron_csbp.core.device import default_device


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _sample_index(batch):
    _require("sample_index" in batch,
             "the batch has no 'sample_index': BDLM noise is drawn from (seed, sample index); make the dataset "
             "return {'tokens': ..., 'sample_index': idx} (megatron_csbp.training.providers.SampleIndexed does)")
    return batch["sample_index"]


def _unwrapped(model):
    """The model inside Megatron's wrappers (DDP, Float16Module), which keep it as `.module`."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _check_model_matches(objective, layout, model):
    """A model built for another layout or MASK id would train on the wrong rows or score the MASK logit."""
    inner = _unwrapped(model)
    model_layout = getattr(inner, "layout", layout)
    _require(model_layout == layout, f"the model was built for {model_layout}, the forward step for {layout}: "
                                     f"build both from the same layout of this rank")
    model_mask = getattr(inner, "mask_token_id", objective.mask_token_id)
    _require(model_mask == objective.mask_token_id,
             f"the model excludes the logit of mask_token_id={model_mask}, the objective masks with "
             f"--bdlm-mask-token-id={objective.mask_token_id}: give the model the objective's id")
    clean_logits = getattr(inner, "clean_logits", bool(objective.ar_loss_weight))
    _require(clean_logits == bool(objective.ar_loss_weight),
             f"the model's LM head {'runs' if clean_logits else 'does not run'} over the clean rows, and the "
             f"objective's --bdlm-ar-loss-weight is {objective.ar_loss_weight}: build the model with "
             f"clean_logits={bool(objective.ar_loss_weight)}")
    takes_signal = getattr(inner, "self_conditioning", None) is not None or not getattr(inner, "pre_process", True)
    _require(takes_signal or not objective.self_conditioning_probability,
             f"the objective self-conditions samples (--bdlm-self-conditioning-probability "
             f"{objective.self_conditioning_probability}) but the model has no self-conditioning block: build it with "
             f"self_conditioning=True")


def checked_loss_func(loss_weights, num_tokens, output_tensor, *, parts=None, check_results=False,
                      check_spiky_loss=False):
    """`loss_func`, then Megatron's rerun state machine on this rank's loss, as `pretrain_gpt.py` does: NaN/Inf
    are fatal (`--check-for-nan-in-loss-and-grad`), a loss 10x the largest seen is flagged
    (`--check-for-spiky-loss`). The machine does nothing in its disabled mode (our own loop's)."""
    loss, num_tokens, report = loss_func(loss_weights, num_tokens, output_tensor, parts)
    if check_results or check_spiky_loss:
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        machine = get_rerun_state_machine()
        if check_results:
            for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
                machine.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                        message=f"found {what} in local forward loss calculation")
        if check_spiky_loss:
            machine.validate_result(result=loss, rejection_func=partial(machine.is_unexpectedly_large, threshold=10,
                                                                        context="loss"),
                                    message="Spiky loss", tolerance=0.0, fatal=False)
    return loss, num_tokens, report


def batch_on_this_rank(data_iterator):
    """This micro-batch's `tokens`, `sample_index` and `loss_mask` (where the data has one, SFT): read at TP rank 0,
    broadcast to the other TP ranks in one `broadcast_data` (as `pretrain_gpt.py`'s `get_batch_on_this_tp_rank`:
    only TP rank 0 builds the datasets). A batch without a mask sends a one-element stand-in in its place, so the
    other ranks learn from its shape that there is none. Without tensor parallelism (or Megatron's groups) the rank
    reads its own."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import broadcast_data

    tp_group = mpu.get_tensor_model_parallel_group(check_initialized=False)
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return next(data_iterator)
    keys = ("tokens", "sample_index", "loss_mask")
    batch = None
    if dist.get_rank(tp_group) == 0:
        batch = next(data_iterator)
        tokens, sample_index, loss_mask = (torch.as_tensor(batch["tokens"]).long(),
                                           torch.as_tensor(_sample_index(batch)).long(), batch.get("loss_mask"))
        if loss_mask is not None:
            loss_mask = torch.as_tensor(loss_mask).long()
            _require(loss_mask.shape == tokens.shape, f"loss_mask {tuple(loss_mask.shape)} must match tokens "
                                                      f"{tuple(tokens.shape)}")
        batch = dict(tokens=tokens, sample_index=sample_index,
                     loss_mask=torch.zeros(1, dtype=torch.long) if loss_mask is None else loss_mask)
    received = broadcast_data(list(keys), batch, torch.int64, tp_group=tp_group)
    loss_mask = received.pop("loss_mask")
    if loss_mask.dim() == 2:  # [b, L]: the data's mask; the stand-in is 1-D
        received["loss_mask"] = loss_mask.bool()
    return received


@dataclass(frozen=True)
class Packing:
    """Megatron-LM's packed-document flags, read at each EOD token (`eod`) of the batch's tokens: a document ends
    with its EOD. `reset_position_ids`: RoPE positions restart at each document; `reset_attention_mask`: no
    row of either copy attends across a document, and each sample's noisy blocks are dealt to the ranks by
    their documents' work (`core.documents.balanced_layout`); `eod_mask_loss`: EOD tokens are never supervised."""

    eod: int | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def splits(self) -> bool:
        """Whether the batch's documents matter to the rows (positions or attention)."""
        return self.reset_position_ids or self.reset_attention_mask

    def rows(self, objective, batch, layout):
        """The objective's rows of `batch` under these flags."""
        from megatron_csbp.core.documents import Documents, balanced_layout, document_ids

        tokens, loss_mask = torch.as_tensor(batch["tokens"]).cpu(), batch.get("loss_mask")
        if self.eod_mask_loss:
            kept = tokens != self.eod
            loss_mask = kept if loss_mask is None else torch.as_tensor(loss_mask).cpu().bool() & kept
        documents = document_ids(tokens, self.eod) if self.splits else None
        dealt = None
        if self.reset_attention_mask:  # each sample's blocks dealt by its documents' work (the attention does the same)
            dealt = [balanced_layout(layout, Documents.from_ids(ids)) for ids in documents]
        return objective.rows(tokens, _sample_index(batch), layout, loss_mask, documents=documents,
                              reset_positions=self.reset_position_ids, separate_documents=self.reset_attention_mask,
                              sample_layouts=dealt)


class BDLMForwardStep:
    """`forward_step(data_iterator, model)` for megatron-core's `get_forward_backward_func`.

    First and last pipeline stages take one micro-batch (the first needs the rows, the last the labels
    and weights; TP rank 0 reads it, the other TP ranks receive it); middle stages read nothing and only
    pass the row positions. A model (each chunk under virtual pipelining) is checked against the step once,
    on its first micro-batch: the layout, the MASK id and the per-token loss a model is built with stay.
    """

    def __init__(self, objective: BDLMObjective, layout, *, check_results: bool = False,
                 check_spiky_loss: bool = False, packing: Packing | None = None):
        _require(layout.block_size == objective.block_size,
                 f"--bdlm-block-size={objective.block_size} differs from the layout's block_size={layout.block_size}")
        self.objective = objective
        self.layout = layout
        self.loss_func = partial(checked_loss_func, check_results=check_results, check_spiky_loss=check_spiky_loss)
        self.packing = packing if packing is not None else Packing()
        _require(self.packing.eod is not None or not (self.packing.splits or self.packing.eod_mask_loss),
                 "--reset-position-ids, --reset-attention-mask and --eod-mask-loss need the tokenizer's EOD id")
        self._checked_models = []  # held: a freed model's identity can never pass for a new model's

    def _check_once(self, model) -> None:
        from megatron.core.utils import get_model_config

        if any(model is checked for checked in self._checked_models):
            return
        _require(get_model_config(model).calculate_per_token_loss,
                 "BDLM needs --calculate-per-token-loss (TransformerConfig.calculate_per_token_loss=True): the loss "
                 "is normalised by the token count of the whole global batch, not averaged per rank")
        _check_model_matches(self.objective, self.layout, model)
        self._checked_models.append(model)

    def __call__(self, data_iterator, model):
        from megatron.core.utils import get_attr_wrapped_model

        self._check_once(model)
        first_stage = get_attr_wrapped_model(model, "pre_process")
        last_stage = get_attr_wrapped_model(model, "post_process")
        if not (first_stage or last_stage):
            _require(not self.packing.splits, "packed documents (--reset-position-ids / --reset-attention-mask) need "
                     "every pipeline stage to read the batch; middle stages do not: use at most 2 pipeline stages "
                     "and no virtual pipeline")
            positions = self.layout.row_positions.unsqueeze(0).to(default_device())
            return model(None, positions, attention_mask=None), partial(self.loss_func, None, None)
        batch = batch_on_this_rank(data_iterator)
        rows = self.packing.rows(self.objective, batch, self.layout)
        conditioning = {} if rows.self_conditioned is None else {"self_conditioned": rows.self_conditioned}
        output = model(rows.input_ids if first_stage else None, rows.position_ids, attention_mask=rows.document_ids,
                       labels=rows.labels if last_stage else None, **conditioning)
        return output, partial(self.loss_func, rows.loss_weights, rows.num_tokens, parts=rows.parts)
