"""Block-diffusion sampling: every strategy decodes as its authors' code does (our tokens equal, token by token
on fixed seeds, a restatement of each published rule written here), the sampler's logits are the training
forward's, the K/V cache changes nothing, stop sequences / EOS suppression / unconditional prompts / the context
window do what they say, a briefly trained model completes its corpus (an untrained one does not) on 1 rank
and under TP 2, and generate_bdlm.py refuses bad input in one line."""

import ast
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from spawn import run_ranks
from pretrain_runs import TORCHRUN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, BLOCK, VOCAB, MASK = 32, 4, 32, 31
TOLERANCE = 1e-5
BD3LM_RULES = ("posterior", "first-hitting")


def _settings(**overrides):
    from megatron_csbp.tools.sampling import SamplingSettings

    fields = dict(block_size=BLOCK, mask_token_id=MASK, steps_per_block=BLOCK)
    fields.update(overrides)
    return SamplingSettings(**fields)


# ------------------------------------------------------------------------------------------ strategies alone
@pytest.mark.parametrize("strategy", ["confidence", "fast-dllm-v2", "top-k", "posterior", "first-hitting"])
@pytest.mark.parametrize("steps", [3, 8, 13])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_strategy_unmasks_a_block_within_its_steps_and_keeps_unmasked_tokens(strategy, steps, temperature):
    """Driven as `generate` drives a block: sub-blocks in order, each with its share of the steps."""
    from megatron_csbp.tools.sampling import Step, draw_tokens, even_split

    block_size = 8
    if strategy == "first-hitting" and steps < block_size:
        with pytest.raises(ValueError, match="--steps-per-block 3 must be >= the block size 8"):
            _settings(block_size=block_size, strategy=strategy, steps_per_block=steps)
        return
    settings = _settings(block_size=block_size, strategy=strategy, steps_per_block=steps, temperature=temperature,
                         top_p=0.9, threshold=0.3, sub_block_size=4 if strategy == "fast-dllm-v2" else None,
                         shifted_labels=strategy == "fast-dllm-v2")
    generator = torch.Generator().manual_seed(steps)
    block = torch.full((5, block_size), MASK)
    fixed = torch.rand(5, block_size, generator=generator) < 0.3  # prompt tokens already in the block
    block[fixed] = torch.randint(0, MASK, (int(fixed.sum()),), generator=generator)
    parts = settings.sub_blocks
    assert parts == ([(0, 4), (4, 8)] if strategy == "fast-dllm-v2" else [(0, 8)])
    for part, (lo, hi) in enumerate(parts):
        share = even_split(steps, len(parts), part)
        at_start = (block[:, lo:hi] == MASK).sum(1)
        for step in range(share):
            masked = block[:, lo:hi] == MASK
            logits = 4 * torch.randn(5, hi - lo, VOCAB, generator=generator)
            logits[..., MASK] = float("-inf")
            tokens, confidence = draw_tokens(logits, settings, generator)
            chosen = settings.method.commit(Step(masked, confidence, step, share, at_start, block_size,
                                                 settings.threshold, generator))
            assert not bool((chosen & ~masked).any()), "an unmasked token changed"
            unmasked = chosen.sum(1)
            if strategy == "first-hitting":
                assert torch.equal(unmasked, masked.sum(1).clamp(max=1))
            elif strategy in ("fast-dllm-v2", "confidence"):
                assert bool((unmasked >= masked.any(1).long()).all()), "a step unmasked nothing"
                if temperature == 0.0:
                    confident = masked & (logits.softmax(-1).max(-1).values > settings.threshold)
                    assert bool(chosen[confident].all()), "a position above the threshold stayed masked"
            block[:, lo:hi] = torch.where(chosen, tokens, block[:, lo:hi])
        assert not bool((block[:, lo:hi] == MASK).any()), f"{strategy}: masked positions left after {share} steps"


def test_nucleus_rules_and_settings_refuse_bad_values():
    """BD3-LM keeps the sorted tokens with cumulative probability <= p; the others keep the one crossing p too;
    each strategy states which it uses."""
    from megatron_csbp.tools.sampling import STRATEGY, nucleus_crossing_p, nucleus_within_p

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert nucleus_within_p(probs, 0.6).tolist() == [[True, False, False, False]]
    assert nucleus_crossing_p(probs, 0.6).tolist() == [[True, True, False, False]]
    assert nucleus_within_p(probs, 0.4).tolist() == [[True, False, False, False]]  # the first always
    assert nucleus_crossing_p(probs, 0.9).tolist() == [[True, True, True, False]]
    assert {name: s.nucleus is nucleus_within_p for name, s in STRATEGY.items()} == {
        "confidence": False, "fast-dllm-v2": False, "top-k": False, "posterior": True, "first-hitting": True,
        "diffusion-gemma": False}  # diffusion-gemma takes no --top-p (it draws from the whole distribution)
    for fields, flag in [(dict(steps_per_block=0), "--steps-per-block 0 must be >= 1"),
                         (dict(strategy="best"), "--strategy"), (dict(threshold=1.5), "--threshold"),
                         (dict(temperature=-1.0), "--temperature"), (dict(top_p=0.0), "--top-p"),
                         (dict(seed=-1), "--seed"), (dict(top_k=-1), "--top-k"),
                         (dict(strategy="fast-dllm-v2"), "shifted-label models"),
                         (dict(strategy="fast-dllm-v2", shifted_labels=True, sub_block_size=3), "--sub-block-size 3"),
                         (dict(sub_block_size=2), "--sub-block-size applies to --strategy fast-dllm-v2"),
                         (dict(strategy="fast-dllm-v2", shifted_labels=True, block_size=8, sub_block_size=2,
                               steps_per_block=3), "the 4 sub-blocks"),
                         (dict(context_window=BLOCK), "--context-window 4"),
                         (dict(context_window=3 * BLOCK + 1), "--context-window 13"),
                         (dict(stop_sequences=((),)), "--stop")]:
        with pytest.raises(ValueError, match=flag):
            _settings(**fields)
    assert _settings(strategy="fast-dllm-v2", shifted_labels=True, block_size=32).sub_blocks[:2] == [(0, 8), (8, 16)]


