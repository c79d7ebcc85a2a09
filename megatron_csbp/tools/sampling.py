"""Block-diffusion sampling: semi-autoregressive decoding from a trained BDLM, one block at a time.

A new block starts as MASK tokens (prompt tokens that fall into it stay as they are) and is denoised in
at most `steps_per_block` model calls. Each call predicts every position of the block from the committed
clean prefix and the block's current tokens; a strategy then unmasks some masked positions. Committed
tokens, the prompt's included, never change. A sample ends at EOS (the tokenizer's EOD) or a stop sequence,
checked when a block is complete (as every published decoder does); it is cut before them.

Why the sampler's model is a plain megatron-core `GPTModel`. While sampling, each position holds exactly
one row: committed blocks as clean rows (`x0`), the active block as its noisy rows (`x_t`). The training
mask restricted to such rows (a noisy row of block `b` sees its own block and the clean blocks before it;
a clean row of block `k` the clean blocks up to `k`, or with a token-causal clean stream the clean tokens up
to its own) reads: the active block's rows see every row up to the end of their block, a committed row what
the clean-attention rule lets it see. That is a mask over an ordinary sequence, so sampling and training
agree by construction,
and the trained weights run as a `GPTModel` whose core attention is `SamplingAttention`, with
Megatron's own RoPE (the position is the row index) and its static K/V cache (`StaticInferenceContext`):
a committed block's K/V are written once and kept (the offset moves past them); the active block's are
written after them and overwritten by the next call. Keys are position-encoded per token after they
leave the cache, so cached and recomputed K/V are the same numbers. Its parameters are those of
`BDLMGPTModel`, so any of our checkpoints loads into it.

Gemma 4's layers (`--gemma4-moe`, `--gemma4-attention`) are training's layer specs with the sampler's cache
(`SamplingGemma4SelfAttention`), and the one RoPE tensor holds the global layers' proportional table after the
sliding one (`SideBySideRotary`), as training's model builds it (`gemma4_attention.side_by_side`).

Sliding-window layers (`--window-size`, `--window-attn-skip-freq`) agree with training the same way: each layer
takes its window as training's does (megatron-core's reading of the config by layer number, `spec.layer_window`),
and the window is one more bound of the same rows' mask (`core.windows`: a row sees the clean keys from
`anchor - LEFT` on, its anchor its block's start, or its own position for a token-causal clean row), so the
sampler's rows see what the training rows see. Every row the sampler will still run lies in or after the active
block, so a sliding layer's cache (`SamplingSelfAttention`) keeps only the `LEFT` positions before the active
block and the block itself; a global layer keeps megatron-core's static cache, every position.

A clean row equals a fully unmasked noisy row (same tokens, same visible rows). The Fast-dLLM v2
objective's shifted labels need that: position `p` is predicted by row `p-1`, which for the first
position of a block is the previous block's last clean row, whose logits the commit call returns.

Strategies are `Strategy` objects (`STRATEGY`, by `--strategy` name); each states whose decoder it follows,
its commit rule, its nucleus rule and where its confidence comes from. With `S` steps per block:
* "confidence" (SDAR `low_confidence_dynamic`, LLaDA2): step `i` commits `k_i` tokens, the block size split
  evenly over the `S` steps (the first `B mod S` steps one more), or every masked position whose token has
  probability above `threshold` when those are more.
* "fast-dllm-v2" (Fast-dLLM v2, shifted-label models only): the block's first token is the argmax of the
  previous block's last clean row, committed before denoising; then sub-blocks of `sub_block_size`, left to
  right, each denoised until complete: every masked position above `threshold`, and at least the most
  confident one (with fewer steps than positions, at least ceil(masked / steps left of the sub-block)).
* "top-k" (LLaDA's low-confidence remasking): step `i` commits the `k_i` most confident, the block's masked
  count at its start split evenly over the `S` steps; confidence is the softmax before temperature.
* "posterior" (BD3-LM's DDPM sampler, `T = S` steps, `t_i = linspace(1, 0, T)[i]`, `dt = 1/T`): each masked
  position unmasks with probability `dt / t_i = 1/(T t_i)`; the last step (t = 0) commits the rest.
* "first-hitting" (BD3-LM's first-hitting sampler): exactly one uniformly chosen masked position per step
  (our model is not time-conditioned, so the hitting times need not be drawn); needs `S >= block size`.
* "diffusion-gemma" (transformers' DiffusionGemma, uniform-state models only): no MASK; the block is a canvas of
  random ids, redrawn at every step, with entropy-bound acceptance, renoising, a linear temperature schedule,
  self-conditioning (each call takes the previous step's logits) and a stable-and-confident early stop
  (`DiffusionGemma`, `denoise_canvas`). The decoding loop (`decode`) takes its logits from a source: our model
  (`_BlockLogits`), or in the tests transformers' decoder, whose `generate` gives the same tokens.
Tokens are the argmax at temperature 0, otherwise drawn from softmax(logits / T) cut to the `top_k` largest
logits, then to the top-p nucleus: BD3-LM keeps the sorted tokens whose cumulative probability is <= p (the
first always), the others (Fast-dLLM v2, SDAR, LLaDA2) also keep the token that crosses p. Confidence is the
chosen token's probability under that distribution, except for "top-k" (LLaDA): under softmax(logits).

Random draws (one `torch.Generator` seeded with `seed`, on the model's device; "diffusion-gemma": see
`denoise_canvas`), per denoising step, in this order: at temperature > 0 the tokens, `torch.multinomial` over the [rows * positions, vocabulary]
probabilities of the positions the step considers (the block, or the sub-block); then "posterior" one
`torch.rand` per position [rows, positions] (a position unmasks when its draw is below the probability) and
"first-hitting" the same (the masked position with the largest draw unmasks). Tests restate the published
rules over these draws.

`context_window` (BD3-LM's sliding window, `context_size`): once a block ends past `W` positions, the model
sees only the last `W` positions up to the block's end (whole blocks), as a sequence of its own (positions
from 0), so no position past the trained length is ever used. As BD3-LM's sampler without its cache, the
window is recomputed when it moves (once per block).
"""

