"""`--strategy diffusion-gemma`: transformers' DiffusionGemma decoder as a strategy of our block sampler.

* The decoding rules equal transformers' `DiffusionGemmaForBlockDiffusion.generate` token by token: our loop
  (`sampling.decode`, the code our model samples through) runs on transformers' own decoder (a tiny random model)
  and draws from a generator seeded as the reference seeds the global one.
* Our sampling model's logits of the canvas, given the previous step's logits, are the self-conditioned training
  forward's (a tiny DiffusionGemma model with the softcap and the embedding scale), with the cache and without.
* A briefly trained tiny DiffusionGemma checkpoint samples through scripts/generate_bdlm.py, which refuses bad
  input in one line (exit 2).
* Imported DiffusionGemma checkpoints (Gemma 4's layers): the sampler's canvas logits equal transformers' decoder,
  and `sampling.generate` and scripts/generate_bdlm.py give transformers' `generate` tokens on the HF directory.
"""

import os
import re
import sys

import pytest
import torch

import test_sampling as sampling_test
from spawn import run_ranks
from test_sampling import ALPHABET, _run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-5


# ------------------------------------------------------------------------------------- against transformers
CANVAS, HF_VOCAB, STEPS, NEW = 4, 64, 10, 12


def _tiny_transformers_model(vocab_size=HF_VOCAB):
    """The tiny random `DiffusionGemmaForBlockDiffusion` (sliding and global layers, experts), its tied head scaled
    up so that its predictions are confident enough for the early stop to fire."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig

    text = DiffusionGemmaTextConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=8, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"], num_experts=4, top_k_experts=2, moe_intermediate_size=16,
        eos_token_id=None, pad_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text, canvas_length=CANVAS,
                                                                 vision_config=None)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # tied: the input embedding too (a norm follows it)
    return model


class TransformersDecoder:
    """Test adapter: transformers' decoder as `decode`'s logits source. The committed tokens not yet encoded go
    through its encoder into its cache, as `generate` does (the prompt at once, then each finished canvas); the
    canvas through its decoder with the self-conditioning logits, at the positions after the prefix."""

    def __init__(self, model):
        from transformers import DynamicCache

        self.model, self.encoded, self.calls, self.rows = model, 0, 0, 0
        self.cache = DynamicCache(config=model.config.get_text_config(decoder=True))

    def restart(self):
        raise AssertionError("no context window here")

    def __call__(self, committed, block, self_conditioning=None):
        start = committed.shape[1]
        if start > self.encoded:
            self.model.model.encoder(input_ids=committed[:, self.encoded:], cache=self.cache,
                                     position_ids=torch.arange(self.encoded, start, dtype=torch.int32)[None])
            self.encoded = start
        self.calls += 1
        positions = torch.arange(start, start + block.shape[1], dtype=torch.int32)[None]
        return self.model(decoder_input_ids=block, cache=self.cache, self_conditioning_logits=self_conditioning,
                          decoder_position_ids=positions).logits


STOPS = {"off": None, "defaults": dict(stability_threshold=1, confidence_threshold=0.005),
         "stable 1": dict(stability_threshold=1, confidence_threshold=5.0),
         "stable 2": dict(stability_threshold=2, confidence_threshold=5.0),
         "stable 0": dict(stability_threshold=0, confidence_threshold=1.0)}


def _both(model, prompts, seed, stop, entropy_bound=0.1):
    """(transformers' new tokens, its decoder passes per sample, ours, our decoder calls)."""
    from megatron_csbp.core.objectives import UNIFORM_STATE
    from megatron_csbp.tools.sampling import SamplingSettings, decode

    torch.manual_seed(seed)
    switched = stop or dict(stability_threshold=None, confidence_threshold=None)  # None: no stopping criteria
    theirs = model.generate(torch.tensor(prompts), max_new_tokens=NEW, max_denoising_steps=STEPS, t_min=0.4,
                            t_max=0.8, sampler_config=_entropy_bound(entropy_bound), **switched)
    settings = SamplingSettings(block_size=CANVAS, mask_token_id=HF_VOCAB, vocab_size=HF_VOCAB, steps_per_block=STEPS,
                                strategy="diffusion-gemma", corruption=UNIFORM_STATE, seed=seed,
                                entropy_bound=entropy_bound, early_stop=stop is not None, **(stop or {}))
    decoder = TransformersDecoder(model)
    with torch.no_grad():
        ours = decode(decoder, prompts, NEW, settings, torch.device("cpu"))
    passes = (NEW / theirs.tokens_per_forward).round().long().tolist()
    return theirs.sequences[:, len(prompts[0]):].tolist(), passes, ours, decoder.calls


def _entropy_bound(bound):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    return EntropyBoundSamplerConfig(entropy_bound=bound)


def test_diffusion_gemma_decodes_token_by_token_as_transformers_generate():
    """Our decoding loop on transformers' decoder gives `model.generate`'s tokens, token by token: seeds 0-2, two
    prompts in a batch (one or two blocks of prefix), the temperature schedule on (0.8 -> 0.4), the early stop off
    and on (the reference's thresholds, and looser confidence thresholds under which it fires at different steps
    for the two samples: a stopped sample keeps its canvas while the other runs on), two entropy bounds. The draws
    are equal because transformers draws from the global generator (`torch.manual_seed(seed)`) in the order ours
    keeps (the canvas, then per step the tokens and the renoising ids) and ours from a generator seeded alike.
    Negative control: another seed gives other tokens."""
    model = _tiny_transformers_model()
    fired = 0
    for prompts in ([[5, 6, 7, 8], [9, 10, 11, 12]], [[1, 2, 3, 4, 5, 6, 7, 8]]):
        for seed in (0, 1, 2):
            for name, stop in STOPS.items():
                for bound in (0.1, 1.0) if name == "defaults" else (0.1,):
                    theirs, passes, ours, calls = _both(model, prompts, seed, stop, bound)
                    print(f"prompts {len(prompts)}x{len(prompts[0])} seed {seed} stop {name} bound {bound}: "
                          f"equal {ours == theirs}, decoder passes {passes} (ours: {calls} calls)")
                    assert ours == theirs, (seed, name, ours, theirs)
                    # the same steps, the stop included (a batch runs until its last sample stops)
                    assert calls >= max(passes) and (len(prompts) > 1 or calls == passes[0]), (calls, passes)
                    fired += calls < STEPS * (NEW // CANVAS)
    assert fired >= 10, fired  # the early stop was exercised
    theirs, _, ours, _ = _both(model, [[5, 6, 7, 8]], 0, None)
    other = _both(model, [[5, 6, 7, 8]], 3, None)[2]
    assert ours == theirs and other != ours


# ---------------------------------------------------------------------------- against the training forward
SEQ, BLOCK, VOCAB, MASK, HIDDEN = 32, 4, 32, 31, 32


def _build(softcap=10.0):
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.core.clean_attention import CLEAN_ATTENTIONS
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.mcore.model import model_provider
    from megatron_csbp.tools.sampling import sampling_model

    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=48, use_cpu_initialization=True, calculate_per_token_loss=True,
                               hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                               init_method_std=0.3)
    pieces = dict(self_conditioning=True, final_logit_softcapping=softcap, embedding_scale=HIDDEN ** 0.5)
    layout = CSBPLayout(SEQ, BLOCK, 1, 1, clean_attention="token-causal")
    trained = model_provider(config=config, layout=layout, vocab_size=VOCAB, mask_token_id=MASK, **pieces)
    sampler = sampling_model(config, VOCAB, BLOCK, clean_attention=CLEAN_ATTENTIONS("token-causal"),
                             max_sequence_length=SEQ, **pieces)
    sampler.load_state_dict(trained.state_dict(), strict=True)
    return trained.eval(), sampler.eval(), layout


def _training_logits(model, layout, committed, canvas, self_conditioned, generator):
    """The training forward's logits of the canvas positions on `[x_t ; x_0]` rows holding the committed prefix as
    `x0` and the canvas as `x_t` (everything else random: it must not matter); `self_conditioned`: every sample
    takes the signal of its own first pass."""
    batch, start = committed.shape
    x0 = torch.randint(0, MASK, (batch, SEQ), generator=generator)
    xt = torch.randint(0, MASK, (batch, SEQ), generator=generator)
    x0[:, :start], xt[:, start:start + BLOCK] = committed, canvas
    rows = torch.cat([xt[:, layout.noisy_positions], x0[:, layout.clean_positions]], dim=1)
    chosen = torch.ones(batch, dtype=torch.bool) if self_conditioned else None
    with torch.no_grad():
        logits = model(rows, layout.row_positions.expand(batch, -1), self_conditioned=chosen)
    by_position = torch.empty_like(logits)
    by_position[:, layout.noisy_positions] = logits
    return by_position[:, start:start + BLOCK]


def _relative_error(got, expected):
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(got)), "different entries are -inf"
    return ((got - expected)[finite].abs().max() / expected[finite].abs().max()).item()


