"""The sampler with sliding-window layers: its attention is the windowed BDLM mask over position-ordered rows
(against a dense fp64 restatement of docs/algorithm.md §3's table), its logits at every denoising step are the
training forward's under the training mask (windows smaller than a block, equal to it and spanning several blocks;
a pattern with global layers; block- and token-causal clean rows), a sliding layer's K/V cache holds at most the
window and the block while the tokens equal recomputation's; a window off by one misses, a cache asked for a
position it dropped refuses, a right window is refused in one line, and scripts/generate_bdlm.py decodes a trained
sliding-window checkpoint, cached or not."""

import pytest
import torch

from spawn import run_ranks
from test_sampling import BLOCK, MASK, SEQ, VOCAB, _relative_error, _settings, _training_logits

TOLERANCE = 1e-5
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0]]  # the second: a prefill
NEW_TOKENS = 12  # blocks up to position 28: past every window below
SEEN = -(-(max(map(len, PROMPTS)) + NEW_TOKENS) // BLOCK) * BLOCK  # the positions the sampler sees
# (name, window_size, window_attn_skip_freq, clean attention, sampled fields)
CASES = [
    ("window 2 < block, every layer", (2, 0), None, "block-causal", {}),
    ("window 4 = block, layer 3 global", (4, 0), 3, "block-causal", {}),
    ("window 9 spans blocks, [1,0,1]", (9, 0), [1, 0, 1], "block-causal", dict(strategy="posterior", temperature=1.0,
                                                                                 seed=5)),
    ("window 2 token-causal", (2, 0), None, "token-causal", {}),
    ("window 6 token-causal, layer 3 global", (6, 0), 3, "token-causal", dict(strategy="top-k", temperature=0.7,
                                                                             seed=3)),
    ("no window, token-causal", None, None, "token-causal", {}),  # a long prompt's rows run as clean rows
]


def _dense_reference(query, key, value, first, key_start, rule, left, prompt=False):
    """docs/algorithm.md §3 restated per (row, key) in fp64: rows `first..` are noisy in the last block (unless
    `prompt`), clean before it; keys from `key_start`."""
    rows, keys = query.shape[0], key.shape[0]
    end = key_start + keys
    p = torch.arange(first, end)[:, None]
    k = torch.arange(key_start, end)[None, :]
    block_start = p // BLOCK * BLOCK
    noisy = (p >= (end - 1) // BLOCK * BLOCK) & (not prompt)
    token_causal = rule == "token-causal"
    visible_noisy = (k < block_start + BLOCK) & (k >= block_start - left)
    if token_causal:
        visible_clean = (k <= p) & (k >= p - left)
    else:
        visible_clean = (k < block_start + BLOCK) & (k >= block_start - left)
    visible = torch.where(noisy, visible_noisy, visible_clean)
    groups = query.shape[2] // key.shape[2]
    scores = torch.einsum("sbhd,tbhd->bhst", query, key.repeat_interleave(groups, 2)) * query.shape[-1] ** -0.5
    return torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(~visible, float("-inf")).softmax(-1),
                        value.repeat_interleave(groups, 2)).reshape(rows, query.shape[1], -1)


@pytest.mark.parametrize("rule", ["block-causal", "token-causal"])
def test_sampling_attention_is_the_windowed_mask_over_position_ordered_rows(rule):
    """Every call shape the sampler makes (a denoising step, a commit, a prompt alone, a whole sequence), with the
    keys from 0 or from a trimmed cache's first position, in windows 0, 2, 4 and 9 of a block of 4: the dense
    restatement to 1e-10. Negative control: the restatement with the window one position longer differs."""
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.core.clean_attention import CLEAN_ATTENTIONS
    from megatron_csbp.tools.sampling import SamplingAttention

    generator = torch.Generator().manual_seed(0)
    missed = []
    for left in (0, 2, 4, 9):
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                   attention_dropout=0.0, window_size=(left, 0))
        attention = SamplingAttention(config, 1, block_size=BLOCK, clean_attention=CLEAN_ATTENTIONS(rule))
        assert attention.window.left == left
        for first, end, key_start, prompt in [(8, 12, 0, False), (8, 12, max(0, 8 - left), False),
                                              (8, 20, 0, False), (4, 20, max(0, 4 - left), False),
                                              (0, 20, 0, False), (0, 16, 0, True), (8, 16, 0, True)]:
            rows, keys = end - first, end - key_start
            query = torch.randn(rows, 2, 4, 8, generator=generator, dtype=torch.float64)
            key, value = torch.randn(2, keys, 2, 2, 8, generator=generator, dtype=torch.float64)
            attention.key_start, attention.prompt = key_start, prompt
            got = attention(query, key, value)
            expected = _dense_reference(query, key, value, first, key_start, rule, left, prompt)
            assert ((got - expected).norm() / expected.norm()) < 1e-10, (left, first, end, key_start, prompt)
            wider = _dense_reference(query, key, value, first, key_start, rule, left + 1, prompt)
            missed.append(((got - wider).norm() / wider.norm()).item())
    assert max(missed) > 1e-2