@pytest.mark.parametrize("token_causal", [False, True])
def test_sampling_attention_is_the_bdlm_mask_over_position_ordered_rows(token_causal):
    """A query of the last block (the one being decoded) at position p sees the keys of blocks <= p // B; a
    committed row before it the same with block-causal clean rows, the keys <= p with token-causal ones; whether
    its call holds one block (plain attention) or several (the kernels' prefix attention); GQA heads stay grouped
    as Megatron groups them."""
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.core.clean_attention import BLOCK_CAUSAL, TOKEN_CAUSAL
    from megatron_csbp.tools.sampling import SamplingAttention

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0)
    rule = TOKEN_CAUSAL if token_causal else BLOCK_CAUSAL
    attention = SamplingAttention(config, 1, block_size=BLOCK, clean_attention=rule)
    generator = torch.Generator().manual_seed(0)
    for first, keys in [(8, 12), (8, 20), (0, 20), (13, 15)]:
        rows = keys - first
        query = torch.randn(rows, 2, 4, 8, generator=generator, dtype=torch.float64)
        key, value = torch.randn(2, keys, 2, 2, 8, generator=generator, dtype=torch.float64)
        row_positions, key_positions = torch.arange(first, keys)[:, None], torch.arange(keys)[None, :]
        visible = key_positions // BLOCK <= row_positions // BLOCK
        if token_causal:  # committed rows (before the last block) see the keys up to their own position
            committed = row_positions // BLOCK < (keys - 1) // BLOCK
            visible = torch.where(committed, key_positions <= row_positions, visible)
        scores = torch.einsum("sbhd,tbhd->bhst", query, key.repeat_interleave(2, 2)) * 8 ** -0.5
        expected = torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(~visible, float("-inf")).softmax(-1),
                                value.repeat_interleave(2, 2)).reshape(rows, 2, -1)
        got = attention(query, key, value)
        assert ((got - expected).norm() / expected.norm()) < 1e-10, (first, keys)


# ------------------------------------------------------------------- the published rules, restated, on a model
def _tiny_sampler():
    """A random 2-layer sampling model (block BLOCK, vocabulary VOCAB, MASK the last id) on one rank."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.core.device import default_device
    from megatron_csbp.tools.sampling import sampling_model

    mpu.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               normalization="RMSNorm", init_method_std=0.3)
    return sampling_model(config, VOCAB, BLOCK, max_sequence_length=SEQ).to(default_device()).eval()


def _whole_sequence_logits(model, tokens):
    """The model over `tokens` [b, n] as one sequence from position 0, no cache; MASK is never produced."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, None).float()
    logits[..., MASK] = float("-inf")
    return logits