def _self_conditioned_checks(rank, world_size):
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.core.objectives import UNIFORM_STATE
    from megatron_csbp.mcore import cpu_backend
    from megatron_csbp.tools.sampling import SamplingSettings, _BlockLogits, generate

    with cpu_backend.active():
        mpu.initialize_model_parallel()
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        trained, sampler, layout = _build()
        model_parallel_cuda_manual_seed(0)
        uncapped = _build(softcap=None)[1]
        uncapped.load_state_dict(sampler.state_dict())
        generator = torch.Generator().manual_seed(1)
        errors, controls = {}, {}
        for kv_cache in (True, False):
            settings = SamplingSettings(block_size=BLOCK, mask_token_id=MASK, vocab_size=MASK, steps_per_block=3,
                                        strategy="diffusion-gemma", corruption=UNIFORM_STATE, kv_cache=kv_cache)
            logits = _BlockLogits(sampler, 2, SEQ, settings)
            worst = [0.0, 0.0]
            sequence = torch.randint(0, MASK, (2, SEQ), generator=generator)
            for start in (8, 12, 20):  # two blocks of prefill first, then one block, then two more
                committed = sequence[:, :start]
                canvas = torch.randint(0, MASK, (2, BLOCK), generator=generator)
                with torch.no_grad():
                    first = logits(committed, canvas)
                    second = logits(committed, canvas, first)
                worst[0] = max(worst[0], _relative_error(
                    first, _training_logits(trained, layout, committed, canvas, False, generator)))
                expected = _training_logits(trained, layout, committed, canvas, True, generator)
                worst[1] = max(worst[1], _relative_error(second, expected))
                if not controls:  # without the signal, and without the softcap, the logits miss
                    controls["signal dropped"] = _relative_error(first, expected)
                    control = _BlockLogits(uncapped, 2, SEQ, settings)
                    with torch.no_grad():
                        controls["softcap off"] = _relative_error(control(committed, canvas, first), expected)
            errors[f"kv cache {'on' if kv_cache else 'off'}"] = worst
        tokens = {}
        for kv_cache in (True, False):
            settings = SamplingSettings(block_size=BLOCK, mask_token_id=MASK, vocab_size=MASK, steps_per_block=6,
                                        strategy="diffusion-gemma", corruption=UNIFORM_STATE, kv_cache=kv_cache,
                                        seed=3)
            generation = generate(sampler, [[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2, 8, 1, 8, 2]], 10, settings)
            tokens[kv_cache] = generation.tokens
        mpu.destroy_model_parallel()
    return errors, controls, tokens


