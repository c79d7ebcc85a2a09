"""Block-diffusion sampling: semi-autoregressive decoding from a trained BDLM, one block at a time.

A new block starts as MASK tokens (prompt tokens that fall into it stay as they are) and is denoised in
at most `steps_per_block` model calls. Each call predicts every position of the block from the committed
clean prefix and the block's current tokens; a strategy then unmasks some masked positions. Committed
tokens, the prompt's included, never change. EOS (the tokenizer's EOD) ends a sample.

Why the sampler's model is a plain megatron-core `GPTModel`. While sampling, each position holds exactly
one row: committed blocks as clean rows (`x0`), the active block as its noisy rows (`x_t`). The training
mask restricted to such rows (a noisy row of block `b` sees its own block and the clean blocks before it;
a clean row of block `k` the clean blocks up to `k`) reads: a row sees the rows of blocks up to its own.
That is a block-causal mask over an ordinary sequence, so sampling and training agree by construction,
and the trained weights run as a `GPTModel` whose core attention is `BlockCausalAttention`, with
Megatron's own RoPE (the position is the row index) and its static K/V cache (`StaticInferenceContext`):
a committed block's K/V are written once and kept (the offset moves past them); the active block's are
written after them and overwritten by the next call. Keys are position-encoded per token after they
leave the cache, so cached and recomputed K/V are the same numbers. Its parameters are those of
`BDLMGPTModel`, so any of our checkpoints loads into it.

A clean row equals a fully unmasked noisy row (same tokens, same visible rows). The Fast-dLLM v2
objective's shifted labels need that: position `p` is predicted by row `p-1`, which for the first
position of a block is the previous block's last clean row, whose logits the commit call returns.

Strategies (`S` steps per block; at step `k`, `S-k` are left and `m` positions are still masked):
* "confidence" (Fast-dLLM v2 / LLaDA2 threshold decoding): unmask every masked position whose predicted
  token has probability above `threshold`, and at least the ceil(m/(S-k)) most confident ones (so at
  least one per step, and the block is complete after `S` steps).
* "top-k" (LLaDA's low-confidence remasking): the ceil(m/(S-k)) most confident.
* "posterior" (BD3-LM's DDPM sampler, linear schedule `t = 1 - k/S`): each masked position unmasks with
  the posterior's probability (t-s)/t = 1/(S-k), so the last step unmasks the rest.
* "first-hitting" (BD3-LM's first-hitting sampler): exactly one uniformly chosen masked position per step
  (our model is not time-conditioned, so the hitting times need not be drawn); needs `S >= block size`.
Tokens are the argmax at temperature 0, otherwise drawn from softmax(logits / T) cut to the top-p
nucleus; "confidence" is the probability of the chosen token under that distribution.
"""

import math
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, NamedTuple

import torch
from megatron.core.transformer.module import MegatronModule

from megatron_csbp.training.arguments import ConfigError
from megatron_csbp.core.kernels import default_kernels

STRATEGIES = ("confidence", "top-k", "posterior", "first-hitting")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class SamplingSettings:
    """How to decode: the model's block size and MASK id, and the decoding method (flag names in messages)."""

    block_size: int
    mask_token_id: int
    steps_per_block: int
    strategy: str = "confidence"
    threshold: float = 0.9
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    eos_token_id: int | None = None  # None: generate max_new_tokens whatever comes
    shifted_labels: bool = False  # trained with --bdlm-objective fast-dllm-v2: row p predicts token p+1
    vocab_size: int | None = None  # ids >= vocab_size (vocabulary padding) are never produced
    kv_cache: bool = True

    def __post_init__(self):
        _require(self.block_size >= 1, f"block size {self.block_size} must be >= 1")
        _require(self.steps_per_block >= 1, f"--steps-per-block {self.steps_per_block} must be >= 1")
        _require(self.strategy in STRATEGIES, f"--strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        _require(self.strategy != "first-hitting" or self.steps_per_block >= self.block_size,
                 f"--strategy first-hitting unmasks one token per step: --steps-per-block {self.steps_per_block} "
                 f"must be >= the block size {self.block_size}")
        _require(0.0 <= self.threshold <= 1.0, f"--threshold {self.threshold} must be a probability in [0, 1]")
        _require(self.temperature >= 0.0, f"--temperature {self.temperature} must be >= 0 (0: greedy)")
        _require(0.0 < self.top_p <= 1.0, f"--top-p {self.top_p} must be in (0, 1]")
        _require(self.seed >= 0, f"--seed {self.seed} must be >= 0")


