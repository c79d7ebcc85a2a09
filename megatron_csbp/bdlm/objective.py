"""The BDLM objective: deterministic noise, this rank's `[x_t ; x_0]` rows, the loss, the forward step.

API (what the model, the training loop and the tests use)::

    objective = BDLMObjective(block_size=B, mask_token_id=V, objective="bd3lm" | "fast-dllm-v2",
                              loss_weighting=None | "inverse-t" | "unit", noise_range=(1e-3, 1.0),
                              antithetic=True, antithetic_group=1, seed=1234)
    noise = objective.noise(sample_index [b], seq_length)      -> Noise(t [b, NB], masked [b, L])  (CPU)
    rows = objective.rows(tokens [b, L], sample_index [b], layout, loss_mask=None)
        -> Rows(input_ids [m, rows], position_ids [m, rows], labels [m, n_noisy],
                loss_weights [m, n_noisy], num_tokens int scalar)   on default_device();
           m = objective.views_per_sample * b: b for "bd3lm", 2b for "fast-dllm-v2" (give the schedule
           micro_batch_size = views_per_sample x the data's micro-batch size: it sizes pipeline messages)
    loss_func(loss_weights, num_tokens, per_token_ce [m, n_noisy])
        -> (loss_sum, num_tokens, {"lm loss": tensor([loss_sum, num_tokens])})
    forward_step = BDLMForwardStep(objective, layout)   # layout: this rank's CSBPLayout / CPLayout
    forward_step(data_iterator, model) -> (per_token_ce, partial(loss_func, loss_weights, num_tokens))
                                           # each model checked against the step on its first micro-batch

The batch that `data_iterator` yields is a dict with `tokens [b, L]` (clean `x0`), `sample_index [b]`
(global sample indices, e.g. the `idx` a GPTDataset was asked for) and optionally `loss_mask [b, L]`
(1 where token `j` of `x0` is supervised; aligned with `tokens`, NOT with shifted AR labels — the
GPTDataset's own `loss_mask` is shifted and always drops the last token). Every rank of a model replica
(TP, block-parallel, first and last pipeline stage) must get the same samples; the noise is then the
same everywhere because it depends on `(seed, sample index)` alone.

Noise. Sample `s` draws its mask from a generator seeded by `(seed, s)`. Noise times are antithetic:
samples `[g·G, (g+1)·G)` (`G = antithetic_group`) share one `u` drawn from `(seed, g)`, and the `N = G·NB`
(sample, block) pairs take `t_i = (u + i/N) mod 1` with `i = (s mod G)·NB + block`, mapped into
`[t_min, t_max]`. This is the batch-level stratification of docs/algorithm.md §2 when `G` is the global
batch size, yet a sample's noise never depends on how the batch is cut into micro-batches or DP shards.
Each token of block `b` is then replaced by MASK with probability `t_b`.

Normaliser. A rank counts the valid tokens at its own noisy positions; the noisy blocks of a layout
partition `[0, L)` over the block-parallel ranks, so Megatron's sum over dp×cp is the global count.

Fast-dLLM v2 (`objective="fast-dllm-v2"`): the micro-batch doubles to `[views with mask m ; views with
mask 1-m]` (rows `k` and `b+k` are sample `k`'s pair). Labels are shifted: noisy row `p` predicts
`x0[p+1]` and counts when token `p+1` is masked in its view, so every token `1..L-1` is supervised
exactly once per pair; the last row has no target (weight 0) and token 0 is never a target. The last
row of block `b` predicts the first token of block `b+1` from what it sees (its noisy block, earlier clean
blocks), so nothing leaks. Weights
are unit and the normaliser counts each target once per sample (not once per view).
"""