def _published(model, prompts, new_tokens, rule, steps=BLOCK, temperature=0.0, top_p=1.0, top_k=0, threshold=0.5,
               seed=0, shifted=False, sub_block=None, window=None, nucleus=None, llada_confidence=True):
    """The decoders as their authors wrote them, restated in a few loops (none of the sampler's code): the new
    tokens of each prompt. Random draws in the order the sampler documents (tokens, then the rule's uniforms).
    `nucleus` / `llada_confidence` swap a rule's fact (negative controls)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    rows, B = len(prompts), BLOCK
    total = -(-max(len(p) + new_tokens for p in prompts) // B) * B
    x = torch.full((rows, total), MASK, dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        x[r, :len(p)] = torch.tensor(p)
    nucleus = nucleus or ("bd3lm" if rule in BD3LM_RULES else "sdar")

    def draw(logits):
        """tokens, their distribution, and the plain softmax (LLaDA's confidence)."""
        plain = logits.softmax(-1)
        if temperature == 0.0:
            return plain.argmax(-1), plain, plain
        z = logits / temperature
        if top_k:  # SDAR / LLaDA2 top_k_logits: below the k-th largest is -inf
            z = torch.where(z < torch.topk(z, top_k).values[..., -1:], float("-inf"), z)
        p = z.softmax(-1)
        if top_p < 1.0:
            ordered, where = p.sort(-1, descending=True)
            running = ordered.cumsum(-1)
            if nucleus == "bd3lm":  # BD3-LM _nucleus_sample: cumulative <= p, the first always
                keep = running <= top_p
                keep[..., 0] = True
            else:  # SDAR top_p_logits: drop where the cumulative passes p, shifted right one, the first kept
                drop = running > top_p
                drop = torch.cat([torch.zeros_like(drop[..., :1]), drop[..., :-1]], -1)
                keep = ~drop
            p = torch.zeros_like(p).scatter(-1, where, ordered * keep)
            p = p / p.sum(-1, keepdim=True)
        tokens = torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=g).reshape(p.shape[:-1])
        return tokens, p, plain

    def gathered(p, tokens):
        return p.gather(-1, tokens[..., None])[..., 0]

    for k in range(min(len(p) for p in prompts) // B, total // B):
        s, e = k * B, (k + 1) * B
        w = 0 if window is None else max(0, e - window)  # BD3-LM: fwd_idx = arange(max(end - context, 0), end)
        cur = x[:, s:e]  # a view: writing it writes x

        def logits_of_block():
            out = _whole_sequence_logits(model, x[:, w:e])
            rows_used = torch.arange(s - w, e - w) - int(shifted)  # shifted: row p-1 predicts position p
            return out[:, rows_used.clamp(min=0)]

        if rule == "confidence":  # SDAR low_confidence_dynamic / LLaDA2
            schedule = [B // steps + (i < B % steps) for i in range(steps)]
            for i in range(steps):
                masked = cur == MASK
                if not masked.any():
                    break
                tokens, p, _ = draw(logits_of_block())
                conf = torch.where(masked, gathered(p, tokens), float("-inf"))
                for r in range(rows):
                    high = conf[r] > threshold
                    if high.sum() >= schedule[i]:
                        pick = high
                    else:
                        pick = torch.zeros_like(high)
                        pick[torch.topk(conf[r], min(schedule[i], int(masked[r].sum()))).indices] = True
                    cur[r][pick] = tokens[r][pick]
        elif rule == "fast-dllm-v2":  # Fast-dLLM v2 batch_sample
            if (cur[:, 0] == MASK).any():
                first = logits_of_block()[:, 0].argmax(-1)
                cur[:, 0] = torch.where(cur[:, 0] == MASK, first, cur[:, 0])
            size = sub_block or B
            for a in range(0, B, size):
                while (cur[:, a:a + size] == MASK).any():
                    masked = cur[:, a:a + size] == MASK
                    tokens, p, _ = draw(logits_of_block()[:, a:a + size])
                    conf = torch.where(masked, gathered(p, tokens), float("-inf"))
                    pick = conf > threshold
                    pick[torch.arange(rows), conf.argmax(-1)] = True
                    pick &= masked
                    part = cur[:, a:a + size]
                    part[pick] = tokens[pick]
        elif rule == "top-k":  # LLaDA low_confidence: the block's masked count split over the steps
            at_start = (cur == MASK).sum(1).tolist()
            for i in range(steps):
                masked = cur == MASK
                if not masked.any():
                    break
                tokens, p, plain = draw(logits_of_block())
                conf = torch.where(masked, gathered(plain if llada_confidence else p, tokens), float("-inf"))
                for r in range(rows):
                    count = at_start[r] // steps + (i < at_start[r] % steps)
                    chosen = torch.topk(conf[r], count).indices
                    cur[r, chosen] = tokens[r, chosen]
        elif rule == "posterior":  # BD3-LM _semi_ar_sampler + _ddpm_caching_update, log-linear schedule
            times, dt = torch.linspace(1, 0, steps), 1 / steps
            for i in range(steps):
                masked = cur == MASK
                if not masked.any():
                    break
                tokens, _, _ = draw(logits_of_block())
                u = torch.rand(masked.shape, generator=g, device=device)
                t = times[i].item()
                stays_masked = (t - dt) / t if t > 0 else 0.0  # move_chance_s / move_chance_t; t = 0 commits all
                pick = masked & (u < 1 - stays_masked)
                cur[pick] = tokens[pick]
        elif rule == "first-hitting":  # BD3-LM first_hitting: one uniformly chosen masked position per step
            for i in range(steps):
                masked = cur == MASK
                if not masked.any():
                    break
                tokens, _, _ = draw(logits_of_block())
                u = torch.rand(masked.shape, generator=g, device=device)
                for r in range(rows):
                    if masked[r].any():
                        j = int(torch.where(masked[r], u[r], -1.0).argmax())
                        cur[r, j] = tokens[r, j]
    return [x[r, len(p):len(p) + new_tokens].tolist() for r, p in enumerate(prompts)]


# Prompts end at a block's end (the first new block is fresh: Fast-dLLM v2's argmax rule) and inside one.
RESTATED_PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0]]
RESTATED_CASES = [  # (name, strategy, shifted, settings)
    *[(f"{strategy} {label}", strategy, shifted, dict(fields, seed=seed))
      for strategy, shifted in [("confidence", False), ("confidence", True), ("fast-dllm-v2", True),
                                ("top-k", False), ("top-k", True), ("posterior", False), ("first-hitting", False)]
      for label, fields in [("greedy", dict(temperature=0.0)),
                            ("T0.8 top-p0.7", dict(temperature=0.8, top_p=0.7)),
                            ("T1.2 top-k5 top-p0.9", dict(temperature=1.2, top_k=5, top_p=0.9))]
      for seed in (0, 1)],
    ("confidence 3 steps of 4", "confidence", False, dict(steps_per_block=3, temperature=0.7, seed=2)),
    ("top-k 3 steps of 4", "top-k", False, dict(steps_per_block=3, temperature=0.7, seed=2)),
    ("top-k T3 2 steps", "top-k", False, dict(steps_per_block=2, temperature=3.0, seed=6)),
    ("top-k T0.3 2 steps", "top-k", True, dict(steps_per_block=2, temperature=0.3, seed=7)),
    ("posterior 6 steps", "posterior", False, dict(steps_per_block=6, temperature=1.0, seed=3)),
    ("fast-dllm-v2 sub-blocks of 2", "fast-dllm-v2", True, dict(sub_block_size=2, temperature=0.9, seed=4)),
    ("posterior window 8", "posterior", False, dict(context_window=8, temperature=1.0, seed=5)),
    ("confidence window 8", "confidence", False, dict(context_window=8, seed=5)),
    ("fast-dllm-v2 window 12", "fast-dllm-v2", True, dict(context_window=12, seed=5)),
]
NEW_RESTATED = 12