# ------------------------------------------------------------------------------------------------ the model
class BlockCausalAttention(MegatronModule):
    """Core attention of the sampling model: the BDLM mask over position-ordered rows (see module doc).

    Megatron's static inference hands it the queries of this call's rows and the keys of the whole cached
    sequence up to them, so the queries are the last rows: a query at position `p` sees the keys below
    the end of its block. A call whose rows lie in one block (every denoising step) sees every key, so
    it is plain attention; a call over several blocks (a prompt) uses the training kernels' prefix
    attention, which never builds a rows x keys mask.
    """

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self", attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, block_size: int = 1, **unused):
        super().__init__(config=config)
        self.block_size = block_size
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        rows, keys, block = query.shape[0], key.shape[0], self.block_size
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, rows, d]
        first = keys - rows
        if first // block == (keys - 1) // block:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale, enable_gqa=True)
        else:
            b, heads, _, d = q.shape
            plan = _prefix_plan(query.device, first, keys, block)
            grouped = q.reshape(b, k.shape[1], heads // k.shape[1], rows, d)  # query heads under their K/V head
            out = default_kernels(query.device).prefix_forward(grouped, k, v, plan, self.softmax_scale)[0]
            out = out.reshape(b, heads, rows, d)
        return out.permute(2, 0, 1, 3).reshape(rows, query.shape[1], -1)


@lru_cache(maxsize=8)
def _prefix_plan(device, first: int, keys: int, block: int):
    """Rows `first..keys-1` against keys `0..keys-1`: each sees the keys below the end of its block (one
    plan per call, shared by every layer)."""
    positions = torch.arange(keys, device=device)
    limits = (positions[first:] // block + 1) * block
    return default_kernels(device).plan(limits, positions)


def sampling_model(config, vocab_size: int, block_size: int, **gpt_kwargs):
    """A `GPTModel` with `BDLMGPTModel`'s parameters (the CSBP layer spec, its norms) and block-causal
    core attention; load any BDLM checkpoint into it. One pipeline stage, no sequence or context parallelism."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_csbp.mcore import spec as csbp_spec

    _require(config.pipeline_model_parallel_size == 1 and config.context_parallel_size == 1,
             "sampling runs one pipeline stage without context/block parallelism: use "
             "--tensor-model-parallel-size only")
    _require(not config.sequence_parallel, "sampling does not use sequence parallelism: drop --sequence-parallel")
    layer = csbp_spec.get_csbp_layer_spec(qk_layernorm=config.qk_layernorm)  # as training's (model.model_provider)
    layer.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=BlockCausalAttention, params={"block_size": block_size})
    layers = TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers,
                                        layer_norm=csbp_spec.SequenceParallelTorchNorm)
    gpt_kwargs.setdefault("position_embedding_type", "rope")
    return GPTModel(config=config, transformer_layer_spec=layers, vocab_size=vocab_size, **gpt_kwargs)


class _BlockLogits:
    """Logits of the active block's positions given the committed prefix, counting the model calls.

    With the cache, the rows committed since the last call run once, in the same call as the active block
    (their K/V stay, the offset moves past them; a long prompt runs on its own first, with the head on its
    last row only); without it, every call runs the whole sequence from position 0.
    """

    def __init__(self, model, batch_size: int, max_length: int, settings: SamplingSettings):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.model, self.settings = model, settings
        self.context = StaticInferenceContext(batch_size, max_length)
        self.cached = 0  # committed positions whose K/V are in the cache
        self.last_row = None  # logits of the last committed row (shifted labels)
        self.calls = self.rows = 0

    def _run(self, tokens, last_row_only: bool):
        self.context.materialize_only_last_token_logits = last_row_only
        positions = self.context.sequence_len_offset + torch.arange(tokens.shape[1], device=tokens.device)
        logits = self.model(tokens, positions.expand_as(tokens), None, inference_context=self.context,
                            runtime_gather_output=True)
        self.calls += 1
        self.rows += tokens.shape[0] * tokens.shape[1]
        logits = logits.float()
        logits[..., self.settings.mask_token_id] = float("-inf")
        if self.settings.vocab_size is not None:
            logits[..., self.settings.vocab_size:] = float("-inf")
        return logits

    def _commit(self, start: int) -> None:
        if self.settings.kv_cache:
            self.context.sequence_len_offset = self.cached = start

    def __call__(self, committed, block):
        start = committed.shape[1]
        if not self.settings.kv_cache:
            self.context.reset()
        new = committed[:, self.cached:]
        if self.settings.kv_cache and new.shape[1] > self.settings.block_size:
            self.last_row = self._run(new, last_row_only=True)
            self._commit(start)
            new = new[:, :0]
        logits = self._run(torch.cat([new, block], dim=1), last_row_only=False)
        if new.shape[1]:
            self.last_row = logits[:, new.shape[1] - 1:new.shape[1]]
        self._commit(start)
        logits = logits[:, new.shape[1]:]
        if self.settings.shifted_labels:  # position p is predicted by row p-1
            first = self.last_row if start else torch.zeros_like(logits[:, :1])  # position 0 is a prompt token
            logits = torch.cat([first, logits[:, :-1]], dim=1)
        return logits


# -------------------------------------------------------------------------------------------- strategies
def _predict(logits, settings: SamplingSettings, generator):
    """Per position: the token to write if it is unmasked, and its probability (the confidence)."""
    if settings.temperature == 0.0:
        confidence, tokens = logits.softmax(-1).max(-1)
        return tokens, confidence
    probs = (logits / settings.temperature).softmax(-1)
    if settings.top_p < 1.0:  # the smallest set of most likely tokens holding top_p of the mass
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= settings.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    tokens = torch.multinomial(probs.flatten(0, -2), 1, generator=generator).view(probs.shape[:-1])
    return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _most(score, masked, count):
    """The `count[i]` masked positions of row `i` with the highest score."""
    order = score.masked_fill(~masked, float("-inf")).argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return masked & (rank < count.unsqueeze(1))


def unmask_step(block, logits, steps_left: int, settings: SamplingSettings, generator):
    """One denoising step of `block` [b, B] from its logits [b, B, V]: some masked positions get a token."""
    masked = block == settings.mask_token_id
    tokens, confidence = _predict(logits, settings, generator)
    remaining = masked.sum(1)
    even_share = (remaining + steps_left - 1) // steps_left
    uniform = torch.rand(masked.shape, generator=generator, device=masked.device)
    if settings.strategy == "posterior":
        chosen = masked & (uniform * steps_left < 1.0)  # probability 1/(S-k); 1 at the last step
    elif settings.strategy == "first-hitting":
        chosen = _most(uniform, masked, remaining.clamp(max=1))
    elif settings.strategy == "top-k":
        chosen = _most(confidence, masked, even_share)
    else:
        confident = (masked & (confidence > settings.threshold)).sum(1)
        chosen = _most(confidence, masked, torch.maximum(even_share, confident))
    return torch.where(chosen, tokens, block)


# ---------------------------------------------------------------------------------------------- decoding
class Generation(NamedTuple):
    tokens: list  # per prompt: the new tokens, cut before the first EOS
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
    denoising step (for tests). Prompts may differ in length: positions before a prompt's end are its
    tokens, fixed from the start.
    """
    _require(len(prompts) >= 1 and all(len(p) >= 1 for p in prompts), "every prompt needs at least one token")
    _require(max_new_tokens >= 1, f"--max-new-tokens {max_new_tokens} must be >= 1")
    _require(all(settings.mask_token_id not in p for p in prompts),
             f"a prompt contains the MASK id {settings.mask_token_id}")
    started = time.time()
    B, device = settings.block_size, next(model.parameters()).device
    lengths = [len(p) for p in prompts]
    ends = [n + max_new_tokens for n in lengths]
    num_blocks = -(-max(ends) // B)
    sequence = torch.full((len(prompts), num_blocks * B), settings.mask_token_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        sequence[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    block_logits = _BlockLogits(model, len(prompts), num_blocks * B, settings)
    finished = [False] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for index in range(min(lengths) // B, num_blocks):
                start, end = index * B, (index + 1) * B
                committed, block = sequence[:, :start], sequence[:, start:end]
                seen, logits = None, None
                for step in range(settings.steps_per_block):
                    if not bool((block == settings.mask_token_id).any()):
                        break
                    if seen is None or not torch.equal(seen, block):  # nothing changed: the logits still hold
                        logits, seen = block_logits(committed, block), block
                    if on_step is not None:
                        on_step(index, committed, block, logits)
                    block = unmask_step(block, logits, settings.steps_per_block - step, settings, generator)
                sequence[:, start:end] = block
                for row in range(len(prompts)):  # done: all its tokens are there, or it has produced EOS
                    produced = sequence[row, lengths[row]:min(end, ends[row])]
                    finished[row] |= end >= ends[row] or (settings.eos_token_id is not None and
                                                          bool((produced == settings.eos_token_id).any()))
                if all(finished):
                    break
    finally:
        model.train(was_training)
    outputs = []
    for row in range(len(prompts)):
        new = sequence[row, lengths[row]:ends[row]].tolist()
        if settings.eos_token_id is not None and settings.eos_token_id in new:
            new = new[:new.index(settings.eos_token_id)]
        outputs.append(new)
    return Generation(outputs, block_logits.calls, block_logits.rows, time.time() - started)