def test_sampler_logits_equal_the_self_conditioned_training_forward():
    """A tiny `--bdlm-objective diffusion-gemma` model (token-causal clean stream, softcap 10, scaled embeddings):
    the sampler's canvas logits without a signal equal the training forward's first pass, and given those logits
    as the self-conditioning logits equal the self-conditioned training forward (whose signal is its first pass's
    expected embedding), cached and not (<= 1e-5). The cache changes no token. Negative controls: the signal
    dropped, and the softcap off, miss (> 1e-2)."""
    errors, controls, tokens = run_ranks(_self_conditioned_checks, 1, timeout=300)[0]
    print(errors, controls)
    for name, (first, second) in errors.items():
        assert first <= TOLERANCE and second <= TOLERANCE, (name, first, second)
    assert all(miss > 1e-2 for miss in controls.values()), controls
    assert tokens[True] == tokens[False] and all(len(t) == 10 and MASK not in t for t in tokens[True]), tokens


# ---------------------------------------------------------------------------------------- a trained checkpoint
TINY = {**{key: value for key, value in sampling_test.TINY.items() if key != "untie_embeddings_and_output_weights"},
        **dict(bdlm_objective="diffusion-gemma", bdlm_clean_attention="token-causal", bdlm_ar_loss_weight=1.0,
               final_logit_softcapping=30.0, scale_embeddings="true")}