def _restated_checks(rank, world_size):
    from megatron_csbp.mcore import cpu_backend
    from megatron_csbp.tools.sampling import generate

    with cpu_backend.active():
        model = _tiny_sampler()
        results = {}
        for name, strategy, shifted, fields in RESTATED_CASES:
            settings = _settings(strategy=strategy, shifted_labels=shifted, threshold=0.5, **fields)
            seen = []
            ours = generate(model, RESTATED_PROMPTS, NEW_RESTATED, settings,
                            on_step=lambda index, committed, *rest: seen.append(committed.shape[1])).tokens
            restated = dict(steps=settings.steps_per_block, temperature=settings.temperature, top_p=settings.top_p,
                            top_k=settings.top_k, threshold=0.5, seed=settings.seed, shifted=shifted,
                            sub_block=fields.get("sub_block_size"), window=settings.context_window)
            published = _published(model, RESTATED_PROMPTS, NEW_RESTATED, strategy, **restated)
            controls = {}
            if settings.top_p < 1.0 and strategy in ("confidence", "posterior"):  # the other nucleus rule
                other = "sdar" if strategy in BD3LM_RULES else "bd3lm"
                controls["other nucleus"] = _published(model, RESTATED_PROMPTS, NEW_RESTATED, strategy,
                                                       nucleus=other, **restated)
            if strategy == "top-k" and settings.temperature > 0:  # LLaDA's confidence after temperature instead
                controls["confidence after temperature"] = _published(
                    model, RESTATED_PROMPTS, NEW_RESTATED, strategy, llada_confidence=False, **restated)
            if settings.context_window:
                controls["no window"] = _published(model, RESTATED_PROMPTS, NEW_RESTATED, strategy,
                                                   **dict(restated, window=None))
            results[name] = ours, published, controls, max(seen)
        return results, _ending_checks(model)


def _ending_checks(model):
    """EOS, a stop sequence, a suppressed token and an empty prompt against a plain run of the same seed."""
    from megatron_csbp.tools.sampling import first_stop, generate

    sampled = dict(threshold=0.5, temperature=1.0, seed=3)
    plain = generate(model, RESTATED_PROMPTS, NEW_RESTATED, _settings(**sampled))
    eos, stop = plain.tokens[0][5], tuple(plain.tokens[1][5:7])  # positions 19, 20: across a block boundary
    frequent = max(range(VOCAB), key=lambda t: sum(s.count(t) for s in plain.tokens))
    runs = {
        "eos": generate(model, RESTATED_PROMPTS, NEW_RESTATED, _settings(eos_token_id=eos, **sampled)),
        "stop": generate(model, RESTATED_PROMPTS, NEW_RESTATED, _settings(stop_sequences=(stop,), **sampled)),
        "suppressed": generate(model, RESTATED_PROMPTS, NEW_RESTATED,
                               _settings(suppressed_token_ids=(frequent,), **sampled)),
        "unconditional": generate(model, [[], []], NEW_RESTATED, _settings(start_token_id=5, **sampled)),
        "from the start token": generate(model, [[5], [5]], NEW_RESTATED, _settings(**sampled)),
    }
    try:
        generate(model, [[]], 4, _settings())
        refusal = None
    except ValueError as error:
        refusal = str(error)
    assert first_stop([1, 2, 3, 2, 3], [(2, 3), (3,)]) == 1 and first_stop([1, 2], [(2, 3)]) is None
    return dict(plain=plain, eos_id=eos, stop_ids=stop, frequent=frequent, refusal=refusal, **runs)


@pytest.fixture(scope="module")
def restated_and_endings():
    return run_ranks(_restated_checks, 1, timeout=600)[0]


@pytest.fixture(scope="module")
def restated(restated_and_endings):
    return restated_and_endings[0]


def test_eos_stop_sequences_suppression_and_unconditional_prompts(restated_and_endings):
    runs = restated_and_endings[1]
    plain = runs["plain"].tokens

    def cut(tokens, stop):
        starts = [i for i in range(len(tokens) - len(stop) + 1) if tuple(tokens[i:i + len(stop)]) == stop]
        return tokens[:starts[0]] if starts else tokens

    assert runs["eos"].tokens == [cut(t, (runs["eos_id"],)) for t in plain]
    assert len(runs["eos"].tokens[0]) <= 5
    assert runs["stop"].tokens == [cut(t, runs["stop_ids"]) for t in plain]
    assert len(runs["stop"].tokens[1]) <= 5
    assert runs["stop"].model_calls < runs["plain"].model_calls  # every sample stopped: decoding ended early
    assert all(runs["frequent"] not in t and len(t) == NEW_RESTATED for t in runs["suppressed"].tokens)
    assert runs["suppressed"].tokens != plain
    assert runs["unconditional"].tokens == runs["from the start token"].tokens
    assert "needs a start token" in runs["refusal"]


def test_every_strategy_decodes_token_by_token_as_its_authors_code(restated):
    """SDAR/LLaDA2 confidence, Fast-dLLM v2 (argmax first token, sub-blocks), LLaDA top-k (confidence before
    temperature), BD3-LM posterior (1/(T t_i), t = 0 commits the rest) and first-hitting, each greedy and
    sampled (temperature, top-k, the strategy's nucleus), with fixed seeds: our tokens are the restatement's."""
    differing_controls = []
    for name, (ours, published, controls, _) in restated.items():
        matching = sum(a == b for o, p in zip(ours, published) for a, b in zip(o, p))
        print(f"{name}: {matching}/{sum(map(len, ours))} tokens equal the published rule's"
              + "".join(f"; control '{c}': {sum(a == b for o, p in zip(ours, t) for a, b in zip(o, p))} equal"
                        for c, t in controls.items()))
        assert ours == published, name
        differing_controls += [(name, control) for control, tokens in controls.items() if tokens != ours]
    # Negative controls: a swapped fact (the other nucleus, LLaDA's confidence after temperature, no window)
    # changes the tokens, so the comparison can fail.
    kinds = {control for _, control in differing_controls}
    assert kinds == {"other nucleus", "confidence after temperature", "no window"}, differing_controls


