"""Block-diffusion sampling: the sampler's logits are the training forward's, the K/V cache changes nothing,
every strategy completes a block in `S` steps without touching committed tokens, and a briefly trained
model completes its corpus (an untrained one does not), on 1 rank and under TP 2, from our checkpoints."""

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from spawn import run_ranks
from pretrain_runs import TORCHRUN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, BLOCK, VOCAB, MASK = 32, 4, 32, 31
TOLERANCE = 1e-5


def _settings(**overrides):
    from megatron_csbp.tools.sampling import SamplingSettings

    fields = dict(block_size=BLOCK, mask_token_id=MASK, steps_per_block=BLOCK)
    fields.update(overrides)
    return SamplingSettings(**fields)


# ------------------------------------------------------------------------------------------ strategies alone
@pytest.mark.parametrize("strategy", ["confidence", "top-k", "posterior", "first-hitting"])
@pytest.mark.parametrize("steps", [3, 8, 13])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_strategy_unmasks_a_block_within_its_steps_and_keeps_unmasked_tokens(strategy, steps, temperature):
    from megatron_csbp.tools.sampling import unmask_step

    block_size = 8
    if strategy == "first-hitting" and steps < block_size:
        with pytest.raises(ValueError, match="--steps-per-block 3 must be >= the block size 8"):
            _settings(block_size=block_size, strategy=strategy, steps_per_block=steps)
        return
    settings = _settings(block_size=block_size, strategy=strategy, steps_per_block=steps, temperature=temperature,
                         top_p=0.9, threshold=0.3)
    generator = torch.Generator().manual_seed(steps)
    block = torch.full((5, block_size), MASK)
    fixed = torch.rand(5, block_size, generator=generator) < 0.3  # prompt tokens already in the block
    block[fixed] = torch.randint(0, MASK, (int(fixed.sum()),), generator=generator)
    for step in range(steps):
        masked = block == MASK
        logits = 4 * torch.randn(5, block_size, VOCAB, generator=generator)
        logits[..., MASK] = float("-inf")
        new = unmask_step(block, logits, steps - step, settings, generator)
        assert torch.equal(new[~masked], block[~masked]), "an unmasked token changed"
        unmasked = (masked & (new != MASK)).sum(1)
        if strategy == "first-hitting":
            assert torch.equal(unmasked, masked.sum(1).clamp(max=1))
        elif strategy != "posterior":
            assert bool((unmasked >= masked.any(1).long()).all()), "a step unmasked nothing"
        if strategy == "confidence" and temperature == 0.0:
            confident = masked & (logits.softmax(-1).max(-1).values > settings.threshold)
            assert bool((new[confident] != MASK).all()), "a position above the threshold stayed masked"
        block = new
    assert not bool((block == MASK).any()), f"{strategy}: masked positions left after {steps} steps"


def test_top_p_keeps_the_nucleus_and_settings_refuse_bad_values():
    from megatron_csbp.tools.sampling import unmask_step

    logits = torch.tensor([[[5.0, 4.0, 0.0, float("-inf")]] * 6])  # p ~ 0.73, 0.27, ...
    block = torch.full((1, 6), 3)
    settings = _settings(block_size=6, mask_token_id=3, strategy="top-k", steps_per_block=1, temperature=1.0,
                         top_p=0.5)
    drawn = unmask_step(block, logits.expand(200, -1, -1).contiguous(), 1, settings, torch.Generator().manual_seed(0))
    assert bool((drawn == 0).all()), "top-p 0.5 must keep only the most likely token"
    for field, value, flag in [("steps_per_block", 0, "--steps-per-block"), ("strategy", "best", "--strategy"),
                               ("threshold", 1.5, "--threshold"), ("temperature", -1.0, "--temperature"),
                               ("top_p", 0.0, "--top-p"), ("seed", -1, "--seed")]:
        with pytest.raises(ValueError, match=flag):
            _settings(**{field: value})


def test_block_causal_attention_is_the_bdlm_mask_over_position_ordered_rows():
    """A query at position p sees the keys of blocks <= p // B, whether its call holds one block (plain
    attention) or several (the kernels' prefix attention); GQA heads stay grouped as Megatron groups them."""
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.tools.sampling import BlockCausalAttention

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0)
    attention = BlockCausalAttention(config, 1, block_size=BLOCK)
    generator = torch.Generator().manual_seed(0)
    for first, keys in [(8, 12), (8, 20), (0, 20), (13, 15)]:
        rows = keys - first
        query = torch.randn(rows, 2, 4, 8, generator=generator, dtype=torch.float64)
        key, value = torch.randn(2, keys, 2, 2, 8, generator=generator, dtype=torch.float64)
        visible = (torch.arange(keys) // BLOCK)[None, :] <= (torch.arange(first, keys) // BLOCK)[:, None]
        scores = torch.einsum("sbhd,tbhd->bhst", query, key.repeat_interleave(2, 2)) * 8 ** -0.5
        expected = torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(~visible, float("-inf")).softmax(-1),
                                value.repeat_interleave(2, 2)).reshape(rows, 2, -1)
        got = attention(query, key, value)
        assert ((got - expected).norm() / expected.norm()) < 1e-10, (first, keys)


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