PROMPTS = ["abcdefgh", "ijklmnop"]  # one block each
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def alphabet_checkpoint(tmp_path_factory):
    """A tiny DiffusionGemma model (tied embeddings, as Gemma's) trained 120 iterations on the repeated alphabet."""
    return sampling_test.trained_on_the_alphabet(tmp_path_factory.mktemp("alphabet_dg"), TINY)


def _generate(load, *flags, expect=0):
    return _run([sys.executable, os.path.join(REPO, "scripts", "generate_bdlm.py"), "--load", str(load), *flags],
                expect)


def test_a_trained_diffusion_gemma_checkpoint_samples_through_the_script(alphabet_checkpoint):
    """scripts/generate_bdlm.py --strategy diffusion-gemma on the trained checkpoint (the sampler builds its
    self-conditioning block, softcap and embedding scale; the weights load): it prints its settings and the
    samples, which continue the alphabet; the same seed gives the same samples, the early stop saves calls."""
    prompts = [flag for prompt in PROMPTS for flag in ("--prompt", prompt)]
    flags = ["--strategy", "diffusion-gemma", *prompts, "--max-new-tokens", str(NEW_TOKENS), "--steps-per-block", "16",
             "--ignore-eos"]
    output = _generate(alphabet_checkpoint, *flags)
    print(output)
    samples = [eval(line.split(": ", 1)[1]) for line in output.splitlines() if line.startswith("sample ")]
    expected = [(ALPHABET * 3)[ALPHABET.index(p[-1]) + 1:][:NEW_TOKENS] for p in PROMPTS]
    right = sum(a == b for sample, want in zip(samples, expected) for a, b in zip(sample, want))
    print(f"samples {samples}, expected {expected}: {right} of {2 * NEW_TOKENS} right")
    assert len(samples) == 2 and all(len(sample) == NEW_TOKENS for sample in samples), output
    assert right >= NEW_TOKENS, (samples, expected)  # an untrained model gets ~1 in 257
    settings = next(line for line in output.splitlines() if line.startswith("checkpoint "))
    assert "strategy diffusion-gemma (entropy bound 0.1)" in settings and "temperature 0.8 -> 0.4" in settings
    calls = int(re.search(r"(\d+) model calls", output).group(1))
    assert _generate(alphabet_checkpoint, *flags).splitlines()[-2:-1] == output.splitlines()[-2:-1]
    full = int(re.search(r"(\d+) model calls", _generate(alphabet_checkpoint, *flags, "--no-early-stop")).group(1))
    print(f"model calls: {calls} with the early stop, {full} without")
    assert full == 2 * 16 and calls <= full