def test_the_context_window_keeps_the_model_within_it(restated):
    for name, (_, _, _, most_committed) in restated.items():
        window = next(fields.get("context_window") for n, _, _, fields in RESTATED_CASES if n == name)
        if window:
            assert most_committed == window - BLOCK, name  # committed rows the model saw, at most
        else:
            assert most_committed > 12, name


# --------------------------------------------------------------------------------- against the training forward
def _training_logits(model, layout, committed, block, shifted, generator):
    """The training forward's logits for the active block's positions on `[x_t ; x_0]` rows that hold the
    committed prefix as `x0` and the block as `x_t` (everything else random: it must not matter)."""
    batch, start = committed.shape
    x0 = torch.randint(0, MASK, (batch, SEQ), generator=generator)
    xt = torch.randint(0, MASK + 1, (batch, SEQ), generator=generator)
    x0[:, :start] = committed.cpu()
    xt[:, start:start + BLOCK] = block.cpu()
    if shifted and start:  # the row before the block: the previous block, fully unmasked
        xt[:, start - BLOCK:start] = committed[:, start - BLOCK:].cpu()
    rows = torch.cat([xt[:, layout.noisy_positions], x0[:, layout.clean_positions]], dim=1)
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(rows.to(device), layout.row_positions.expand(batch, -1).to(device)).cpu()
    by_position = torch.empty_like(logits)
    by_position[:, layout.noisy_positions] = logits
    return by_position[:, torch.arange(start, start + BLOCK) - int(shifted)]


def _relative_error(got, expected):
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(got)), "different entries are -inf (MASK logit)"
    return ((got - expected)[finite].abs().max() / expected[finite].abs().max()).item()


def _model_checks(rank, world_size, moe=False, positions=None, strategies=None):
    from megatron_csbp.mcore import cpu_backend

    with cpu_backend.active():
        return _checks_on_one_rank(moe, positions, strategies)


# A mixture of experts: megatron-core's MoE layers (4 experts, top-2, a shared expert) in the second layer.
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=16,
           moe_layer_freq=[0, 1], moe_token_dispatcher_type="alltoall", add_bias_linear=False)


def _checks_on_one_rank(moe=False, positions=None, strategies=None):
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.core.device import default_device
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.mcore.model import model_provider
    from megatron_csbp.tools.sampling import STRATEGY, generate, sampling_model

    mpu.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               use_cpu_initialization=True, calculate_per_token_loss=True, hidden_dropout=0.0,
                               attention_dropout=0.0, normalization="RMSNorm", init_method_std=0.3,
                               **(MOE if moe else {}))
    layout = CSBPLayout(SEQ, BLOCK, 1, 1)  # dual-end order: noisy rows are not in position order
    trained = model_provider(config=config, layout=layout, vocab_size=VOCAB, mask_token_id=MASK, positions=positions)
    sampler = sampling_model(config, VOCAB, BLOCK, max_sequence_length=SEQ, positions=positions)
    sampler.load_state_dict(trained.state_dict(), strict=True)
    trained, sampler = trained.to(default_device()).eval(), sampler.to(default_device())
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0]]  # two blocks of prefill
    generator = torch.Generator().manual_seed(1)
    errors, control, results = {}, [], {}
    for shifted in (False, True):
        for strategy in [name for name, rule in STRATEGY.items() if (shifted or not rule.needs_shifted_labels)
                         and (strategies is None or name in strategies) and rule.corruption == "mask"]:
            # (diffusion-gemma decodes uniform-state models: tests/test_sampling_diffusion_gemma.py)
            sampled = {"temperature": 1.0, "seed": 5} if strategy in BD3LM_RULES else {}
            runs = {}
            for kv_cache in (True, False):
                steps = []
                settings = _settings(strategy=strategy, shifted_labels=shifted, kv_cache=kv_cache, threshold=0.5,
                                     **sampled)
                generation = generate(sampler, prompts, 12, settings,
                                      on_step=lambda *step: steps.append([t.to("cpu", copy=True) for t in step[1:]] + [step[0]]))
                runs[kv_cache] = generation, steps
            (cached, cached_steps), (uncached, uncached_steps) = runs[True], runs[False]
            name = f"{'fast-dllm-v2' if shifted else 'bd3lm'} {strategy}"
            assert cached.tokens == uncached.tokens, name
            assert len(cached_steps) == len(uncached_steps) and cached.model_calls <= uncached.model_calls + 1, name  # + the prefill
            assert cached.model_rows < uncached.model_rows / 2, name
            cache_error = max(_relative_error(a[2], b[2]) for a, b in zip(cached_steps, uncached_steps))
            full = [prompt + tokens for prompt, tokens in zip(prompts, cached.tokens)]
            assert all(len(tokens) == 12 and MASK not in tokens for tokens in cached.tokens), name
            consistency = 0.0
            previous = None
            for committed, block, logits, index in cached_steps:
                start = index * BLOCK
                for row, sequence in enumerate(full):  # committed and prompt tokens never change
                    assert committed[row, :len(sequence)].tolist() == sequence[:start], name
                    inside = block[row, :max(0, len(sequence) - start)]  # positions past its end are dropped
                    kept = inside != MASK
                    assert inside[kept].tolist() == [sequence[start + i] for i in range(len(inside)) if kept[i]], name
                if previous is not None and previous[0] == index:
                    assert torch.equal(block[previous[1] != MASK], previous[1][previous[1] != MASK]), name
                previous = (index, block)
                expected = _training_logits(trained, layout, committed, block, shifted, generator)
                skip = int(shifted and start == 0)  # position 0 has no predicting row (it is a prompt token)
                consistency = max(consistency, _relative_error(logits[:, skip:], expected[:, skip:]))
                if not shifted and not control:  # negative control: the neighbouring rows' logits differ
                    wrong = _training_logits(trained, layout, committed, block, True, generator)
                    control.append(_relative_error(logits[:, 1:], wrong[:, 1:]))
            blocks = {step[3] for step in cached_steps}
            assert all(sum(step[3] == b for step in cached_steps) <= BLOCK for b in blocks), name
            errors[name] = (consistency, cache_error, cached.model_calls, cached.model_rows, uncached.model_rows)
            results[name] = cached.tokens
    mpu.destroy_model_parallel()
    return errors, control