def _build(window_size, skip_freq, rule, shifted=False):
    """A 3-layer training model and a sampler with its weights, under the window pattern and clean rule."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.core.clean_attention import CLEAN_ATTENTIONS
    from megatron_csbp.core.device import default_device
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.mcore.model import model_provider
    from megatron_csbp.tools.sampling import sampling_model

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)

    def config(window):
        return TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                 use_cpu_initialization=True, calculate_per_token_loss=True, hidden_dropout=0.0,
                                 attention_dropout=0.0, normalization="RMSNorm", init_method_std=0.3,
                                 window_size=window, window_attn_skip_freq=skip_freq)

    layout = CSBPLayout(SEQ, BLOCK, 1, 1, clean_attention=CLEAN_ATTENTIONS(rule))
    trained = model_provider(config=config(window_size), layout=layout, vocab_size=VOCAB, mask_token_id=MASK)
    samplers = []
    for window in (window_size, window_size and (window_size[0] + 1, 0)):  # the second: a window off by one
        if window is None and samplers:
            samplers.append(None)
            continue
        sampler = sampling_model(config(window), VOCAB, BLOCK, clean_attention=CLEAN_ATTENTIONS(rule),
                                 max_sequence_length=SEQ)
        sampler.load_state_dict(trained.state_dict(), strict=True)
        samplers.append(sampler.to(default_device()))
    return trained.to(default_device()).eval(), samplers, layout


def _watch_caches(model, held):
    """Records after every call the rows each layer's cache holds: `held[layer] = [(first position, rows), ...]`
    (a sliding layer's `_WindowCache`, a global layer's megatron-core buffers from position 0)."""
    from megatron_csbp.tools.sampling import SamplingSelfAttention, _WindowCache

    def hook(module, args, kwargs, output):
        entry = kwargs["inference_context"].key_value_memory_dict[module.layer_number]
        trimmed = isinstance(entry, _WindowCache)
        assert trimmed == module.core_attention.window.sliding
        assert entry[1].shape[0] == entry[2 if trimmed else 0].shape[0]  # K and V alike
        held.setdefault(module.layer_number, []).append((entry.first, entry.key.shape[0]) if trimmed
                                                        else (0, entry[0].shape[0]))
    return [module.register_forward_hook(hook, with_kwargs=True) for module in model.modules()
            if isinstance(module, SamplingSelfAttention)]


def _case_checks(name, window_size, skip_freq, rule, fields):
    from megatron_csbp.mcore.spec import layer_window
    from megatron_csbp.tools.sampling import generate

    trained, (sampler, off_by_one), layout = _build(window_size, skip_freq, rule)
    windows = [layer.self_attention.core_attention.window for layer in sampler.decoder.layers]
    assert windows == [layer_window(trained.config, n) for n in (1, 2, 3)], name
    generator = torch.Generator().manual_seed(1)
    runs = {}
    for kv_cache in (True, False):
        steps, held = [], {}
        hooks = _watch_caches(sampler, held)
        settings = _settings(kv_cache=kv_cache, threshold=0.5, **fields)
        generation = generate(sampler, PROMPTS, NEW_TOKENS, settings, on_step=lambda *step: steps.append(
            [t.to("cpu", copy=True) for t in step[1:]] + [step[0]]))
        for hook in hooks:
            hook.remove()
        runs[kv_cache] = generation, steps, held
    (cached, cached_steps, held), (recomputed, recomputed_steps, _) = runs[True], runs[False]
    consistency = 0.0
    for committed, block, logits, index in cached_steps:
        expected = _training_logits(trained, layout, committed, block, False, generator)
        consistency = max(consistency, _relative_error(logits, expected))
    cache_error = max(_relative_error(a[2], b[2]) for a, b in zip(cached_steps, recomputed_steps))
    sizes = {}
    for layer, window in enumerate(windows, start=1):
        rows = max(count for _, count in held[layer])
        sizes[layer] = (str(window), rows, max(first for first, _ in held[layer]))
        if window.sliding:
            assert rows <= window.left + BLOCK, (name, layer, rows)
            assert sizes[layer][2] > 0, (name, layer)  # the cache did drop positions
        else:
            assert rows == SEEN, (name, layer, rows)  # megatron-core's static cache: every position
    wrong = 0.0
    for committed, block, *_ in cached_steps if off_by_one is not None else ():
        with torch.no_grad():
            sequence = torch.cat([committed, block], dim=1)
            positions = torch.arange(sequence.shape[1])[None].expand_as(sequence)
            right = sampler(sequence, positions, None)[:, -BLOCK:]
            off = off_by_one(sequence, positions, None)[:, -BLOCK:]
        wrong = max(wrong, _relative_error(off, right))
    assert cached.tokens == recomputed.tokens, name
    assert len(cached_steps) == len(recomputed_steps) and cached.model_rows < recomputed.model_rows / 2, name
    return dict(consistency=consistency, cache=cache_error, off_by_one=wrong, sizes=sizes,
                tokens=cached.tokens, calls=cached.model_calls)


def _context_window_checks():
    """BD3-LM's context window with sliding layers: the cache restarts when the window moves; cached equals
    recomputed."""
    from megatron_csbp.tools.sampling import generate

    _, (sampler, _), _ = _build((2, 0), 2, "block-causal")
    out = {}
    for kv_cache in (True, False):
        steps = []
        settings = _settings(kv_cache=kv_cache, context_window=12)
        out[kv_cache] = generate(sampler, PROMPTS, NEW_TOKENS, settings,
                                 on_step=lambda *step: steps.append(step[3].to("cpu", copy=True))), steps
    error = max(_relative_error(a, b) for a, b in zip(out[True][1], out[False][1]))
    assert out[True][0].tokens == out[False][0].tokens
    return error


def _dropped_position_check():
    """A call whose rows see a position the sliding cache dropped is refused, not computed wrong."""
    from megatron_csbp.tools.sampling import SamplingContext

    _, (sampler, _), _ = _build((2, 0), None, "block-causal")
    context = SamplingContext(1, SEQ)
    tokens = torch.arange(16)[None] % MASK
    with torch.no_grad():
        sampler(tokens, torch.arange(16)[None], None, inference_context=context)
        context.sequence_len_offset = 4  # rows from 4 see position 2 on; the cache kept 10 on
        try:
            sampler(tokens[:, 4:8], torch.arange(4, 8)[None], None, inference_context=context)
        except ValueError as error:
            return str(error)
    return None


def _all_checks(rank, world_size):
    from megatron.core import parallel_state as mpu

    from megatron_csbp.mcore import cpu_backend

    with cpu_backend.active():
        results = {name: _case_checks(name, *case) for name, *case in CASES}
        window_error = _context_window_checks()
        refusal = _dropped_position_check()
        mpu.destroy_model_parallel()
    return results, window_error, refusal


@pytest.fixture(scope="module")
def checked():
    return run_ranks(_all_checks, 1, timeout=600)[0]


def test_windowed_sampler_logits_equal_the_training_forward_and_the_trimmed_cache_changes_nothing(checked):
    """At every denoising step of a full generation, the sampler's logits (cached) equal the training forward's on
    `[x_t ; x_0]` rows under the training mask with the same windows (<= 1e-5), and the cached run's tokens and
    logits equal recomputation's (<= 1e-5) while each sliding layer's cache holds at most LEFT + B rows (and did
    drop positions), each global layer megatron-core's every position; without a window too, with token-causal
    clean rows (a long prompt's committed rows run alone as clean rows). Negative control: a sampler whose
    windows reach one position further gives other logits (> 1e-3)."""
    results, _, _ = checked
    for name, result in results.items():
        print(f"{name}: sampler vs training {result['consistency']:.2e}, trimmed cache vs recompute "
              f"{result['cache']:.2e}, window off by one {result['off_by_one']:.2e}, {result['calls']} calls, "
              f"cache rows per layer (window, most rows held, latest first position) {result['sizes']}")
        assert result["consistency"] <= TOLERANCE, (name, result["consistency"])
        assert result["cache"] <= TOLERANCE, (name, result["cache"])
        assert result["off_by_one"] > 1e-3 or "no window" in name, (name, result["off_by_one"])
        assert all(len(tokens) == NEW_TOKENS and MASK not in tokens for tokens in result["tokens"]), name


def test_the_context_window_with_sliding_layers_and_a_dropped_position_refused(checked):
    """BD3-LM's context window (12) over sliding layers: cached equals recomputed (<= 1e-5). A call whose rows
    would see positions the sliding cache dropped raises, naming the layer and the positions."""
    _, window_error, refusal = checked
    print(f"context window 12 with sliding layers: cached vs recomputed {window_error:.2e}; refusal: {refusal}")
    assert window_error <= TOLERANCE
    assert refusal is not None and "no longer holds" in refusal and "\n" not in refusal


def test_a_right_window_is_refused_in_one_line():
    """The sampler decodes what training trains: a right window (a clean row seeing later clean tokens) is
    refused in one line naming --window-size and the fix."""
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.tools.sampling import SamplingAttention

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                               window_size=(2, 1))
    with pytest.raises(ValueError) as error:
        SamplingAttention(config, 1, block_size=BLOCK)
    message = str(error.value)
    assert "--window-size 2,1" in message and "give --window-size 2,0" in message and "\n" not in message


# ------------------------------------------------------------------------------ a trained windowed checkpoint
def test_generate_decodes_a_trained_sliding_window_checkpoint_with_and_without_the_cache(tmp_path):
    """scripts/generate_bdlm.py takes a checkpoint trained with `--window-size 5,0` (every layer sliding, a window
    shorter than the block of 8): it completes its alphabet corpus, the same with `--no-kv-cache`."""
    import ast
    import os
    import subprocess
    import sys

    from megatron_csbp.data.datasets import write_indexed_dataset
    from test_sampling import ALPHABET, REPO, TINY, _environment, _run

    documents = [list((ALPHABET * 20)[i:i + 400].encode()) for i in range(26) for _ in range(3)]
    write_indexed_dataset(documents, str(tmp_path / "alphabet"), 257)
    common = {**TINY, "data_path": tmp_path / "alphabet"}
    overrides = [f"{key.replace('_', '-')}={value}" for key, value in common.items()]
    _run([sys.executable, os.path.join(REPO, "scripts", "pretrain_bdlm.py"), *overrides, "train-iters=120",
          "lr-warmup-iters=5", f"save={tmp_path / 'trained'}", "--window-size", "5,0"])
    prompts, new = ["abcdefghij", "pqrs"], 20
    samples = {}
    for flags in ([], ["--no-kv-cache"]):
        done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "generate_bdlm.py"), "--load",
                               str(tmp_path / "trained"), *[f for p in prompts for f in ("--prompt", p)],
                               "--max-new-tokens", str(new), *flags],
                              cwd=REPO, env=_environment(), timeout=300, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        samples[tuple(flags)] = [ast.literal_eval(line.split(": ", 1)[1]) for line in done.stdout.splitlines()
                                 if line.startswith("sample ")]
    print(f"windowed checkpoint: {samples}")
    expected = [(ALPHABET * 3)[ALPHABET.index(p[-1]) + 1:][:new] for p in prompts]
    assert samples[()] == samples[("--no-kv-cache",)] == expected