def test_bad_diffusion_gemma_input_is_a_one_line_refusal_with_exit_2(alphabet_checkpoint, tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    from megatron_csbp.tools import generate

    mask_config = tmp_path / "bd3lm.yaml"
    mask_config.write_text("bdlm-objective: bd3lm\n")
    base = ["--load", str(alphabet_checkpoint), "--prompt", "abc", "--max-new-tokens", "8"]
    dg = [*base, "--strategy", "diffusion-gemma"]
    cases = [
        ([*base, "--strategy", "confidence"], "--strategy confidence decodes from MASK tokens, but this checkpoint's "
         "--bdlm-objective trains a uniform-state corruption (no MASK): use --strategy diffusion-gemma"),
        ([*base, "--strategy", "top-k"], "--strategy top-k decodes from MASK tokens"),
        ([*dg, "--config", str(mask_config)], "--strategy diffusion-gemma decodes a uniform-state model"),
        ([*dg, "--entropy-bound", "0"], "--entropy-bound 0.0 must be > 0"),
        ([*dg, "--t-min", "-1"], "--t-min -1.0 must be >= 0"),
        ([*dg, "--t-max", "0.3"], "--t-max 0.3 must be > --t-min 0.4"),
        ([*dg, "--stability-threshold", "-1"], "--stability-threshold -1 must be >= 0"),
        ([*dg, "--confidence-threshold", "0"], "--confidence-threshold 0.0 must be > 0"),
        ([*dg, "--temperature", "1"], "drop --temperature, --top-k and --top-p"),
        ([*dg, "--steps-per-block", "0"], "--steps-per-block 0 must be >= 1"),
        ([*base, "--strategy", "top-k", "--entropy-bound", "0.2", "--no-early-stop"],
         "--entropy-bound, --no-early-stop: for --strategy diffusion-gemma only (this is top-k)"),
    ]
    for argv, message in cases:
        assert generate.main(argv) == 2, argv
        error = capsys.readouterr().err.strip()
        print(error)
        assert len(error.splitlines()) == 1 and message in error and error.startswith("generate_bdlm.py: error:"), \
            (argv, error)


# ------------------------------------------------------------------- an imported checkpoint against transformers
IDS = 300  # the HF models' ids and their tokenizer's; the import appends our MASK as id 300
PROMPTS_8 = ["abcdefgh", "ijklmnop"]  # 8 tokens each: two canvases of the confident model (block alignment agrees)
DG_NEW, DG_STEPS = 12, 10


def _import(hf_model, root, name):
    """`hf_model` with a 300-id tokenizer saved to `root/name`, imported by scripts/convert_hf.py into
    `root/name_ckpt`: (HF dir, checkpoint dir)."""
    from megatron_csbp.tools import tiny_hf_model

    hf_dir, checkpoint = root / name, root / f"{name}_ckpt"
    hf_model.save_pretrained(hf_dir)
    tiny_hf_model.make_tokenizer(IDS).save_pretrained(hf_dir)
    _run([sys.executable, os.path.join(REPO, "scripts", "convert_hf.py"), "import", "--hf-dir", str(hf_dir),
          "--save", str(checkpoint)])
    return hf_dir, checkpoint


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Two imported DiffusionGemma checkpoints: "random" is test_hf_diffusion_gemma's model (4 layers, global
    layers with their own head size and K/V heads, K = V, every weight drawn with std 0.3), "confident" this
    module's tiny model (transformers' initialisation, the head scaled up) with a 300-id vocabulary."""
    import test_hf_diffusion_gemma as hf

    root = tmp_path_factory.mktemp("imported_dg")
    return {"random": _import(hf._hf_model(), root, "random"),
            "confident": _import(_tiny_transformers_model(IDS), root, "confident")}


def _load_transformers(hf_dir):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(hf_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()


DG_STOPS = ("off", "defaults", "stable 1")  # of STOPS: the reference's thresholds, and a looser one that fires


def _generate_transformers(model, prompts, seed, stop):
    """transformers' `generate`: new tokens per prompt, decoder passes per prompt (the reference's defaults but
    max_new_tokens, max_denoising_steps and the stop `STOPS[stop]`; its eos off, as --ignore-eos)."""
    torch.manual_seed(seed)
    out = model.generate(torch.tensor(prompts), max_new_tokens=DG_NEW, max_denoising_steps=DG_STEPS, t_min=0.4,
                         t_max=0.8, sampler_config=_entropy_bound(0.1), eos_token_id=None,
                         **(STOPS[stop] or dict(stability_threshold=None, confidence_threshold=None)))
    return out.sequences[:, len(prompts[0]):].tolist(), (DG_NEW / out.tokens_per_forward).round().long().tolist()


def _imported_checks(rank, world, imported):
    """Per checkpoint: the worst block error of our sampler's canvas logits against transformers' decoder, cache on
    and off, without and with the same self-conditioning logits, and a negative control; on the confident one, our
    `sampling.generate`'s tokens and transformers' `generate`'s per seed and early stop."""
    from megatron_csbp.core.objectives import UNIFORM_STATE
    from megatron_csbp.mcore import cpu_backend, parallel_state
    from megatron_csbp.tools import sampling
    from megatron_csbp.tools.inference import build_model, model_args, read_checkpoint
    import test_gemma4_attention as gemma

    results = {}
    with cpu_backend.active():
        for name, (hf_dir, load) in imported.items():
            checkpoint = read_checkpoint(str(load), log=lambda *_: None)
            args = model_args(checkpoint, None, 1)
            model, theirs = build_model(args, checkpoint.directory).eval(), _load_transformers(hf_dir)
            block = args.bdlm_block_size
            generator = torch.Generator().manual_seed(7)
            sequence = torch.randint(0, IDS, (2, 6 * block), generator=generator)
            for kv_cache in (True, False):
                settings = sampling.SamplingSettings(
                    block_size=block, mask_token_id=args.mask_token_id, vocab_size=args.tokenizer.vocab_size,
                    steps_per_block=DG_STEPS, strategy="diffusion-gemma", corruption=UNIFORM_STATE, kv_cache=kv_cache)
                ours, decoder = sampling._BlockLogits(model, 2, 6 * block, settings), TransformersDecoder(theirs)
                worst, control = [0.0, 0.0], 0.0
                for start in (2 * block, 3 * block, 5 * block):  # two blocks of prompt, then one, then two
                    committed, canvas = sequence[:, :start], torch.randint(0, IDS, (2, block), generator=generator)
                    with torch.no_grad():
                        first = decoder(committed, canvas)
                        second = decoder(committed, canvas, first / 0.6)  # a step's processed logits
                        ours_first = ours(committed, canvas)[..., :IDS]
                        ours_second = ours(committed, canvas, first / 0.6)[..., :IDS]
                    worst = [max(worst[0], gemma._relative(ours_first, first)),
                             max(worst[1], gemma._relative(ours_second, second))]
                    control = max(control, gemma._relative(ours_first, second))
                results[f"{name}, kv cache {'on' if kv_cache else 'off'}"] = (*worst, control)
            if name == "confident":
                prompts = [args.tokenizer.tokenize(text) for text in PROMPTS_8]
                for seed in (0, 1, 2):
                    for stop in DG_STOPS:
                        settings = sampling.SamplingSettings(
                            block_size=block, mask_token_id=args.mask_token_id, vocab_size=args.tokenizer.vocab_size,
                            steps_per_block=DG_STEPS, strategy="diffusion-gemma", corruption=UNIFORM_STATE,
                            seed=seed, early_stop=STOPS[stop] is not None, **(STOPS[stop] or {}))
                        generation = sampling.generate(model, prompts, DG_NEW, settings)
                        results[(seed, stop)] = (generation.tokens, generation.model_calls,
                                                 *_generate_transformers(theirs, prompts, seed, stop))
            parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def imported_results(imported):
    return run_ranks(_imported_checks, 1, imported, timeout=600)[0]