import math
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, NamedTuple

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_csbp.core.clean_attention import BLOCK_CAUSAL
from megatron_csbp.core.objectives import MASK_STATE, UNIFORM_STATE
from megatron_csbp.core.positions import RotaryPositions
from megatron_csbp.core.rules import ConfigError
from megatron_csbp.core.variants import Registry
from megatron_csbp.core.kernels import default_kernels
from megatron_csbp.core.windows import GLOBAL
from megatron_csbp.mcore import gemma4_moe
from megatron_csbp.mcore.gemma4_attention import Gemma4SelfAttention, side_by_side
from megatron_csbp.mcore.linear_cross_entropy import softcapped
from megatron_csbp.mcore.model import global_inverse_frequencies
from megatron_csbp.mcore.self_conditioning import SelfConditioning

def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# -------------------------------------------------------------------------------------------- strategies
def nucleus_within_p(sorted_probs, top_p: float):
    """BD3-LM's nucleus: the sorted tokens whose cumulative probability is <= p, and the first always."""
    keep = sorted_probs.cumsum(-1) <= top_p
    keep[..., 0] = True
    return keep


def nucleus_crossing_p(sorted_probs, top_p: float):
    """Fast-dLLM v2's, SDAR's and LLaDA2's nucleus: a token is kept while the mass before it is <= p, so the
    token that crosses p is kept too."""
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    keep[..., 1:] = sorted_probs.cumsum(-1)[..., :-1] <= top_p
    return keep


def even_split(total, steps: int, step: int):
    """Step `step`'s share of `total` (an int or a tensor) split over `steps` steps, the remainder going
    one by one to the first steps (SDAR's, LLaDA's and LLaDA2's schedule)."""
    return total // steps + (step < total % steps)


def _most(score, masked, count):
    """The `count[i]` masked positions of row `i` with the highest score (ties: the leftmost first)."""
    order = score.masked_fill(~masked, float("-inf")).argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return masked & (rank < count.unsqueeze(1))


class Step(NamedTuple):
    """What a commit rule sees at one denoising step of a (sub-)block of `n` positions."""

    masked: torch.Tensor  # [b, n] still MASK
    confidence: torch.Tensor  # [b, n] the drawn token's confidence
    index: int  # this step's index among the (sub-)block's steps
    steps: int  # the (sub-)block's steps
    masked_at_start: torch.Tensor  # [b] masked positions when the (sub-)block's first step began
    block_size: int
    threshold: float
    generator: torch.Generator


class Strategy:
    """A decoding method, as its authors' code runs it: the facts the decoding loop asks for."""

    name: str
    follows: str  # whose decoder
    nucleus = staticmethod(nucleus_crossing_p)
    confidence_before_temperature = False  # LLaDA: confidence from softmax(logits), tokens from softmax(logits/T)
    needs_shifted_labels = False
    corruption = MASK_STATE  # what its undecided positions hold: MASK (every strategy here) or random ids
    first_token_by_argmax = False  # Fast-dLLM v2: the previous clean block's last row commits position 0
    one_token_per_step = False  # needs steps >= block size
    default_sub_block_size = None  # decodes a block in sub-blocks of this size (where it divides the block)
    stops_at_chat_end = False  # Fast-dLLM v2 stops at the chat end token (<|im_end|>)
    default_steps = None  # steps per block when none are given (None: the block size)
    differs: str  # where ours departs from the authors' code (--help and the README say it)

    def sub_blocks(self, block_size: int, sub_block_size: int | None) -> list[tuple[int, int]]:
        return [(0, block_size)]

    def steps(self, block_size: int, given: int | None) -> int:
        """Steps per block: those given, else this strategy's default, else one per position."""
        if given is not None:
            return given
        return block_size if self.default_steps is None else self.default_steps

    def commit(self, step: Step) -> torch.Tensor:
        """[b, n] the positions this step unmasks (a subset of `step.masked`)."""
        raise NotImplementedError


class Confidence(Strategy):
    name, follows = "confidence", "SDAR low_confidence_dynamic / LLaDA2 threshold decoding"
    differs = ("As LLaDA2, a step never commits more than the masked positions (SDAR's top-k can rewrite prompt "
               "tokens inside the block); --temperature 0 is the argmax.")

    def commit(self, step):
        scheduled = even_split(step.block_size, step.steps, step.index)
        confident = (step.masked & (step.confidence > step.threshold)).sum(1)
        return _most(step.confidence, step.masked, confident.clamp(min=scheduled))


class FastDLLMv2(Strategy):
    name, follows = "fast-dllm-v2", "Fast-dLLM v2 batch_sample"
    needs_shifted_labels = first_token_by_argmax = stops_at_chat_end = True
    default_sub_block_size = 8  # its small_block_size (of its 32-token blocks)
    differs = ("Fast-dLLM v2 has no step budget (one token at least per step); a --steps-per-block below the "
               "block size is shared among the sub-blocks, each committing at least ceil(masked / its steps left). "
               "Needs a --bdlm-objective fast-dllm-v2 checkpoint.")

    def sub_blocks(self, block_size, sub_block_size):
        size = sub_block_size or block_size
        return [(start, start + size) for start in range(0, block_size, size)]

    def commit(self, step):
        confident = (step.masked & (step.confidence > step.threshold)).sum(1)
        left = step.steps - step.index
        least = (step.masked.sum(1) + left - 1) // left  # 1 whenever the sub-block has a step per position
        return _most(step.confidence, step.masked, torch.maximum(confident, least))


class LowConfidence(Strategy):
    name, follows = "top-k", "LLaDA low_confidence remasking"
    confidence_before_temperature = True
    differs = ("Blocks are aligned to multiples of the block size from position 0 and see only committed blocks, "
               "as our models are trained (LLaDA's start at the prompt's end and attend to the whole sequence); "
               "tokens by torch.multinomial (LLaDA: Gumbel-max in float64, the same distribution); "
               "--top-k/--top-p (not in LLaDA) as SDAR filters.")

    def commit(self, step):
        return _most(step.confidence, step.masked, even_split(step.masked_at_start, step.steps, step.index))


class Posterior(Strategy):
    name, follows = "posterior", "BD3-LM DDPM sampler (_ddpm_caching_update)"
    nucleus = staticmethod(nucleus_within_p)
    differs = ("Tokens at --temperature (BD3-LM draws at 1; 0 takes the argmax); whether a position unmasks and "
               "its token are drawn apart (BD3-LM: one categorical over both, the same distribution).")

    def commit(self, step):
        t = 1.0 - step.index / (step.steps - 1) if step.steps > 1 else 1.0  # linspace(1, 0, T)[i]
        chance = 1.0 if t <= 0.0 else 1.0 / (step.steps * t)
        draws = torch.rand(step.masked.shape, generator=step.generator, device=step.masked.device)
        return step.masked & (draws < chance)


