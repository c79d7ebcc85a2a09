"""The BDLM objectives — BD3-LM, Fast-dLLM v2 and DiffusionGemma — as objects that state their own facts.

What differs between objectives lives on its object: how many model rows a clean sample becomes, which
token a noisy row predicts, the loss weighting it trains with (and which it refuses), whether its
validation loss is a bound on perplexity, and how a sample's noise turns into scored views. The rules, the
objective's rows (`bdlm.objective`), the progress line, the HF export and the sampler ask the object
(`objective_kind(name)`) instead of testing its name (docs/algorithm.md §2–§3).

Standard library only (the rules and the planner run without torch): `views()` works on the tensors it is
given, importing torch only when it runs.
"""

import dataclasses

from megatron_csbp.core.variants import Registry, named

LOSS_WEIGHTINGS = INVERSE_T, UNIT = ("inverse-t", "unit")
CORRUPTIONS = MASK_STATE, UNIFORM_STATE = ("mask", "uniform")  # a corrupted token becomes MASK / a random real id


@named
@dataclasses.dataclass(frozen=True)
class ObjectiveKind:
    """BD3-LM's facts (the base): one view per sample, row p predicts token p, the NELBO's `1/t` weights."""

    name: str
    summary: str
    views_per_sample: int = 1  # model batch rows per clean sample
    label_shift: int = 0  # positions from a noisy row to the token it predicts
    default_weighting: str = INVERSE_T
    weightings: tuple = LOSS_WEIGHTINGS  # the loss weightings it trains with
    corruption: str = MASK_STATE  # what a corrupted token becomes (CORRUPTIONS)
    self_conditioning_probability: float = 0.0  # the default chance a sample is self-conditioned (0: none)
    encoder_is_causal: bool = False  # its clean copy is a causal LM (needs token-causal clean attention)

    @property
    def target(self) -> str:
        """Which token a noisy row predicts, in words."""
        return "noisy row p predicts token p" + (f"+{self.label_shift}" if self.label_shift else "")

    def weighting_problem(self, weighting: str) -> str | None:
        """Why `weighting` cannot go with this objective (None when it can)."""
        if weighting in self.weightings:
            return None
        return (f"--bdlm-loss-weighting={weighting} does not go with --bdlm-objective={self.name}, which uses "
                f"{' or '.join(self.weightings)} weights: drop --bdlm-loss-weighting or set it to "
                f"{self.default_weighting}")

    def loss_is_bound(self, weighting: str) -> bool:
        """Whether the weighted validation loss per token is the NELBO, so `exp` of it bounds perplexity."""
        return weighting == INVERSE_T

    def views(self, masked, tokens, supervised, weight):
        """The model's views of a micro-batch from its noise (`masked [b, L]`, `weight [b, L]` per token),
        its clean `tokens` and the `supervised` tokens: (masked, clean, labels, countable, scored, weight),
        each `[views_per_sample·b, L]` but `countable` (`[b, L]`, the tokens the normaliser counts)."""
        return masked, tokens, tokens, supervised, masked & supervised, weight


class _UniformState(ObjectiveKind):
    """DiffusionGemma's uniform-state diffusion: a corrupted token is a random real id, indistinguishable from a
    clean one, so the model restores every token of its canvas (each block, bidirectional, given the clean prefix):
    every supervised noisy row is scored, replaced or not, with unit weights."""

    def loss_is_bound(self, weighting):
        return False  # unit weights over every canvas token: a loss, not the NELBO

    def views(self, masked, tokens, supervised, weight):
        return masked, tokens, tokens, supervised, supervised, weight


class _ShiftedComplementary(ObjectiveKind):
    """Fast-dLLM v2: the AR model's next-token head kept (row p predicts token p+1), each sample seen under a
    mask and its complement so every token 1..L-1 is a target exactly once per pair, unit weights."""

    def loss_is_bound(self, weighting):
        return False  # shifted targets and complementary views: a loss, not the NELBO

    def views(self, masked, tokens, supervised, weight):
        import torch

        masked = torch.cat([masked, ~masked])
        clean = tokens.repeat(2, 1)
        labels = torch.cat([clean[:, 1:], clean[:, -1:]], dim=1)
        no_target = torch.zeros_like(supervised[:, :1])
        countable = torch.cat([supervised[:, 1:], no_target], dim=1)
        scored = torch.cat([masked[:, 1:], no_target.repeat(2, 1)], dim=1) & countable.repeat(2, 1)
        return masked, clean, labels, countable, scored, weight.repeat(2, 1)


BD3LM = ObjectiveKind("bd3lm", "BD3-LM: tokens predicted in place, loss weighted by 1/t (the NELBO)")
FAST_DLLM_V2 = _ShiftedComplementary(
    "fast-dllm-v2", "Fast-dLLM v2: next-token targets, a mask and its complement per sample, unit weights",
    views_per_sample=2, label_shift=1, default_weighting=UNIT, weightings=(UNIT,))

DIFFUSION_GEMMA = _UniformState(
    "diffusion-gemma", "DiffusionGemma: uniform-state corruption, every canvas token restored, unit weights, "
    "self-conditioning", default_weighting=UNIT, weightings=(UNIT,), corruption=UNIFORM_STATE,
    self_conditioning_probability=0.5, encoder_is_causal=True)

OBJECTIVES = Registry("--bdlm-objective", BD3LM, FAST_DLLM_V2, DIFFUSION_GEMMA)  # the flag's choices, in its order
objective_kind = OBJECTIVES  # objective_kind(name or objective) -> the objective; ValueError naming the choices