def _model_checks(rank, world_size):
    from megatron_csbp.mcore import cpu_backend

    with cpu_backend.active():
        return _checks_on_one_rank()


def _checks_on_one_rank():
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.core.device import default_device
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.mcore.model import model_provider
    from megatron_csbp.tools.sampling import STRATEGIES, generate, sampling_model

    mpu.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               use_cpu_initialization=True, calculate_per_token_loss=True, hidden_dropout=0.0,
                               attention_dropout=0.0, normalization="RMSNorm", init_method_std=0.3)
    layout = CSBPLayout(SEQ, BLOCK, 1, 1)  # dual-end order: noisy rows are not in position order
    trained = model_provider(config=config, layout=layout, vocab_size=VOCAB, mask_token_id=MASK)
    sampler = sampling_model(config, VOCAB, BLOCK, max_sequence_length=SEQ)
    sampler.load_state_dict(trained.state_dict(), strict=True)
    trained, sampler = trained.to(default_device()).eval(), sampler.to(default_device())
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0]]  # two blocks of prefill
    generator = torch.Generator().manual_seed(1)
    errors, control, results = {}, [], {}
    for shifted in (False, True):
        for strategy in STRATEGIES:
            sampled = {"temperature": 1.0, "seed": 5} if strategy in ("posterior", "first-hitting") else {}
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
    # EOS: a sample ends before its first EOS; with every sample finished, decoding stops early.
    full = results["bd3lm confidence"]
    eos = full[0][5]
    stopped = generate(sampler, prompts, 12, _settings(threshold=0.5, eos_token_id=eos))
    for tokens, reference in zip(stopped.tokens, full):
        assert tokens == (reference[:reference.index(eos)] if eos in reference else reference)
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
    done = subprocess.run(command, cwd=REPO, env=_environment(), timeout=300, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert done.returncode == expect, f"exit status {done.returncode}, expected {expect}:\n{done.stdout[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def alphabet_checkpoints(tmp_path_factory):
    """A tiny BDLM trained 120 iterations on the repeated alphabet by scripts/pretrain_bdlm.py."""
    from megatron_csbp.training.data import write_indexed_dataset

    root = tmp_path_factory.mktemp("alphabet")
    documents = [list((ALPHABET * 20)[i:i + 400].encode()) for i in range(26) for _ in range(3)]
    write_indexed_dataset(documents, str(root / "alphabet"), 257)
    script = os.path.join(REPO, "scripts", "pretrain_bdlm.py")
    common = {**TINY, "data_path": root / "alphabet"}
    overrides = [f"{key.replace('_', '-')}={value}" for key, value in common.items()]
    _run([sys.executable, script, *overrides, "train-iters=120", "lr-warmup-iters=5", f"save={root / 'trained'}"])
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
    from megatron_csbp.tools import sampling

    script = _script()
    completions = []
    options, args, directory, settings, prompts, encoded = script.prepare(["--load", load, *_prompt_flags()])
    with cpu_backend.active():
        for weights in (directory, None):
            model = script.build_model(args, weights)
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


def _script():
    spec = importlib.util.spec_from_file_location("generate_bdlm", os.path.join(REPO, "scripts", "generate_bdlm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bad_flags_are_one_line_refusals_with_exit_2(alphabet_checkpoints, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    load = str(alphabet_checkpoints / "trained")
    base = ["--load", load, "--max-new-tokens", "8"]
    cases = [
        (["--load", load, "--max-new-tokens", "8"], "--prompt TEXT"),
        ([*base, "--prompt", "a", "--prompt-file", "x.txt"], "one of the two"),
        ([*base, "--prompt-file", str(tmp_path / "none.txt")], "--prompt-file"),
        ([*base, "--prompt", ""], "a prompt is empty"),
        (["--load", load, "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens 0"),
        ([*base, "--prompt", "a", "--strategy", "best"], "--strategy"),
        ([*base, "--prompt", "a", "--strategy", "first-hitting", "--steps-per-block", "4"], "--steps-per-block 4"),
        ([*base, "--prompt", "a", "--top-p", "0"], "--top-p"),
        ([*base, "--prompt", "a", "--tensor-model-parallel-size", "2"], "launch exactly"),
        (["--load", str(tmp_path / "nothing"), "--prompt", "a", "--max-new-tokens", "8"], "--load"),
        ([*base, "--prompt", "a", "--config", str(tmp_path / "none.yaml")], "--config"),
    ]
    script = _script()
    for argv, message in cases:
        assert script.main(argv) == 2, argv
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and message in error and error.startswith("generate_bdlm.py: error:"), \
            (argv, error)