def test_imported_checkpoint_canvas_logits_equal_transformers_decoder(imported_results):
    """The sampler (scripts/generate_bdlm.py's model: Gemma 4's attention with the sampler's cache, its MoE block,
    layer scalars, the side-by-side RoPE table) on an imported DiffusionGemma: the canvas logits given the prefix
    (two blocks at once, then one, then two) equal transformers' decoder on its encoder's cache, without and with
    the same self-conditioning logits, cache on and off (<= 1e-5, relative norm per call, over the real ids).
    Negative control: without the signal, against the self-conditioned reference, they miss (by over 100 times the
    error: the confident model's signal moves its logits little)."""
    for name, (first, second, control) in ((k, v) for k, v in imported_results.items() if isinstance(k, str)):
        print(f"{name}: worst relative error {first:.2e} (no signal), {second:.2e} (self-conditioned); "
              f"control {control:.2e}")
        assert first <= TOLERANCE and second <= TOLERANCE, (name, first, second)
        assert control > 100 * max(first, second), (name, control)


def test_imported_checkpoint_samples_transformers_generate_tokens(imported_results):
    """Our sampler (`sampling.generate`, the loop scripts/generate_bdlm.py runs) on the imported confident model
    gives transformers' `generate` tokens on its HF directory, token by token: seeds 0-2, two 8-token prompts in a
    batch (two canvases each, so our block-aligned canvases start where transformers' do), 3 canvases of 10 steps,
    the reference's temperature schedule (0.8 -> 0.4) and entropy bound, the early stop off, at the reference's
    thresholds (which this untrained model never meets) and at a looser confidence threshold (5.0) that fires.

    What had to agree, and why it does: our vocabulary has MASK at id 300 after transformers' 300 ids (and padding
    to 384): the canvas and renoising ids are `randint(0, 300)` in both (MASK skipped: `sampling.random_ids`), and
    the tokens are drawn over the 300 real columns (`SamplingSettings.drawn_columns`; `torch.multinomial`'s draws
    depend on the width). Why the model is well conditioned: on the 0.3-std "random" model the self-conditioning
    chain amplifies the ~1e-6 per-call logit difference about twentyfold per step, so tokens part after a few
    steps though each call agrees (previous test); on a model at transformers' initialisation they do not."""
    fired = 0
    for (seed, stop), (ours, calls, theirs, passes) in (
            (k, v) for k, v in imported_results.items() if not isinstance(k, str)):
        print(f"seed {seed}, early stop {stop}: equal {ours == theirs}; our calls {calls}, their passes {passes}")
        assert ours == theirs, (seed, stop, ours, theirs)
        calls -= 1  # the prompts' two blocks run once on their own first (the cache's prefill)
        assert calls == max(passes), (calls, passes)  # the same steps, the stop included
        fired += calls < DG_STEPS * DG_NEW // 4
    assert fired >= 1, "the early stop never fired"
    tokens = [v[0] for k, v in imported_results.items() if not isinstance(k, str)]
    assert tokens[0] != tokens[len(DG_STOPS)], "seeds 0 and 1 gave the same tokens"  # negative control