def test_sampler_logits_equal_the_training_forward_and_the_cache_changes_nothing():
    errors, control = run_ranks(_model_checks, 1, timeout=300)[0]
    for name, (consistency, cache_error, calls, cached_rows, uncached_rows) in errors.items():
        print(f"{name}: sampler vs training forward {consistency:.2e}, cached vs uncached {cache_error:.2e}, "
              f"{calls} model calls, rows run {cached_rows} (cache) / {uncached_rows} (no cache)")
        assert consistency <= TOLERANCE, (name, consistency)
        assert cache_error <= TOLERANCE, (name, cache_error)
    print(f"negative control (neighbouring rows' logits): {control[0]:.2e}")
    assert control[0] > 1e-2


def _yarn_positions(beta=0.5):
    from megatron_csbp.core.positions import QueryScaling, RotaryPositions, YaRN

    yarn = YaRN(4.0, 8, beta_fast=8.0, mscale_all_dim=0.0)  # the original context, 8, is a quarter of SEQ
    return RotaryPositions(yarn, None if beta is None else QueryScaling(beta, 8))


def _query_scaling_control(rank, world_size):
    """The sampler's logits over one sequence with and without the query scaling (the same weights)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.mcore import cpu_backend
    from megatron_csbp.tools.sampling import sampling_model

    with cpu_backend.active():
        mpu.initialize_model_parallel()
        logits = []
        for positions in (_yarn_positions(), _yarn_positions(None)):
            model_parallel_cuda_manual_seed(0)
            config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                       use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                                       normalization="RMSNorm", init_method_std=0.3)
            torch.manual_seed(0)
            model = sampling_model(config, VOCAB, BLOCK, max_sequence_length=SEQ, positions=positions).eval()
            tokens = torch.arange(SEQ)[None] % MASK
            with torch.no_grad():
                logits.append(model(tokens, torch.arange(SEQ)[None], None))
        mpu.destroy_model_parallel()
    return logits


def test_sampler_with_yarn_rope_and_the_query_scaling_equals_the_training_forward():
    """YaRN and Llama 4's query scaling (original context 8 of the 32 positions): the sampler's logits, cached or
    not, are the training forward's at every step (its RoPE positions: the row index of what it sees, as the
    training rows'). Negative control: without the query scaling the sampler's logits move (max relative
    difference above 1e-2) where the training forward's stay."""
    errors, control = run_ranks(_model_checks, 1, False, _yarn_positions(), ("confidence", "fast-dllm-v2"),
                                timeout=300)[0]
    for name, (consistency, cache_error, *_) in errors.items():
        print(f"yarn + query scaling {name}: sampler vs training forward {consistency:.2e}, cache {cache_error:.2e}")
        assert consistency <= TOLERANCE and cache_error <= TOLERANCE, (name, consistency, cache_error)
    assert len(errors) == 3 and control[0] > 1e-2
    scaled, unscaled = run_ranks(_query_scaling_control, 1, timeout=300)[0]
    moved = _relative_error(unscaled, scaled)
    print(f"without the query scaling: {moved:.2e}")
    assert moved > 1e-2


def test_a_mixture_of_experts_samples_as_it_trains():
    """The sampler builds a mixture-of-experts checkpoint's MoE layers as training does (its state dict loads
    strictly), and its logits, cached or not, are the training forward's at every step of every strategy."""
    errors, control = run_ranks(_model_checks, 1, True, timeout=300)[0]
    for name, (consistency, cache_error, *_) in errors.items():
        assert consistency <= TOLERANCE and cache_error <= TOLERANCE, (name, consistency, cache_error)
    print(f"MoE: worst sampler vs training forward {max(e[0] for e in errors.values()):.2e}")
    assert control[0] > 1e-2