class FirstHitting(Strategy):
    name, follows = "first-hitting", "BD3-LM first-hitting sampler"
    nucleus = staticmethod(nucleus_within_p)
    one_token_per_step = True
    differs = ("The position is the masked one with the largest uniform draw (BD3-LM: randint over the masked, "
               "the same distribution); tokens at --temperature as for posterior.")

    def commit(self, step):
        draws = torch.rand(step.masked.shape, generator=step.generator, device=step.masked.device)
        return _most(draws, step.masked, step.masked.any(1).long())


class DiffusionGemma(Strategy):
    """A uniform-state model's decoder: no MASK; the block (canvas) starts as random ids and every step redraws it.

    Per step `n = S..1` (the steps remaining): the model's logits of the canvas, given the committed prefix and the
    previous step's processed logits (self-conditioning; none at the first step), are divided by the linear
    temperature `t_min + (t_max - t_min) n / S` (computed in fp32); every position draws a token from their softmax;
    the positions with the lowest entropy are accepted while their summed entropy less the largest of them is
    within `entropy_bound` (the rest keep their previous id); then every position not accepted is renoised (a
    fresh random id). The canvas stops early (per sample) when the argmax canvas equals that of each of the last
    `stability_threshold` steps and the mean entropy of the processed logits is below `confidence_threshold`. The
    block's tokens are the argmax canvas of its last step."""

    name, follows = "diffusion-gemma", "transformers DiffusionGemmaForBlockDiffusion.generate (EntropyBoundSampler)"
    corruption = UNIFORM_STATE
    default_steps = 48  # the reference's max_denoising_steps
    commits = ("entropy-bound acceptance (the lowest-entropy positions while their entropy sum less its maximum "
               "<= --entropy-bound), the rest renoised")
    temperatures = "linear schedule from --t-max (first step) down to --t-min (after the last)"
    stops = "argmax canvas stable for --stability-threshold steps and mean entropy < --confidence-threshold"
    differs = ("Blocks are aligned to multiples of the block size from position 0 (transformers starts its canvases "
               "at the prompt's end): a prompt ending inside a block keeps its tokens there, accepted at every step "
               "and counted with entropy 0. Random ids are the checkpoint's real ids but MASK, as its training "
               "corruption draws them. Draws come from --seed's generator, in the reference's order (the canvas, "
               "then per step the tokens and the renoising ids). Needs a --bdlm-objective diffusion-gemma "
               "checkpoint.")


STRATEGY = Registry("--strategy", Confidence(), FastDLLMv2(), LowConfidence(), Posterior(), FirstHitting(),
                    DiffusionGemma())
STRATEGIES = STRATEGY.names
DEFAULT_STRATEGY = STRATEGIES[0]


def strategy_for(corruption: str, chosen: str | None = None) -> Strategy:
    """`chosen`, else a checkpoint's default: the first strategy decoding what its objective corrupts into
    (`objectives.CORRUPTIONS`: MASK, or random ids)."""
    if chosen is not None:
        return STRATEGY[chosen]
    return next(strategy for strategy in STRATEGY.values() if strategy.corruption == corruption)