def test_generate_bdlm_script_on_the_import_gives_transformers_tokens(imported):
    """scripts/generate_bdlm.py --strategy diffusion-gemma --load <the import> prints transformers' `generate`
    samples on the HF directory (the same settings as the previous test, seeds 0 and 1, each early stop). The
    script prints text: the comparison is of transformers' tokens detokenized by the checkpoint's tokenizer (the
    token-by-token comparison is the previous test's, on the same sampling loop)."""
    from megatron_csbp.tools.inference import model_args, read_checkpoint

    hf_dir, load = imported["confident"]
    checkpoint = read_checkpoint(str(load), log=lambda *_: None)
    tokenizer = model_args(checkpoint, None, 1).tokenizer
    prompts = [tokenizer.tokenize(text) for text in PROMPTS_8]
    assert all(len(p) % 4 == 0 for p in prompts), prompts
    theirs_model = _load_transformers(hf_dir)
    for seed in (0, 1):
        for stop in DG_STOPS:
            thresholds = ["--no-early-stop"] if STOPS[stop] is None else [
                "--stability-threshold", str(STOPS[stop]["stability_threshold"]),
                "--confidence-threshold", str(STOPS[stop]["confidence_threshold"])]
            flags = ["--strategy", "diffusion-gemma", "--max-new-tokens", str(DG_NEW), "--steps-per-block",
                     str(DG_STEPS), "--ignore-eos", "--seed", str(seed), *thresholds,
                     *[flag for text in PROMPTS_8 for flag in ("--prompt", text)]]
            output = _generate(load, *flags)
            samples = [eval(line.split(": ", 1)[1]) for line in output.splitlines() if line.startswith("sample ")]
            theirs = [tokenizer.detokenize(tokens) for tokens in _generate_transformers(theirs_model, prompts, seed,
                                                                                        stop)[0]]
            print(f"seed {seed}, early stop {stop}: {samples} vs {theirs}")
            assert samples == theirs, (seed, stop, samples, theirs)


