"""The BDLM objective: deterministic noise, this rank's `[x_t ; x_0]` rows, the loss. Torch only; the
megatron-core forward step built on it is `forward_step`.

API (what the model, the training loop and the tests use)::

    objective = BDLMObjective(block_size=B, mask_token_id=V, objective=objectives.BD3LM (or its name, ...),
                              loss_weighting=None | "inverse-t" | "unit", noise_range=(1e-3, 1.0),
                              antithetic=True, antithetic_group=1, seed=1234, vocab_ids=None,
                              self_conditioning_probability=0.0)
    noise = objective.noise(sample_index [b], seq_length)      -> Noise(t [b, NB], masked [b, L],
                                                                  replacement, self_conditioned)  (CPU)
    rows = objective.rows(tokens [b, L], sample_index [b], layout, loss_mask=None,
                          documents=None, reset_positions=False, separate_documents=True, sample_layouts=None)
        -> Rows(input_ids [m, rows], position_ids [m, rows], labels [m, n_noisy],
                loss_weights [m, n_noisy], num_tokens int scalar, document_ids [m, L] or None)
           on default_device(); packed samples: `documents [b, L]` their document ids (see `rows`);
           m = objective.views_per_sample * b: b for "bd3lm", 2b for "fast-dllm-v2" (give the schedule
           micro_batch_size = views_per_sample x the data's micro-batch size: it sizes pipeline messages)
    loss_func(loss_weights, num_tokens, per_token_ce [m, n_noisy])
        -> (loss_sum, num_tokens, {"lm loss": tensor([loss_sum, num_tokens])})

`tokens [b, L]` is the clean `x0`, `sample_index [b]` its global sample indices (e.g. the `idx` a GPTDataset
was asked for), `loss_mask [b, L]` (optional) 1 where token `j` of `x0` is supervised: aligned with `tokens`,
NOT with shifted AR labels (the GPTDataset's own `loss_mask` is shifted and always drops the last token).
The noise depends on `(seed, sample index)` alone, so every rank given the same samples draws the same.

Noise. Sample `s` draws its mask from a generator seeded by `(seed, s)`. Noise times are antithetic:
samples `[g·G, (g+1)·G)` (`G = antithetic_group`) share one `u` drawn from `(seed, g)`, and the `N = G·NB`
(sample, block) pairs take `t_i = (u + i/N) mod 1` with `i = (s mod G)·NB + block`, mapped into
`[t_min, t_max]`. This is the batch-level stratification of docs/algorithm.md §2 when `G` is the global
batch size, yet a sample's noise never depends on how the batch is cut into micro-batches or DP shards.
Each token of block `b` is then corrupted with probability `t_b`: replaced by MASK, or (a uniform-state objective,
DiffusionGemma) by a random real id other than MASK (`vocab_ids`: the model's ids), drawn from `(seed, sample)`.
Self-conditioning (`self_conditioning_probability`): sample `s` is self-conditioned when a uniform draw of
`(seed, s)` falls below it (`Rows.self_conditioned`; the model runs its first, detached pass for those).

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
    masked: torch.Tensor  # [b, L] bool, token corrupted in x_t
    replacement: torch.Tensor | None = None  # [b, L] the random real id a corrupted token becomes (uniform state)
    self_conditioned: torch.Tensor | None = None  # [b] bool, the sample takes the self-conditioning signal


class LossParts(NamedTuple):
    """The loss's two parts and their weights: the diffusion loss of the noisy rows, and an autoregressive co-loss
    of the clean rows (`ar_weights [m, n_clean]`, 1 where a clean row's next-token target counts on this rank;
    None without it) over `ar_num_tokens` targets."""

    diffusion_weight: float = 1.0
    ar_weight: float = 0.0
    ar_weights: torch.Tensor | None = None
    ar_num_tokens: torch.Tensor | None = None


class Rows(NamedTuple):
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor  # [m, n_noisy] (the noisy rows' targets), then [m, n_clean] next tokens with the AR part
    loss_weights: torch.Tensor
    num_tokens: torch.Tensor
    document_ids: torch.Tensor | None = None  # [m, L] document of every position (packed samples), else None
    parts: LossParts | None = None  # None: the diffusion loss alone, weight 1
    self_conditioned: torch.Tensor | None = None  # [m] bool, the samples the model self-conditions (None: none)


@dataclass(frozen=True)
class BDLMObjective:
    """What the block-diffusion loss is: block size, MASK id, objective variant, weighting and noise."""

    block_size: int
    mask_token_id: int
    objective: objectives.ObjectiveKind = objectives.BD3LM  # or its --bdlm-objective name
    loss_weighting: str | None = None  # None: the objective's default
    noise_range: tuple[float, float] = (1e-3, 1.0)
    antithetic: bool = True
    antithetic_group: int = 1
    seed: int = 1234
    diffusion_loss_weight: float = 1.0
    ar_loss_weight: float = 0.0  # > 0: the clean rows' next-token co-loss (a token-causal clean stream's)
    vocab_ids: int | None = None  # the model's real ids, MASK included: a uniform-state corruption's range
    self_conditioning_probability: float = 0.0  # chance a sample is self-conditioned

    def __post_init__(self):
        _require(isinstance(self.block_size, int) and self.block_size >= 1,
                 f"--bdlm-block-size={self.block_size!r} must be a positive integer")
        _require(isinstance(self.mask_token_id, int) and self.mask_token_id >= 0,
                 f"--bdlm-mask-token-id={self.mask_token_id!r} must be a non-negative vocabulary id "
                 f"(an extra id the data never uses, e.g. the tokenizer's vocabulary size)")
        rules.refuse(rules.loss_weighting_problem(self.objective, self.loss_weighting))
        object.__setattr__(self, "objective", objectives.objective_kind(self.objective))
        object.__setattr__(self, "loss_weighting", self.loss_weighting or self.objective.default_weighting)
        _require(len(self.noise_range) == 2, f"--bdlm-noise-range={self.noise_range!r} takes two numbers: T_MIN T_MAX")
        t_min, t_max = (float(t) for t in self.noise_range)
        object.__setattr__(self, "noise_range", (t_min, t_max))
        rules.refuse(rules.noise_range_problem(t_min, t_max))
        _require(isinstance(self.antithetic_group, int) and self.antithetic_group >= 1,
                 f"antithetic_group={self.antithetic_group!r} must be a positive integer: the samples sharing one "
                 f"stratified draw (the training loop sets it to --global-batch-size)")
        _require(isinstance(self.seed, int) and self.seed >= 0, f"--seed={self.seed!r} must be a non-negative integer")
        _require(self.objective.corruption != objectives.UNIFORM_STATE
                 or (isinstance(self.vocab_ids, int) and self.vocab_ids - (self.mask_token_id < self.vocab_ids) >= 2),
                 f"--bdlm-objective {self.objective} replaces tokens by random real ids: give vocab_ids, the model's "
                 f"ids (at least two besides MASK), not {self.vocab_ids!r}")
        rules.refuse(rules.self_conditioning_problem(self.objective, self.self_conditioning_probability))
        _require(self.ar_loss_weight == 0 or self.objective.views_per_sample == 1,
                 f"--bdlm-ar-loss-weight goes with one view per sample, not --bdlm-objective {self.objective}")

    @property
    def views_per_sample(self) -> int:
        """Model batch rows per clean sample: Fast-dLLM v2 scores each sample under a mask and its complement."""
        return self.objective.views_per_sample

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
        return Noise(torch.stack(times), torch.stack(masked), *self._extra_draws(sample_index, seq_length))

    def _extra_draws(self, sample_index, seq_length):
        """Each sample's replacement ids (uniform state: every real id but MASK alike) and self-conditioning draw,
        from `(seed, sample index)` as the noise, on streams of their own (the other objectives' draws stay)."""
        samples = torch.as_tensor(sample_index).reshape(-1).tolist()
        replacement = conditioned = None
        if self.objective.corruption == objectives.UNIFORM_STATE:
            choices = self.vocab_ids - (self.mask_token_id < self.vocab_ids)
            ids = torch.stack([torch.randint(choices, (seq_length,), generator=_generator(self.seed, "replacement", s))
                               for s in samples])
            replacement = ids + (ids >= self.mask_token_id).long()
        if self.self_conditioning_probability:
            conditioned = torch.tensor([
                bool(torch.rand((), generator=_generator(self.seed, "self-conditioning", s), dtype=torch.float64)
                     < self.self_conditioning_probability) for s in samples], dtype=torch.bool)
        return replacement, conditioned

    def rows(self, tokens, sample_index, layout, loss_mask=None, documents=None, reset_positions=False,
             separate_documents=True, sample_layouts=None) -> Rows:
        """This rank's model inputs `[x_t at noisy positions ; x0 at clean positions]`, labels, weights
        and token count, in `layout`'s row order.

        Packed samples: `documents [b, L]` is the document of every position (`core.documents.document_ids`).
        `reset_positions`: RoPE positions restart at each document (`--reset-position-ids`);
        `separate_documents`: no row attends across a document (`--reset-attention-mask`; the rows then carry
        `document_ids` for the attention) and a shifted objective's last row of a document has no target. The
        noise stays per (sample, block) as the objective draws it, so a document that starts on a block
        boundary gets the noise law of an unpacked sample. `sample_layouts`: each sample's deal of `layout`'s blocks
        (`core.documents.balanced_layout`: same row counts and clean shard), None: `layout` for all."""
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
        if documents is not None:
            documents = torch.as_tensor(documents).cpu().long()
            _require(documents.shape == tokens.shape,
                     f"document ids {tuple(documents.shape)} must match tokens {tuple(tokens.shape)}")
            if separate_documents and self.objective.label_shift:  # no target across a document boundary
                starts = torch.zeros_like(supervised)
                starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
                supervised = supervised & ~starts
        noise = self.noise(sample_index, seq_length)
        weight = torch.ones_like(noise.t) if self.loss_weighting == objectives.UNIT else 1.0 / noise.t
        weight = weight.repeat_interleave(self.block_size, dim=1)
        views = self.objective.views_per_sample
        masked, clean, labels, countable, scored, weight = self.objective.views(noise.masked, tokens, supervised,
                                                                                 weight)
        corrupt = self.mask_token_id if noise.replacement is None else noise.replacement.repeat(views, 1)
        noisy_tokens = torch.where(masked, corrupt, clean)
        device = default_device()
        per_sample = [layout] * tokens.shape[0] if sample_layouts is None else list(sample_layouts)
        _require(len(per_sample) == tokens.shape[0] and all(
            other.num_noisy_rows == layout.num_noisy_rows and torch.equal(other.clean_positions, layout.clean_positions)
            for other in per_sample), "each sample's layout must be a deal of the run's (same rows, same clean shard)")
        noisy = torch.stack([other.noisy_positions for other in per_sample]).repeat(views, 1)  # [m, n_noisy]
        rows_at = torch.stack([other.row_positions for other in per_sample]).repeat(views, 1)  # [m, rows]
        kept = layout.clean_positions
        position_ids = rows_at
        document_ids = None
        if documents is not None:
            documents = documents.repeat(views, 1)
            if reset_positions:
                first = torch.cummax(torch.where(torch.cat([torch.ones_like(documents[:, :1], dtype=torch.bool),
                                                            documents[:, 1:] != documents[:, :-1]], dim=1),
                                                 torch.arange(seq_length), 0), dim=1).values
                position_ids = position_ids - first.gather(1, rows_at)
            if separate_documents:
                document_ids = documents.to(device)
        labels = labels.gather(1, noisy)
        parts = None
        if self.ar_loss_weight or self.diffusion_loss_weight != 1.0:
            parts = LossParts(self.diffusion_loss_weight, self.ar_loss_weight)
        if self.ar_loss_weight:
            targets, ar_weights = self._next_tokens(tokens, supervised, documents if separate_documents else None,
                                                    layout)
            labels = torch.cat([labels, targets], dim=1)
            parts = parts._replace(ar_weights=ar_weights.to(device),
                                   ar_num_tokens=ar_weights.sum().to(torch.int).to(device))
        return Rows(
            input_ids=torch.cat([noisy_tokens.gather(1, noisy), clean[:, kept]], dim=1).to(device),
            position_ids=position_ids.contiguous().to(device),
            labels=labels.to(device),
            loss_weights=torch.where(scored, weight, 0.0).gather(1, noisy).to(torch.float32).to(device),
            num_tokens=countable.gather(1, noisy[:tokens.shape[0]]).sum().to(torch.int).to(device),
            document_ids=document_ids,
            parts=parts,
            self_conditioned=(None if noise.self_conditioned is None
                              else noise.self_conditioned.repeat(views).to(device)),
        )

    @staticmethod
    def _next_tokens(tokens, supervised, documents, layout):
        """The clean rows' next-token targets `[b, n_clean]` (token p+1 for the clean row at p) and their weights
        (1 where it counts). A target counts where it exists (p+1 < L), is supervised (loss mask, EOD) and lies in
        the row's own document; and, since every ring of `P/C` ranks holds the whole clean sequence, only on the
        first ring's ranks, so each target counts once (its other rings' copies carry the same rows: the
        gradient is the one-copy gradient)."""
        positions = layout.clean_positions
        following = (positions + 1).clamp(max=layout.seq_length - 1)
        counted = (positions + 1 < layout.seq_length) & supervised[:, following]
        if documents is not None:
            counted &= documents[:, following] == documents[:, positions]
        counted &= layout.ring_index == 0
        return tokens[:, following], counted.to(torch.float32)


def loss_func(loss_weights, num_tokens, output_tensor, parts: LossParts | None = None):
    """Megatron's per-token loss: the weighted CE sum of this micro-batch and the tokens it stands for.

    Megatron sums both over micro-batches and dp×cp and divides the gradients by the total count
    (`calculate_per_token_loss=True`), which makes the loss a per-token NELBO of the global batch. With the
    autoregressive co-loss (`parts`), as Megatron-Bridge's step: the weighted sum of the two parts over the tokens
    of both, each part also reported over its own tokens (`diffusion loss`, `ar loss`).
    """
    noisy = loss_weights.shape[1]
    clean = 0 if parts is None or parts.ar_weights is None else parts.ar_weights.shape[1]
    _require(output_tensor.shape == (loss_weights.shape[0], noisy + clean),
             f"the model returned {tuple(output_tensor.shape)}, expected per-token cross-entropy "
             f"{(loss_weights.shape[0], noisy + clean)} over this rank's noisy{' and clean' if clean else ''} rows "
             f"(call it with labels{'; build it with clean_logits' if clean else ''})")
    output_tensor = output_tensor.float()
    diffusion = (output_tensor[:, :noisy] * loss_weights).sum()
    if parts is None:
        report = torch.stack([diffusion.detach(), num_tokens.to(diffusion.dtype)])
        return diffusion, num_tokens, {"lm loss": report}
    loss, total, report = parts.diffusion_weight * diffusion, num_tokens, {}
    if clean:
        ar = (output_tensor[:, noisy:] * parts.ar_weights).sum()
        loss, total = loss + parts.ar_weight * ar, num_tokens + parts.ar_num_tokens
        report["diffusion loss"] = torch.stack([diffusion.detach(), num_tokens.to(diffusion.dtype)])
        report["ar loss"] = torch.stack([ar.detach(), parts.ar_num_tokens.to(ar.dtype)])
    return loss, total, {"lm loss": torch.stack([loss.detach(), total.to(loss.dtype)]), **report}