@dataclass(frozen=True)
class SamplingSettings:
    """How to decode: the model's block size and MASK id, and the decoding method (flag names in messages)."""

    block_size: int
    mask_token_id: int
    steps_per_block: int
    strategy: str = DEFAULT_STRATEGY  # a --strategy name
    threshold: float = 0.9
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int = 0
    eos_token_id: int | None = None  # None: EOS does not end a sample
    stop_sequences: tuple = ()  # token id tuples that end a sample (cut before them)
    suppressed_token_ids: tuple = ()  # never produced (e.g. EOS, to fill max_new_tokens)
    start_token_id: int | None = None  # what an empty prompt starts from (not part of the sample)
    sub_block_size: int | None = None  # default: the strategy's `default_sub_block_size` where it divides the block
    context_window: int | None = None  # positions the model sees at most (a multiple of the block size)
    shifted_labels: bool = False  # trained with --bdlm-objective fast-dllm-v2: row p predicts token p+1
    corruption: str = MASK_STATE  # what the model was trained to restore (its objective's corruption)
    vocab_size: int | None = None  # ids >= vocab_size (vocabulary padding) are never produced
    kv_cache: bool = True
    # --strategy diffusion-gemma (the reference's defaults)
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    early_stop: bool = True  # the stable-and-confident stop
    stability_threshold: int = 1
    confidence_threshold: float = 0.005

    def __post_init__(self):
        _require(self.block_size >= 1, f"block size {self.block_size} must be >= 1")
        _require(self.steps_per_block >= 1, f"--steps-per-block {self.steps_per_block} must be >= 1")
        _require(self.strategy in STRATEGY, STRATEGY.problem(self.strategy))
        method = self.method
        _require(not method.one_token_per_step or self.steps_per_block >= self.block_size,
                 f"--strategy {self.strategy} unmasks one token per step: --steps-per-block {self.steps_per_block} "
                 f"must be >= the block size {self.block_size}")
        uniform = [name for name, strategy in STRATEGY.items() if strategy.corruption == UNIFORM_STATE]
        _require(method.corruption == self.corruption or method.corruption == UNIFORM_STATE,
                 f"--strategy {self.strategy} decodes from MASK tokens, but this checkpoint's --bdlm-objective trains "
                 f"a {self.corruption}-state corruption (no MASK): use --strategy {' or '.join(uniform)}")
        _require(method.corruption == self.corruption,
                 f"--strategy {self.strategy} decodes a uniform-state model (random ids, no MASK), but this "
                 f"checkpoint's --bdlm-objective trains a {self.corruption}-state corruption: choose another --strategy")
        if method.corruption == UNIFORM_STATE:
            _require(self.temperature == 0.0 and self.top_k == 0 and self.top_p == 1.0,
                     f"--strategy {self.strategy} draws at its own temperature schedule (--t-min, --t-max) from the "
                     f"whole distribution: drop --temperature, --top-k and --top-p")
            _require(self.vocab_size is not None, "a uniform-state canvas draws real ids: give settings.vocab_size")
            _require(self.entropy_bound > 0, f"--entropy-bound {self.entropy_bound} must be > 0")
            _require(self.t_min >= 0, f"--t-min {self.t_min} must be >= 0")
            _require(self.t_max > self.t_min, f"--t-max {self.t_max} must be > --t-min {self.t_min}")
            _require(self.stability_threshold >= 0, f"--stability-threshold {self.stability_threshold} must be >= 0")
            _require(self.confidence_threshold > 0, f"--confidence-threshold {self.confidence_threshold} must be > 0")
        _require(not method.needs_shifted_labels or self.shifted_labels,
                 f"--strategy {self.strategy} decodes shifted-label models (row p predicts token p+1): this "
                 f"checkpoint was trained with --bdlm-objective bd3lm; choose another --strategy")
        if self.sub_block_size is not None:
            split = " / ".join(strategy.name for strategy in STRATEGY.values() if strategy.default_sub_block_size)
            _require(method.default_sub_block_size is not None, f"--sub-block-size applies to --strategy {split} only")
            _require(self.sub_block_size >= 1 and self.block_size % self.sub_block_size == 0,
                     f"--sub-block-size {self.sub_block_size} must divide the block size {self.block_size}")
        parts = len(self.sub_blocks)
        _require(self.steps_per_block >= parts, f"--steps-per-block {self.steps_per_block} must be >= the "
                 f"{parts} sub-blocks of --sub-block-size {self.sub_block_size_used} (one step each at least)")
        _require(0.0 <= self.threshold <= 1.0, f"--threshold {self.threshold} must be a probability in [0, 1]")
        _require(self.temperature >= 0.0, f"--temperature {self.temperature} must be >= 0 (0: greedy)")
        _require(0.0 < self.top_p <= 1.0, f"--top-p {self.top_p} must be in (0, 1]")
        _require(self.top_k >= 0, f"--top-k {self.top_k} must be >= 0 (0: no top-k filter)")
        _require(self.seed >= 0, f"--seed {self.seed} must be >= 0")
        _require(all(len(stop) >= 1 for stop in self.stop_sequences), "--stop: a stop sequence is empty")
        _require(self.mask_token_id not in self.suppressed_token_ids, "the MASK id is never produced anyway")
        _require(self.context_window is None or (self.context_window >= 2 * self.block_size and
                                                 self.context_window % self.block_size == 0),
                 f"--context-window {self.context_window} must be a multiple of the block size {self.block_size}, "
                 f"two blocks at least (the active block and the committed context it is decoded from)")

    @property
    def drawn_columns(self) -> int:
        """The logits' columns a uniform-state canvas draws over: the real ids, less MASK where it is the last of
        them (an import appends it after the reference's vocabulary)."""
        return self.vocab_size - (self.mask_token_id == self.vocab_size - 1)

    @property
    def method(self) -> Strategy:
        return STRATEGY[self.strategy]

    @property
    def sub_block_size_used(self) -> int:
        if self.sub_block_size is not None:
            return self.sub_block_size
        default = self.method.default_sub_block_size
        if default is not None and self.block_size % default == 0:
            return default
        return self.block_size

    @property
    def sub_blocks(self) -> list[tuple[int, int]]:
        return self.method.sub_blocks(self.block_size, self.sub_block_size_used)

    @property
    def stops(self) -> tuple:
        return (((self.eos_token_id,),) if self.eos_token_id is not None else ()) + tuple(self.stop_sequences)