import hashlib
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from megatron_csbp.core import objectives, rules
from megatron_csbp.core.device import default_device


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _generator(seed: int, stream: str, index: int) -> torch.Generator:
    """A CPU generator that depends on `(seed, stream, index)` only, never on any global RNG state."""
    digest = hashlib.blake2b(f"{seed}/{stream}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


class Noise(NamedTuple):
    t: torch.Tensor  # [b, NB] float64, noise time of every (sample, block), in [t_min, t_max]
    masked: torch.Tensor  # [b, L] bool, token replaced by MASK in x_t


class Rows(NamedTuple):
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_weights: torch.Tensor
    num_tokens: torch.Tensor


@dataclass(frozen=True)
class BDLMObjective:
    """What the block-diffusion loss is: block size, MASK id, objective variant, weighting and noise."""

    block_size: int
    mask_token_id: int
    objective: str = "bd3lm"
    loss_weighting: str | None = None  # None: "inverse-t" for bd3lm, "unit" for fast-dllm-v2
    noise_range: tuple[float, float] = (1e-3, 1.0)
    antithetic: bool = True
    antithetic_group: int = 1
    seed: int = 1234

    def __post_init__(self):
        _require(isinstance(self.block_size, int) and self.block_size >= 1,
                 f"--bdlm-block-size={self.block_size!r} must be a positive integer")
        _require(isinstance(self.mask_token_id, int) and self.mask_token_id >= 0,
                 f"--bdlm-mask-token-id={self.mask_token_id!r} must be a non-negative vocabulary id "
                 f"(an extra id the data never uses, e.g. the tokenizer's vocabulary size)")
        rules.refuse(rules.loss_weighting_problem(self.objective, self.loss_weighting))
        weighting = self.loss_weighting or rules.default_loss_weighting(self.objective)
        object.__setattr__(self, "loss_weighting", weighting)
        _require(len(self.noise_range) == 2, f"--bdlm-noise-range={self.noise_range!r} takes two numbers: T_MIN T_MAX")
        t_min, t_max = (float(t) for t in self.noise_range)
        object.__setattr__(self, "noise_range", (t_min, t_max))
        rules.refuse(rules.noise_range_problem(t_min, t_max))
        _require(isinstance(self.antithetic_group, int) and self.antithetic_group >= 1,
                 f"antithetic_group={self.antithetic_group!r} must be a positive integer: the samples sharing one "
                 f"stratified draw (the training loop sets it to --global-batch-size)")
        _require(isinstance(self.seed, int) and self.seed >= 0, f"--seed={self.seed!r} must be a non-negative integer")

    @property
    def kind(self) -> objectives.ObjectiveKind:
        """The objective's own facts: views per sample, label shift, weightings, how noise becomes views."""
        return objectives.objective_kind(self.objective)

    @property
    def views_per_sample(self) -> int:
        """Model batch rows per clean sample: Fast-dLLM v2 scores each sample under a mask and its complement."""
        return self.kind.views_per_sample

    def noise(self, sample_index, seq_length: int) -> Noise:
        """Noise times and MASK positions of the samples `sample_index`, built on the CPU."""
        rules.refuse(rules.whole_blocks_problem(seq_length, self.block_size))
        num_blocks = seq_length // self.block_size
        group = self.antithetic_group
        strata = torch.arange(num_blocks, dtype=torch.float64)
        times, masked = [], []
        for sample in torch.as_tensor(sample_index).reshape(-1).tolist():
            draws = _generator(self.seed, "sample", sample)
            iid = torch.rand(num_blocks, generator=draws, dtype=torch.float64)
            mask_draw = torch.rand(seq_length, generator=draws, dtype=torch.float64)
            if self.antithetic:
                u = torch.rand((), generator=_generator(self.seed, "group", sample // group), dtype=torch.float64)
                unit = (u + ((sample % group) * num_blocks + strata) / (group * num_blocks)) % 1.0
            else:
                unit = iid
            t_min, t_max = self.noise_range
            t = t_min + (t_max - t_min) * unit
            times.append(t)
            masked.append(mask_draw < t.repeat_interleave(self.block_size))
        return Noise(torch.stack(times), torch.stack(masked))

    def rows(self, tokens, sample_index, layout, loss_mask=None) -> Rows:
        """This rank's model inputs `[x_t at noisy positions ; x0 at clean positions]`, labels, weights
        and token count, in `layout`'s row order."""
        tokens = torch.as_tensor(tokens).cpu()
        sample_index = torch.as_tensor(sample_index).cpu().reshape(-1)
        seq_length = layout.seq_length
        _require(tokens.dim() == 2 and tokens.shape[1] == seq_length and not tokens.is_floating_point(),
                 f"tokens must be integer ids [micro batch, --seq-length={seq_length}], got "
                 f"{tuple(tokens.shape)} {tokens.dtype}")
        _require(sample_index.numel() == tokens.shape[0],
                 f"sample_index has {sample_index.numel()} entries for {tokens.shape[0]} samples")
        _require(layout.block_size == self.block_size,
                 f"--bdlm-block-size={self.block_size} differs from the layout's block_size={layout.block_size}")
        _require(not bool((tokens == self.mask_token_id).any()),
                 f"the data contains --bdlm-mask-token-id={self.mask_token_id}; MASK must be an extra id the data "
                 f"never uses (e.g. the tokenizer's vocabulary size, with the model's vocabulary one larger)")
        supervised = torch.ones_like(tokens, dtype=torch.bool)
        if loss_mask is not None:
            loss_mask = torch.as_tensor(loss_mask).cpu()
            _require(loss_mask.shape == tokens.shape,
                     f"loss_mask {tuple(loss_mask.shape)} must match tokens {tuple(tokens.shape)}")
            supervised = loss_mask.bool()
        noise = self.noise(sample_index, seq_length)
        weight = torch.ones_like(noise.t) if self.loss_weighting == "unit" else 1.0 / noise.t
        weight = weight.repeat_interleave(self.block_size, dim=1)
        masked, clean, labels, countable, scored, weight = self.kind.views(noise.masked, tokens, supervised, weight)
        noisy_tokens = torch.where(masked, self.mask_token_id, clean)
        noisy, kept = layout.noisy_positions, layout.clean_positions
        device = default_device()
        return Rows(
            input_ids=torch.cat([noisy_tokens[:, noisy], clean[:, kept]], dim=1).to(device),
            position_ids=layout.row_positions.expand(clean.shape[0], -1).contiguous().to(device),
            labels=labels[:, noisy].contiguous().to(device),
            loss_weights=torch.where(scored, weight, 0.0)[:, noisy].to(torch.float32).to(device),
            num_tokens=countable[:, noisy].sum().to(torch.int).to(device),
        )


def loss_func(loss_weights, num_tokens, output_tensor):
    """Megatron's per-token loss: the weighted CE sum of this micro-batch and the tokens it stands for.

    Megatron sums both over micro-batches and dp×cp and divides the gradients by the total count
    (`calculate_per_token_loss=True`), which makes the loss a per-token NELBO of the global batch.
    """
    _require(output_tensor.shape == loss_weights.shape,
             f"the model returned {tuple(output_tensor.shape)}, expected per-token cross-entropy "
             f"{tuple(loss_weights.shape)} over this rank's noisy rows (call it with labels)")
    loss_sum = (output_tensor.float() * loss_weights).sum()
    report = torch.stack([loss_sum.detach(), num_tokens.to(loss_sum.dtype)])
    return loss_sum, num_tokens, {"lm loss": report}


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


def checked_loss_func(loss_weights, num_tokens, output_tensor, *, check_results=False, check_spiky_loss=False):
    """`loss_func`, then Megatron's rerun state machine on this rank's loss, as `pretrain_gpt.py` does: NaN/Inf
    are fatal (`--check-for-nan-in-loss-and-grad`), a loss 10x the largest seen is flagged
    (`--check-for-spiky-loss`). The machine does nothing in its disabled mode (our own loop's)."""
    loss, num_tokens, report = loss_func(loss_weights, num_tokens, output_tensor)
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
    """This micro-batch's `tokens` and `sample_index`: read at TP rank 0, broadcast to the other TP ranks (as
    `pretrain_gpt.py`'s `get_batch_on_this_tp_rank`: only TP rank 0 builds the datasets). Without tensor
    parallelism (or Megatron's groups) the rank reads its own."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import broadcast_data

    tp_group = mpu.get_tensor_model_parallel_group(check_initialized=False)
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return next(data_iterator)
    batch = None
    if dist.get_rank(tp_group) == 0:
        batch = next(data_iterator)
        _sample_index(batch)
        _require("loss_mask" not in batch, "a batch 'loss_mask' is not broadcast over tensor-parallel ranks; "
                                           "drop it or use --tensor-model-parallel-size 1")
        batch = {key: torch.as_tensor(batch[key]).long() for key in ("tokens", "sample_index")}
    return broadcast_data(["tokens", "sample_index"], batch, torch.int64, tp_group=tp_group)


class BDLMForwardStep:
    """`forward_step(data_iterator, model)` for megatron-core's `get_forward_backward_func`.

    First and last pipeline stages take one micro-batch (the first needs the rows, the last the labels
    and weights; TP rank 0 reads it, the other TP ranks receive it); middle stages read nothing and only
    pass the row positions. A model (each chunk under virtual pipelining) is checked against the step once,
    on its first micro-batch: the layout, the MASK id and the per-token loss a model is built with stay.
    """

    def __init__(self, objective: BDLMObjective, layout, *, check_results: bool = False,
                 check_spiky_loss: bool = False):
        _require(layout.block_size == objective.block_size,
                 f"--bdlm-block-size={objective.block_size} differs from the layout's block_size={layout.block_size}")
        self.objective = objective
        self.layout = layout
        self.loss_func = partial(checked_loss_func, check_results=check_results, check_spiky_loss=check_spiky_loss)
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
            positions = self.layout.row_positions.unsqueeze(0).to(default_device())
            return model(None, positions, attention_mask=None), partial(self.loss_func, None, None)
        batch = batch_on_this_rank(data_iterator)
        rows = self.objective.rows(batch["tokens"], _sample_index(batch), self.layout, batch.get("loss_mask"))
        output = model(rows.input_ids if first_stage else None, rows.position_ids, attention_mask=None,
                       labels=rows.labels if last_stage else None)
        return output, partial(self.loss_func, rows.loss_weights, rows.num_tokens)