# ------------------------------------------------------------------------------ a trained model, from checkpoints
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, group_query_attention="true",
            num_query_groups=2, normalization="RMSNorm", swiglu="true", disable_bias_linear="true",
            untie_embeddings_and_output_weights="true", attention_dropout=0, hidden_dropout=0, seq_length=64,
            bdlm_block_size=8, split="90,10,0", micro_batch_size=4, global_batch_size=8, lr=3e-3, min_lr=3e-4,
            lr_decay_style="cosine", use_cpu_initialization="true", log_interval=20, eval_iters=0, seed=1234)
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def _environment():
    env = {key: value for key, value in os.environ.items() if not key.startswith("MEGATRON_CSBP_TEST")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
    return env


def _run(command, expect=0):
    done = subprocess.run(command, cwd=REPO, env=_environment(), timeout=600, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert done.returncode == expect, f"exit status {done.returncode}, expected {expect}:\n{done.stdout[-4000:]}"
    return done.stdout


def trained_on_the_alphabet(root, model):
    """`model` (pretrain flags) trained 120 iterations on the repeated alphabet by scripts/pretrain_bdlm.py; its
    checkpoint is `root / "trained"`."""
    from megatron_csbp.data.datasets import write_indexed_dataset

    documents = [list((ALPHABET * 20)[i:i + 400].encode()) for i in range(26) for _ in range(3)]
    write_indexed_dataset(documents, str(root / "alphabet"), 257)
    overrides = [f"{key.replace('_', '-')}={value}" for key, value in {**model, "data_path": root / "alphabet"}.items()]
    _run([sys.executable, os.path.join(REPO, "scripts", "pretrain_bdlm.py"), *overrides, "train-iters=120",
          "lr-warmup-iters=5", f"save={root / 'trained'}"])
    return root / "trained"


@pytest.fixture(scope="module")
def alphabet_checkpoints(tmp_path_factory):
    """A tiny BDLM trained 120 iterations on the repeated alphabet."""
    root = tmp_path_factory.mktemp("alphabet")
    trained_on_the_alphabet(root, TINY)
    return root


PROMPTS = ["abcdefghij", "pqrs"]  # into the second block, and shorter than one block
NEW_TOKENS = 20


def _prompt_flags():
    return [flag for prompt in PROMPTS for flag in ("--prompt", prompt)] + ["--max-new-tokens", str(NEW_TOKENS)]


def _expected():
    return [(ALPHABET * 3)[ALPHABET.index(p[-1]) + 1:][:NEW_TOKENS] for p in PROMPTS]


def _complete(rank, world_size, load):
    """The script's own steps (arguments, model, generation) with the checkpoint's weights, then without
    them (the untrained model, freshly initialised)."""
    from megatron_csbp.mcore import cpu_backend, parallel_state
    from megatron_csbp.tools import generate, sampling

    completions = []
    options, args, directory, settings, prompts, encoded = generate.prepare(["--load", load, *_prompt_flags()])
    with cpu_backend.active():
        for weights in (directory, None):
            model = generate.build_model(args, weights)
            generation = sampling.generate(model, encoded, options.max_new_tokens, settings)
            parallel_state.destroy_model_parallel()
            completions.append([args.tokenizer.detokenize(tokens) for tokens in generation.tokens])
    return completions


def test_a_briefly_trained_model_completes_its_corpus_and_an_untrained_one_does_not(alphabet_checkpoints):
    trained, untrained = run_ranks(_complete, 1, str(alphabet_checkpoints / "trained"), timeout=300)[0]
    print(f"trained: {trained}, untrained: {untrained}")
    assert trained == _expected()
    right = sum(a == b for sample, want in zip(untrained, _expected()) for a, b in zip(sample, want))
    assert right < NEW_TOKENS // 2, untrained  # negative control


def test_generate_script_under_tp2_gives_the_one_rank_tokens(alphabet_checkpoints):
    output = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2",
                   os.path.join(REPO, "scripts", "generate_bdlm.py"), "--load", str(alphabet_checkpoints / "trained"),
                   "--tensor-model-parallel-size", "2", *_prompt_flags()])
    print(output.splitlines()[-1])
    samples = [ast.literal_eval(line.split(": ", 1)[1]) for line in output.splitlines() if line.startswith("sample ")]
    assert samples == _expected(), output
    assert [ast.literal_eval(line.split(": ", 1)[1]) for line in output.splitlines()
            if line.startswith("prompt ")] == PROMPTS
    assert re.search(r"generated 40 tokens in [\d.]+ s \([\d.]+ tokens/s\) \| \d+ model calls", output), output
    settings = next(line for line in output.splitlines() if line.startswith("checkpoint "))
    assert "tp 2" in settings and "strategy confidence" in settings, output