# ------------------------------------------------------------------------------------------------ the model
class SamplingAttention(MegatronModule):
    """Core attention of the sampling model: the BDLM mask over position-ordered rows (see module doc).

    Megatron's static inference hands it the queries of this call's rows and the keys of the cached sequence up
    to them, from position `key_start` on (0, or a sliding layer's trimmed cache: `SamplingSelfAttention` sets it
    every call), so the queries are the last rows, and the last block is the one being decoded (the noisy rows;
    unless the call is a prompt's committed rows alone, `SamplingContext.prompt`, then every row is clean):
    its rows see every key below the end of their block; the committed rows before it are clean rows, seeing
    what the model's clean-attention rule lets them (`core.clean_attention`: the end of their block, or their
    own position). In a sliding layer (`window`, the layer's as training reads it) every row sees those keys
    only from its window's start on (`core.windows`). A call whose rows all see every key it is given (a
    denoising step, unless a window cuts into the keys) is plain attention; any other uses the training
    kernels' prefix attention, which never builds a rows x keys mask. With Llama 4's `query_scaling`, the
    queries are scaled at their RoPE positions (the row index of what the model sees).
    """

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self", attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, block_size: int = 1,
                 clean_attention=BLOCK_CAUSAL, query_scaling=None, **unused):
        from megatron_csbp.mcore.spec import layer_window

        super().__init__(config=config)
        self.block_size = block_size
        self.clean_attention = clean_attention
        self.query_scaling = query_scaling
        self.window = layer_window(config, layer_number)
        self.key_start, self.prompt = 0, False  # this call's (`SamplingSelfAttention` sets them)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        rows, end = query.shape[0], self.key_start + key.shape[0]
        if self.query_scaling is not None:
            at = torch.arange(end - rows, end, device=query.device)
            query = query * self.query_scaling.scales(at).to(query.dtype)[:, None, None, None]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, rows, d]
        plan = _prefix_plan(query.device, self.key_start, end - rows, end, self.block_size, self.clean_attention,
                            self.window, self.prompt)
        if plan is None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale, enable_gqa=True)
        else:
            b, heads, _, d = q.shape
            grouped = q.reshape(b, k.shape[1], heads // k.shape[1], rows, d)  # query heads under their K/V head
            out = default_kernels(query.device).prefix_forward(grouped, k, v, plan, self.softmax_scale)[0]
            out = out.reshape(b, heads, rows, d)
        return out.permute(2, 0, 1, 3).reshape(rows, query.shape[1], -1)


def _row_bounds(first: int, end: int, block: int, clean_attention, window=GLOBAL, prompt=False, device=None):
    """Of rows `first..end-1` (the last block's noisy, the rows before it clean; with `prompt` all clean): the
    first clean key each sees (its window's start, 0 in a global layer) and the limit below which it sees keys
    (a noisy row: its block's end)."""
    rows = torch.arange(first, end, device=device)
    noisy = (rows >= (end - 1) // block * block) & (not prompt)
    limits = clean_attention.row_limits(rows, ~noisy, block) + noisy * block
    return window.starts(clean_attention.row_anchors(rows, ~noisy, block)), limits


@lru_cache(maxsize=16)
def _prefix_plan(device, key_start: int, first: int, end: int, block: int, clean_attention, window=GLOBAL,
                 prompt=False):
    """Rows `first..end-1` against keys `key_start..end-1` (`_row_bounds`), or None where every row sees every
    key (one plan per call, shared by every layer of the window)."""
    starts, limits = _row_bounds(first, end, block, clean_attention, window, prompt, device)
    if bool((starts <= key_start).all()) and bool((limits >= end).all()):
        return None
    return default_kernels(device).plan(limits, torch.arange(key_start, end, device=device),
                                        starts if window.sliding else None)


class SamplingContext(StaticInferenceContext):
    """megatron-core's static K/V cache context, and whether this call runs a prompt's committed rows alone
    (`prompt`: all clean rows, none of them being decoded)."""

    prompt = False


class _WindowCache(NamedTuple):
    """A sliding layer's cache: the K/V ([positions, batch, groups, d], before RoPE) of positions `first` on."""

    first: int
    key: torch.Tensor
    value: torch.Tensor


class SamplingSelfAttention(SelfAttention):
    """megatron-core's self-attention whose K/V cache, in a sliding layer, keeps only what the layer can still
    see: the `LEFT` positions before the active block and the block (a global layer keeps megatron-core's
    static cache, every position). Every later call's rows lie in or after the block holding this call's last
    row (the active block), so no row will see a position before `block start - LEFT` again; a call whose
    rows would need one is refused rather than computed wrong. The kept K/V are stored before RoPE, which is
    applied at their positions after they leave the cache, as megatron-core's cache does."""

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb,
                                        *args, **kwargs):
        core = self.core_attention
        core.prompt = bool(getattr(inference_context, "prompt", False))
        if inference_context is None or not core.window.sliding:
            core.key_start = 0
            return super()._adjust_key_value_for_inference(inference_context, query, key, value,
                                                           rotary_pos_emb, *args, **kwargs)
        if not inference_context.is_static_batching() or inference_context.batch_size_offset:
            raise ValueError("a sliding layer's cache takes a static context over the whole batch")
        start, block = inference_context.sequence_len_offset, core.block_size
        end = start + key.shape[0]
        cache = inference_context.key_value_memory_dict.get(self.layer_number) if start else None
        first = 0
        if start:
            first = max(0, int(_row_bounds(start, end, block, core.clean_attention, core.window, core.prompt)[0][0]))
            if cache is None or cache.first > first or cache.first + cache.key.shape[0] < start:
                raise ValueError(f"layer {self.layer_number}: rows from position {start} see positions from "
                                 f"{first} on, which its sliding cache no longer holds")
            key = torch.cat([cache.key[first - cache.first:start - cache.first], key])
            value = torch.cat([cache.value[first - cache.first:start - cache.first], value])
        keep = max(first, (end - 1) // block * block - core.window.left)  # what a later call can still see
        inference_context.key_value_memory_dict[self.layer_number] = _WindowCache(
            keep, key[keep - first:].clone(), value[keep - first:].clone())
        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb
            rotary_pos_emb = (q_pos_emb[start:end], k_pos_emb[first:end])
        core.key_start = first
        return query, key, value, rotary_pos_emb, AttnMaskType.no_mask, None


class SamplingGemma4SelfAttention(Gemma4SelfAttention, SamplingSelfAttention):
    """Gemma 4's attention (`mcore.gemma4_attention`: its shapes, norms and RoPE columns) with the sampler's K/V
    cache: Gemma 4's forward takes its layer's RoPE columns, then megatron-core's runs, whose cache step is
    `SamplingSelfAttention`'s (the global layers' K = V value is cached as any value)."""


class SideBySideRotary(torch.nn.Module):
    """Megatron's RoPE table (position = row index) with Gemma 4's global table after it
    (`gemma4_attention.side_by_side`), the one tensor training's model hands every layer too."""

    def __init__(self, rotary, global_inverse_frequencies):
        super().__init__()
        self.rotary, self.global_inverse_frequencies = rotary, global_inverse_frequencies

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.rotary.get_rotary_seq_len(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return side_by_side(self.rotary(*args, **kwargs), self.global_inverse_frequencies)


class SamplingGPTModel(GPTModel):
    """`GPTModel` with `BDLMGPTModel`'s input and output pieces: the embedding scale, the final-logit softcap
    (in fp32) and DiffusionGemma's self-conditioning block, which the active block's rows (the canvas: a call's
    last `block_size` rows, none in a prompt's call) pass as training's noisy rows do. `forward(...,
    self_conditioning_logits [b, block, V])`: the previous step's logits of the canvas; the signal is their
    expected input embedding, `softmax(logits) @ embedding x scale` (training's `_signal` of its own first
    pass; -inf columns take no probability), zero when None (the first step)."""

    def __init__(self, *args, block_size: int, self_conditioning=False, final_logit_softcapping=None,
                 embedding_scale=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.block_size = block_size
        self.self_conditioning = SelfConditioning(self.config) if self_conditioning else None
        self.final_logit_softcapping = final_logit_softcapping
        self.embedding_scale = embedding_scale
        global_frequencies = global_inverse_frequencies(self.config)
        if global_frequencies is not None:  # Gemma 4: each layer type its own RoPE columns
            self.rotary_pos_emb = SideBySideRotary(self.rotary_pos_emb, global_frequencies)

    def forward(self, input_ids, position_ids, attention_mask, *args, inference_context=None,
                self_conditioning_logits=None, **kwargs):
        if self_conditioning_logits is not None and self.self_conditioning is None:
            raise ValueError("self-conditioning logits were given to a model without a self-conditioning block")
        decoder_input = None
        if self.embedding_scale is not None or self.self_conditioning is not None:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
            if self.embedding_scale is not None:
                decoder_input = decoder_input * torch.tensor(self.embedding_scale, dtype=decoder_input.dtype)
            if self.self_conditioning is not None and not getattr(inference_context, "prompt", False):
                clean, canvas = decoder_input[:-self.block_size], decoder_input[-self.block_size:]
                signal = (torch.zeros_like(canvas) if self_conditioning_logits is None else
                          self._soft_embeddings(self_conditioning_logits).transpose(0, 1).to(canvas.dtype))
                decoder_input = torch.cat([clean, self.self_conditioning(canvas, signal)])
        logits = super().forward(input_ids, position_ids, attention_mask, *args, decoder_input=decoder_input,
                                 inference_context=inference_context, **kwargs)
        return softcapped(logits.float(), self.final_logit_softcapping) if self.final_logit_softcapping else logits

    def _soft_embeddings(self, logits):
        """`[b, n, h]`: the softmax of `logits [b, n, V]` (every column, gathered; or the real ids' only, the rest
        then without probability) times this TP rank's rows of the input embedding, summed over TP, times the
        embedding scale."""
        weight = self.embedding.word_embeddings.weight
        first = self.pg_collection.tp.rank() * weight.shape[0]
        probabilities = logits.softmax(-1, dtype=torch.float32)  # columns past the logits' (padding) take none
        probabilities = torch.nn.functional.pad(probabilities, (0, self.vocab_size - probabilities.shape[-1]))
        probabilities = probabilities[..., first:first + weight.shape[0]]
        signal = probabilities.to(weight.dtype) @ weight
        if self.pg_collection.tp.size() > 1:
            torch.distributed.all_reduce(signal, group=self.pg_collection.tp)
        if self.embedding_scale is not None:
            signal = signal * torch.tensor(self.embedding_scale, dtype=signal.dtype)
        return signal


def sampling_model(config, vocab_size: int, block_size: int, clean_attention=BLOCK_CAUSAL,
                   positions: RotaryPositions | None = None, self_conditioning: bool = False,
                   final_logit_softcapping: float | None = None, embedding_scale: float | None = None, **gpt_kwargs):
    """A `GPTModel` with `BDLMGPTModel`'s parameters (the CSBP layer spec, its norms; DiffusionGemma's
    `self_conditioning` block, `final_logit_softcapping` and `embedding_scale` as training's model takes them) and the
    BDLM mask over position-ordered rows (`SamplingAttention`, with the model's clean-attention rule); load any BDLM
    checkpoint into it. One pipeline stage, no sequence or context parallelism. `positions`: YaRN (megatron-core's
    own, as training's) and the query scaling (`SamplingAttention`'s), default plain RoPE."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_csbp.mcore import spec as csbp_spec
    from megatron_csbp.mcore.model import set_rotary_config

    positions = positions or RotaryPositions()

    _require(config.pipeline_model_parallel_size == 1 and config.context_parallel_size == 1,
             "sampling runs one pipeline stage without context/block parallelism: use "
             "--tensor-model-parallel-size only")
    _require(not config.sequence_parallel, "sampling does not use sequence parallelism: drop --sequence-parallel")
    attention = ModuleSpec(module=SamplingAttention,
                           params={"block_size": block_size, "clean_attention": clean_attention,
                                   "query_scaling": positions.query_scaling})
    if getattr(config, "gemma4_moe", False):  # as training's: Gemma 4's block (and attention) in every layer
        try:
            layers = gemma4_moe.get_gemma4_block_spec(config)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    elif config.num_moe_experts:  # as training's (model.model_provider): megatron-core's MoE and dense layers
        layers = csbp_spec.get_csbp_block_spec(config)
    else:
        layer = csbp_spec.get_csbp_layer_spec(qk_layernorm=config.qk_layernorm)  # as training's
        layers = TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers,
                                            layer_norm=csbp_spec.SequenceParallelTorchNorm)
    sampler_attention = {SelfAttention: SamplingSelfAttention, Gemma4SelfAttention: SamplingGemma4SelfAttention}
    for layer in {id(spec): spec for spec in layers.layer_specs}.values():
        module = layer.submodules.self_attention.module
        _require(module in sampler_attention,
                 f"sampling takes megatron-core's SelfAttention or Gemma 4's, not {module}")
        layer.submodules.self_attention.module = sampler_attention[module]
        layer.submodules.self_attention.submodules.core_attention = attention
    gpt_kwargs.setdefault("position_embedding_type", positions.embedding_type)
    set_rotary_config(config, positions)
    with gemma4_moe.quiet_about_its_layer(getattr(config, "gemma4_moe", False)):
        return SamplingGPTModel(config=config, transformer_layer_spec=layers, vocab_size=vocab_size,
                                block_size=block_size, self_conditioning=self_conditioning,
                                final_logit_softcapping=final_logit_softcapping, embedding_scale=embedding_scale,
                                **gpt_kwargs)


class _BlockLogits:
    """Logits of the active block's positions given the committed prefix, counting the model calls.

    With the cache, the rows committed since the last call run once, in the same call as the active block
    (their K/V stay, the offset moves past them; a long prompt runs on its own first, all clean rows
    (`SamplingContext.prompt`), with the head on its last row only); without it, every call runs the whole sequence from position 0. `committed` starts at
    position 0 of what the model sees (the context window's start).
    """

    def __init__(self, model, batch_size: int, max_length: int, settings: SamplingSettings):
        self.model, self.settings = model, settings
        self.context = SamplingContext(batch_size, max_length)
        self.cached = 0  # committed positions whose K/V are in the cache
        self.last_row = None  # logits of the last committed row (shifted labels)
        self.calls = self.rows = 0

    def _run(self, tokens, last_row_only: bool, self_conditioning=None):
        self.context.materialize_only_last_token_logits = last_row_only
        self.context.prompt = last_row_only  # a long prompt's rows alone: all committed
        positions = self.context.sequence_len_offset + torch.arange(tokens.shape[1], device=tokens.device)
        signal = {}
        if getattr(self.model, "self_conditioning", None) is not None and not last_row_only:
            signal["self_conditioning_logits"] = self_conditioning
        logits = self.model(tokens, positions.expand_as(tokens), None, inference_context=self.context,
                            runtime_gather_output=True, **signal)
        self.calls += 1
        self.rows += tokens.shape[0] * tokens.shape[1]
        logits = logits.float()
        logits[..., self.settings.mask_token_id] = float("-inf")
        if self.settings.vocab_size is not None:
            logits[..., self.settings.vocab_size:] = float("-inf")
        for token in self.settings.suppressed_token_ids:
            logits[..., token] = float("-inf")
        return logits

    def restart(self) -> None:
        """Forget the cache: the next call runs its committed rows from position 0 (a moved context window)."""
        self.context.reset()
        self.cached, self.last_row = 0, None

    def _commit(self, start: int) -> None:
        if self.settings.kv_cache:
            self.context.sequence_len_offset = self.cached = start

    def __call__(self, committed, block, self_conditioning=None):
        """Logits `[b, B, V]` of `block`'s positions after `committed`; `self_conditioning`: the previous step's
        logits of the block, which a model with a self-conditioning block takes (one without ignores them)."""
        start = committed.shape[1]
        if not self.settings.kv_cache:
            self.context.reset()
        new = committed[:, self.cached:]
        if self.settings.kv_cache and new.shape[1] > self.settings.block_size:
            self.last_row = self._run(new, last_row_only=True)
            self._commit(start)
            new = new[:, :0]
        logits = self._run(torch.cat([new, block], dim=1), last_row_only=False, self_conditioning=self_conditioning)
        if new.shape[1]:
            self.last_row = logits[:, new.shape[1] - 1:new.shape[1]]
        self._commit(start)
        logits = logits[:, new.shape[1]:]
        if self.settings.shifted_labels:  # position p is predicted by row p-1
            first = self.last_row if start else torch.zeros_like(logits[:, :1])  # position 0 is a prompt token
            logits = torch.cat([first, logits[:, :-1]], dim=1)
        return logits


# ---------------------------------------------------------------------------------------------- decoding
def draw_tokens(logits, settings: SamplingSettings, generator):
    """Per position: the token to write if it is unmasked, and its confidence (see the module doc)."""
    method = settings.method
    if settings.temperature == 0.0:
        confidence, tokens = logits.softmax(-1).max(-1)
        return tokens, confidence
    scaled = logits / settings.temperature
    if settings.top_k:
        kth = scaled.topk(min(settings.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        kept = sorted_probs * method.nucleus(sorted_probs, settings.top_p)
        probs = torch.zeros_like(probs).scatter(-1, order, kept)
        probs = probs / probs.sum(-1, keepdim=True)
    tokens = torch.multinomial(probs.flatten(0, -2), 1, generator=generator).view(probs.shape[:-1])
    source = logits.softmax(-1) if method.confidence_before_temperature else probs
    return tokens, source.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def random_ids(shape, settings: SamplingSettings, generator, device):
    """Uniform random real ids (below `settings.vocab_size`, MASK skipped), as the uniform-state corruption draws
    them: one `torch.randint` over the ids that may be drawn."""
    skips_mask = settings.mask_token_id < settings.vocab_size
    ids = torch.randint(0, settings.vocab_size - skips_mask, shape, generator=generator, device=device)
    return ids + (ids >= settings.mask_token_id) if skips_mask else ids


def _entropy(logits, free):
    """Per position, the entropy of softmax(logits) (torch's `Categorical`, as the reference); 0 where not `free`."""
    return torch.distributions.Categorical(logits=logits).entropy().masked_fill(~free, 0.0)


def denoise_canvas(canvas_logits: Callable, block, free, settings: SamplingSettings, generator):
    """`--strategy diffusion-gemma`'s decoding of one block (`DiffusionGemma`'s docstring): the block's tokens `[b, B]`.

    `canvas_logits(canvas [b, B], self_conditioning [b, B, V] or None) -> [b, B, V]` (fp32): the model's logits of
    the canvas given the committed prefix and the previous step's processed logits; our model's (`_BlockLogits`)
    or, in the tests, transformers' decoder. `block`: the positions that are not `free` hold prompt tokens, kept.
    Draws from `generator`, in the reference's order: the canvas, then per step the tokens (`torch.multinomial` over
    [b * B, V], V `settings.drawn_columns`: the draw depends on the width, and the reference's logits hold its
    vocabulary only, not the MASK appended after it nor the padding) and the renoising ids, every sample alike."""
    batch, size = block.shape
    steps = settings.steps_per_block
    canvas = torch.where(free, random_ids((batch, size), settings, generator, block.device), block)
    best, signal = canvas, None
    finished = torch.zeros(batch, dtype=torch.bool, device=block.device)
    history = [torch.full_like(block, -1)] * (settings.stability_threshold if settings.early_stop else 0)
    for remaining in range(steps, 0, -1):
        raw = canvas_logits(canvas, signal)[..., :settings.drawn_columns]
        temperature = settings.t_min + (settings.t_max - settings.t_min) * (
            torch.tensor(remaining, dtype=torch.int32, device=raw.device) / steps)  # in fp32, as the reference
        logits = raw / temperature
        drawn = torch.multinomial(logits.softmax(-1, dtype=torch.float32).view(-1, logits.shape[-1]), 1,
                                  generator=generator).view(batch, size)
        argmax = torch.where(free, logits.argmax(-1), block)
        entropy, order = _entropy(logits, free).sort(-1)
        accepted = torch.zeros_like(free).scatter(-1, order, entropy.cumsum(-1) - entropy <= settings.entropy_bound)
        renoised = random_ids((batch, size), settings, generator, block.device)
        following = torch.where(free, torch.where(accepted, drawn, renoised), block)
        if settings.early_stop:
            if bool(finished.any()):  # a stopped sample keeps its canvas, argmax and logits
                argmax = torch.where(finished[:, None], best, argmax)
                following = torch.where(finished[:, None], canvas, following)
                logits = torch.where(finished[:, None, None], signal, logits)
            stable = torch.ones_like(finished)
            for earlier in history:
                stable &= (earlier == argmax).all(-1)
            history = history[1:] + [argmax] if history else history
            finished |= stable & (_entropy(logits, free).mean(-1) < settings.confidence_threshold)
        canvas, best, signal = following, argmax, logits
        if bool(finished.all()):
            break
    return best


def first_stop(tokens: list, stops) -> int | None:
    """Where the earliest of the stop sequences (tuples of ids) starts in `tokens`, or None."""
    found = [i for stop in stops for i in range(len(tokens) - len(stop) + 1) if tuple(tokens[i:i + len(stop)]) == stop]
    return min(found, default=None)


def positions_seen(prompt_lengths: list, max_new_tokens: int, settings: SamplingSettings) -> int:
    """The most positions the model sees at once: the blocks up to the last one decoded, or the window."""
    blocks = -(-(max(max(prompt_lengths), 1) + max_new_tokens) // settings.block_size)
    return min(blocks * settings.block_size, settings.context_window or blocks * settings.block_size)


def past_trained_length(prompt_lengths: list, max_new_tokens: int, settings: SamplingSettings,
                        trained_length: int) -> str | None:
    """One line of warning when the model would see positions past those it was trained on (it decodes noise
    there), or None."""
    seen = positions_seen(prompt_lengths, max_new_tokens, settings)
    if seen <= trained_length:
        return None
    if settings.context_window is not None:
        return (f"--context-window {settings.context_window} is longer than the trained length {trained_length} "
                f"(--seq-length): positions past it are untrained; give a window <= {trained_length}")
    window = trained_length // settings.block_size * settings.block_size
    longest = max(prompt_lengths)
    what = (f"the longest prompt ({longest} tokens) is longer than" if longest > trained_length else
            f"the longest prompt ({longest} tokens) plus --max-new-tokens {max_new_tokens} reaches position "
            f"{seen}, past")
    return (f"{what} the trained length {trained_length} (--seq-length): positions past it are untrained and "
            f"decode noise; --context-window {window} keeps the model within it")


class Generation(NamedTuple):
    tokens: list  # per prompt: the new tokens, cut before the first EOS or stop sequence
    model_calls: int
    model_rows: int  # token rows run through the model, summed over calls and prompts
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.tokens) / max(self.seconds, 1e-9)


def generate(model, prompts: list, max_new_tokens: int, settings: SamplingSettings,
             on_step: Callable | None = None) -> Generation:
    """Decodes `max_new_tokens` after each prompt (lists of ids), all prompts in lockstep, block by block.

    `on_step(block_index, committed [b, c], block [b, B], logits [b, B, V])` is called before every
    denoising step (for tests; `committed` is what the model sees before the block). Prompts may differ in
    length: positions before a prompt's end are its tokens, fixed from the start. An empty prompt starts
    from `settings.start_token_id` (as BD3-LM's unconditional samples start from BOS).
    """
    _require(len(prompts) >= 1, "give at least one prompt")
    _require(max_new_tokens >= 1, f"--max-new-tokens {max_new_tokens} must be >= 1")
    _require(all(prompts) or settings.start_token_id is not None,
             "an empty prompt (unconditional generation) needs a start token: settings.start_token_id")
    _require(all(settings.mask_token_id not in p for p in prompts),
             f"a prompt contains the MASK id {settings.mask_token_id}")
    started = time.time()
    prompts = [list(p) if p else [settings.start_token_id] for p in prompts]
    num_blocks = -(-max(len(p) + max_new_tokens for p in prompts) // settings.block_size)
    window = min(settings.context_window or num_blocks * settings.block_size, num_blocks * settings.block_size)
    block_logits = _BlockLogits(model, len(prompts), window, settings)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = decode(block_logits, prompts, max_new_tokens, settings, next(model.parameters()).device, on_step)
    finally:
        model.train(was_training)
    return Generation(outputs, block_logits.calls, block_logits.rows, time.time() - started)


def decode(block_logits, prompts: list, max_new_tokens: int, settings: SamplingSettings, device,
           on_step: Callable | None = None) -> list:
    """`generate`'s decoding (its docstring) of non-empty `prompts` from `block_logits(committed, block,
    self_conditioning=None) -> [b, B, V]` (`_BlockLogits`: our model; tests give transformers' decoder): the new
    tokens of each prompt, cut before its first EOS or stop sequence."""
    B, method = settings.block_size, settings.method
    lengths = [len(p) for p in prompts]
    ends = [n + max_new_tokens for n in lengths]
    num_blocks = -(-max(ends) // B)
    sequence = torch.full((len(prompts), num_blocks * B), settings.mask_token_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        sequence[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    window = settings.context_window or num_blocks * B
    sub_blocks = settings.sub_blocks
    sub_steps = [even_split(settings.steps_per_block, len(sub_blocks), part) for part in range(len(sub_blocks))]
    finished, window_start = [False] * len(prompts), 0
    longest_stop = max(map(len, settings.stops), default=1)
    for index in range(min(lengths) // B, num_blocks):
        start, end = index * B, (index + 1) * B
        if max(0, end - window) != window_start:
            window_start = max(0, end - window)
            block_logits.restart()
        committed, block = sequence[:, window_start:start], sequence[:, start:end].clone()
        seen = logits = None

        def current_logits():
            nonlocal seen, logits
            if seen is None or not torch.equal(seen, block):  # nothing changed: the logits still hold
                logits, seen = block_logits(committed, block), block.clone()
            return logits

        def canvas_logits(canvas, self_conditioning):
            logits = block_logits(committed, canvas, self_conditioning)
            if on_step is not None:
                on_step(index, committed, canvas, logits)
            return logits

        if method.corruption == UNIFORM_STATE:
            block = denoise_canvas(canvas_logits, block, block == settings.mask_token_id, settings, generator)
        if method.first_token_by_argmax and bool((block[:, 0] == settings.mask_token_id).any()):
            first = current_logits()[:, 0].argmax(-1)  # the previous clean block's last row
            block[:, 0] = torch.where(block[:, 0] == settings.mask_token_id, first, block[:, 0])
        for (lo, hi), steps in zip(sub_blocks, sub_steps):
            masked_at_start = (block[:, lo:hi] == settings.mask_token_id).sum(1)
            for step in range(steps):
                masked = block[:, lo:hi] == settings.mask_token_id
                if not bool(masked.any()):
                    break
                step_logits = current_logits()
                if on_step is not None:
                    on_step(index, committed, block, step_logits)
                tokens, confidence = draw_tokens(step_logits[:, lo:hi], settings, generator)
                chosen = method.commit(Step(masked, confidence, step, steps, masked_at_start, B,
                                            settings.threshold, generator))
                block[:, lo:hi] = torch.where(chosen, tokens, block[:, lo:hi])
        sequence[:, start:end] = block
        for row in range(len(prompts)):  # done: all its tokens are there, or it has produced a stop
            since = max(lengths[row], start - longest_stop + 1)  # a stop may begin in the block before
            produced = sequence[row, since:min(end, ends[row])].tolist()
            finished[row] |= end >= ends[row] or first_stop(produced, settings.stops) is not None
        if all(finished):
            break
    outputs = []
    for row in range(len(prompts)):
        new = sequence[row, lengths[row]:ends[row]].tolist()
        cut = first_stop(new, settings.stops)
        outputs.append(new if cut is None else new[:cut])
    return outputs