# ------------------------------------------------------------------------------------------- the lm-eval harness
class _Request:  # what lm-eval hands a model: the request's arguments
    def __init__(self, *args):
        self.args = args


def _harness_answers(rank, world, loads):
    """Per checkpoint: the harness's generate_until answers to its prompts at its defaults (the checkpoint's
    strategy and steps, seed 0, EOS ends a sample), and what its loglikelihood says."""
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.tools.harness import MegatronCSBPLM

    results = {}
    for name, (load, prompts, new_tokens) in loads.items():
        lm = MegatronCSBPLM(load=load, batch_size=2)
        answers = lm.generate_until([_Request(prompt, {"until": [], "max_gen_toks": new_tokens}) for prompt in prompts])
        try:
            refusal = lm.loglikelihood([_Request(prompts[0], prompts[1])])
        except ConfigError as error:
            refusal = str(error)
        results[name] = answers, refusal, type(lm.model.decoder.layers[0]).__name__
    return results


def test_the_harness_decodes_diffusion_gemma_checkpoints_as_the_script_and_refuses_their_likelihoods(
        alphabet_checkpoint, imported):
    """lm-eval's model (`MegatronCSBPLM`) on a trained DiffusionGemma checkpoint and on an imported one (Gemma 4's
    layers in both of its models, the softcap, the embedding scale, the self-conditioning block): its
    generate_until answers are scripts/generate_bdlm.py's samples at the same defaults (strategy diffusion-gemma,
    48 steps, seed 0), and loglikelihood is one line naming the uniform-state objective (no MASK to score under).
    Prompt and sample stay within each checkpoint's trained length (the import's is 8: 4 + 4 tokens), where the
    harness and the script keep the whole prompt alike."""
    pytest.importorskip("lm_eval")
    loads = {"trained": (str(alphabet_checkpoint), PROMPTS, NEW_TOKENS),
             "imported": (str(imported["confident"][1]), ["abcd", "ijkl"], 4)}
    results = run_ranks(_harness_answers, 1, loads, timeout=600)[0]
    for name, (load, prompts, new_tokens) in loads.items():
        answers, refusal, layer = results[name]
        output = _generate(load, *[flag for prompt in prompts for flag in ("--prompt", prompt)], "--max-new-tokens",
                           str(new_tokens))
        samples = [eval(line.split(": ", 1)[1]) for line in output.splitlines() if line.startswith("sample ")]
        print(f"{name}: harness {answers}, script {samples}; {layer}; {refusal}")
        assert "strategy diffusion-gemma" in output and "steps/block 48" in output, output
        assert answers == samples and any(answers), (answers, samples)
        assert refusal.startswith(f"checkpoint {load}") and refusal.endswith(
            "was trained with --bdlm-objective diffusion-gemma (uniform-state corruption: no MASK, unit weights): it "
            "has no BD3-LM bound to score; run generate_until tasks only"), refusal
    assert results["imported"][2] == "Gemma4TransformerLayer" != results["trained"][2]