def test_bad_flags_are_one_line_refusals_with_exit_2(alphabet_checkpoints, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    load = str(alphabet_checkpoints / "trained")
    base = ["--load", load, "--max-new-tokens", "8"]
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("abc\ncaf\u00e9\n".encode("latin-1"))  # byte 7 is 0xe9, not UTF-8
    cases = [
        (["--load", load, "--max-new-tokens", "8"], "--prompt TEXT"),
        ([*base, "--prompt", "a", "--prompt-file", "x.txt"], "one of the two"),
        ([*base, "--prompt-file", str(tmp_path / "none.txt")], "--prompt-file"),
        (["--load", load, "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens 0"),
        (["--load", load, "--prompt", "a", "--max-new-tokens", str(10 ** 13)], "--max-new-tokens 10000000000000"),
        (["--load", load, "--prompt", "a", "--max-new-tokens", str(10 ** 13), "--context-window", "16"],
         "GiB (sequence and K/V cache)"),
        ([*base, "--prompt", "a", "--steps-per-block", "0"], "--steps-per-block 0 must be >= 1"),
        ([*base, "--prompt-file", str(latin1)], f"--prompt-file {latin1} is not UTF-8: byte offset 7"),
        ([*base, "--prompt", "a", "--strategy", "fast-dllm-v2"], "--bdlm-objective bd3lm"),
        ([*base, "--prompt", "a", "--sub-block-size", "4"], "--sub-block-size applies to"),
        ([*base, "--prompt", "a", "--context-window", "12"], "--context-window 12"),
        ([*base, "--prompt", "a", "--top-k", "-1"], "--top-k -1"),
        ([*base, "--prompt", "a", "--stop", ""], "--stop: a stop sequence is empty"),
        ([*base, "--prompt", "a", "--stop-id", "999"], "--stop-id 999"),
        ([*base, "--prompt", "a", "--strategy", "best"], "--strategy"),
        ([*base, "--prompt", "a", "--strategy", "first-hitting", "--steps-per-block", "4"], "--steps-per-block 4"),
        ([*base, "--prompt", "a", "--top-p", "0"], "--top-p"),
        ([*base, "--prompt", "a", "--tensor-model-parallel-size", "2"], "launch exactly"),
        (["--load", str(tmp_path / "nothing"), "--prompt", "a", "--max-new-tokens", "8"], "--load"),
        ([*base, "--prompt", "a", "--config", str(tmp_path / "none.yaml")], "--config"),
    ]
    from megatron_csbp.tools import generate

    for argv, message in cases:
        assert generate.main(argv) == 2, argv
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and message in error and error.startswith("generate_bdlm.py: error:"), \
            (argv, error)


def test_config_sets_every_key_it_names_even_a_default(alphabet_checkpoints, tmp_path):
    """A YAML value equal to the parser's default still overrides the checkpoint (so `bdlm-objective: bd3lm`
    decodes a fast-dllm-v2 checkpoint as bd3lm): the checkpoint's block size is 8, the parser's default 16."""
    from megatron_csbp.tools import inference
    from megatron_csbp.training.flags import build_parser

    assert build_parser().parse_args([]).bdlm_block_size == 16
    checkpoint = inference.read_checkpoint(str(alphabet_checkpoints / "trained"))
    assert inference.model_args(checkpoint, None, 1).bdlm_block_size == 8
    for block in (16, 4):  # the default, and a control that is not
        config = tmp_path / f"block{block}.yaml"
        config.write_text(f"bdlm:\n  block-size: {block}\nbdlm-objective: bd3lm\n")
        args = inference.model_args(checkpoint, str(config), 1)
        assert args.bdlm_block_size == block and args.bdlm_objective == "bd3lm"


def test_an_empty_prompt_samples_unconditionally_from_the_end_of_document_token(alphabet_checkpoints, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from megatron_csbp.tools import generate

    options, args, _, settings, prompts, encoded = generate.prepare(
        ["--load", str(alphabet_checkpoints / "trained"), "--prompt", "", "--prompt", "ab", "--max-new-tokens", "8"])
    assert prompts == ["", "ab"] and encoded == [[], [97, 98]]
    assert settings.start_token_id == args.tokenizer.eod == 256


def _generate_command(alphabet_checkpoints, *flags):
    return [sys.executable, os.path.join(REPO, "scripts", "generate_bdlm.py"), "--load",
            str(alphabet_checkpoints / "trained"), *flags]


def test_past_the_trained_length_warns_and_the_context_window_keeps_the_sample_right(alphabet_checkpoints):
    """seq-length 64: a prompt that reaches past it with the new tokens, or is longer itself, warns in one line;
    with --context-window 64 the model sees only the last 64 positions (numbered from 0), no warning, and the
    78-character prompt's continuation is the alphabet's."""
    new = 24
    cases = [(ALPHABET * 2, [], "the longest prompt (52 tokens) plus --max-new-tokens 24 reaches position 80, "
                                "past the trained length 64"),
             (ALPHABET * 3, [], "the longest prompt (78 tokens) is longer than the trained length 64"),
             (ALPHABET * 3, ["--context-window", "64"], None)]
    for prompt, flags, warning in cases:
        done = subprocess.run(_generate_command(alphabet_checkpoints, "--prompt", prompt, "--max-new-tokens",
                                                str(new), *flags),
                              cwd=REPO, env=_environment(), timeout=300, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        warnings = [line for line in done.stderr.splitlines() if line.startswith("generate_bdlm.py: warning:")]
        sample = next(ast.literal_eval(line.split(": ", 1)[1]) for line in done.stdout.splitlines()
                      if line.startswith("sample 0"))
        print(len(prompt), flags, warnings, repr(sample))
        if warning is None:
            assert warnings == [] and "context window 64" in done.stdout
            assert sample == (ALPHABET * 2)[:new]
        else:
            assert len(warnings) == 1 and warning in warnings[0] and "--context-window 64" in warnings[0]


def test_ctrl_c_during_generation_exits_130_without_a_traceback(alphabet_checkpoints):
    command = _generate_command(alphabet_checkpoints, "--prompt", "abc", "--max-new-tokens", "100000",
                                "--context-window", "16", "--suppress-eos", "--no-kv-cache")
    process = subprocess.Popen(command, cwd=REPO, env=_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or not lines[-1].startswith("checkpoint "):  # the settings line: generation follows
            lines.append(process.stdout.readline())
            assert lines[-1], f"no settings line: {lines}"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    print(repr(stderr[-500:]))
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "generate_bdlm.py: interrupted" in stderr


def test_fast_dllm_v2_stops_at_the_chat_end_token_when_the_tokenizer_has_one():
    """Fast-dLLM v2 stops at <|im_end|>: a tokenizer holding it as one special id adds that stop; a byte
    tokenizer (ten ids for the text) does not; other strategies only stop where asked."""
    from types import SimpleNamespace

    from megatron_csbp.tools.generate import stop_sequences
    from megatron_csbp.tools.sampling import STRATEGY


    class Chat:
        vocab_size = 100

        def tokenize(self, text):
            return [99] if text == "<|im_end|>" else [ord(c) % 90 for c in text]

    class Bytes(Chat):
        def tokenize(self, text):
            return list(text.encode())[:1] * len(text)

    options = SimpleNamespace(stop=["ab"], stop_id=[5])
    assert stop_sequences(options, Chat(), STRATEGY["fast-dllm-v2"]) == ((97 % 90, 98 % 90), (5,), (99,))
    assert stop_sequences(options, Chat(), STRATEGY["confidence"]) == ((97 % 90, 98 % 90), (5,))
    assert stop_sequences(options, Bytes(), STRATEGY["fast-dllm-v2"]) == ((97, 97), (5,))
