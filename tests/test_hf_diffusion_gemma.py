"""DiffusionGemma through `scripts/convert_hf.py` (`tools/hf_diffusion_gemma.py`): import, logits, export.

* A tiny random `DiffusionGemmaForBlockDiffusion` (test_gemma4_attention's shape, a 300-id byte-level BPE tokenizer,
  its vision tower as transformers makes it) imports into our checkpoint; `model.yaml` carries the objective, the
  canvas as the block size, the windows and Gemma 4's flags.
* Our checkpoint's logits on every block that has a clean prefix equal transformers' (encoder on the prefix, decoder
  on the canvas), without and with the same self-conditioning logits, on one rank and CSBP2 (<= 1e-5 relative).
* Export gives back every tensor bit for bit (the embedding plus the MASK row), the encoder's layer scalars too,
  and loads with `from_pretrained`, whose logits equal the original's.
* Refused in one line, exit 2: an encoder whose layer scalars differ from the decoder's, a bidirectional encoder,
  an export in a serving format that has no DiffusionGemma.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import test_gemma4_attention as gemma
from spawn import on_cpu_backend, run_ranks

pytest.importorskip("transformers")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "convert_hf.py")
IDS = 300  # the tokenizer's ids and the HF embedding's rows; our MASK is id 300
TOLERANCE = 1e-5


def _convert(*argv):
    return subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=600)


def _make_hf(path, **text_overrides):
    """The tiny DiffusionGemma of test_gemma4_attention, with a vocabulary of `IDS` and its tokenizer, saved."""
    from megatron_csbp.tools import tiny_hf_model

    model = _hf_model(**text_overrides)
    model.save_pretrained(path)
    tiny_hf_model.make_tokenizer(IDS).save_pretrained(path)
    return model


def _hf_model(**text_overrides):
    vocabulary = gemma.HF_VOCAB
    gemma.HF_VOCAB = IDS
    try:
        model = gemma._transformers_model()
    finally:
        gemma.HF_VOCAB = vocabulary
    for key, value in text_overrides.items():
        setattr(model.config.text_config, key, value)
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffusion_gemma")
    _make_hf(root / "hf")
    result = _convert("import", "--hf-dir", str(root / "hf"), "--save", str(root / "ckpt"))
    assert result.returncode == 0, result.stderr[-2000:]
    result = _convert("export", "--load", str(root / "ckpt"), "--hf-dir", str(root / "out"))
    assert result.returncode == 0, result.stderr[-2000:]
    return root


def test_model_yaml_carries_what_the_fine_tune_needs(converted):
    import yaml

    with open(converted / "ckpt" / "model.yaml", encoding="utf-8") as handle:
        flags = yaml.safe_load(handle)
    expected = {"bdlm-objective": "diffusion-gemma", "bdlm-block-size": gemma.BLOCK, "bdlm-clean-attention":
                "token-causal", "bdlm-ar-loss-weight": 1.0, "window-size": [gemma.WINDOW - 1, 0],
                "window-attn-skip-freq": [1, 0, 1, 0], "gemma4-attention": True, "gemma4-moe": True,
                "global-kv-channels": gemma.GLOBAL_HEAD, "global-num-query-groups": gemma.GLOBAL_GROUPS,
                "global-rotary-percent": 0.25, "global-rotary-base": 1e6, "kv-channels": gemma.HEAD,
                "num-query-groups": gemma.GROUPS, "final-logit-softcapping": 30.0, "scale-embeddings": True,
                "num-experts": gemma.EXPERTS, "moe-router-topk": gemma.TOPK, "bdlm-mask-token-id": IDS}
    assert {key: flags.get(key) for key in expected} == expected


@on_cpu_backend
def _checkpoint_logits(rank, world, root, self_conditioning_logits):
    """This rank's noisy positions and our imported checkpoint's logits on them `[b, rows, IDS]`."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.training import checkpointing, providers
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.config import parse_args

    args = validate_args(parse_args(
        ["--config", os.path.join(root, "ckpt", "model.yaml"), f"seq-length={gemma.SEQ}",
         f"micro-batch-size={gemma.BATCH}", "train-iters=1", "lr=0", "data-path=unused",
         f"context-block-parallel={world}"]), world, check_paths=False, on_accelerator=False)
    parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=world, clean_shards=world)
    try:
        model_parallel_cuda_manual_seed(1234)
        run_providers = providers.RunProviders(args)
        model = run_providers.model_provider()
        checkpointing.load_checkpoint(os.path.join(root, "ckpt", "iter_0000000"), model, None, None,
                                      run_providers.vocabulary.recorded(args), load_optimizer=False, load_rng=False,
                                      log=lambda *_: None)
        layout = run_providers.run.layout
        x0, x_t = _inputs()
        ids = torch.cat([x_t[:, layout.noisy_positions], x0[:, layout.clean_positions]], dim=1)
        positions = layout.row_positions.expand(gemma.BATCH, -1).contiguous()
        model.eval()
        with torch.no_grad():
            signal = None
            if self_conditioning_logits is not None:  # their logits, our columns (MASK and padding -inf)
                table = model.embedding.word_embeddings.weight
                logits = torch.full((gemma.BATCH, layout.num_noisy_rows, table.shape[0]), float("-inf"))
                logits[..., :IDS] = self_conditioning_logits[:, layout.noisy_positions]
                signal = logits.softmax(-1).transpose(0, 1) @ table * gemma.HIDDEN ** 0.5
            logits = model(ids, positions, decoder_input=model._canvas_input(ids, positions, signal))
        return layout.noisy_positions, logits[:, :layout.num_noisy_rows, :IDS]
    finally:
        parallel_state.destroy_model_parallel()


def _inputs():
    generator = torch.Generator().manual_seed(5)
    return (torch.randint(0, IDS, (gemma.BATCH, gemma.SEQ), generator=generator),
            torch.randint(0, IDS, (gemma.BATCH, gemma.SEQ), generator=generator))


def _transformers_logits(model, self_conditioning_logits=None):
    """transformers' logits of every block from its clean prefix (block 0: zeros, not compared)."""
    x0, x_t = _inputs()
    blocks = [torch.zeros(gemma.BATCH, gemma.BLOCK, model.config.text_config.vocab_size)]
    with torch.no_grad():
        for start in range(gemma.BLOCK, gemma.SEQ, gemma.BLOCK):
            end = start + gemma.BLOCK
            signal = None if self_conditioning_logits is None else self_conditioning_logits[:, start:end]
            blocks.append(model(input_ids=x0[:, :start], decoder_input_ids=x_t[:, start:end],
                                self_conditioning_logits=signal).logits)
    return torch.cat(blocks, dim=1)


def _load(path):
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _worst(per_rank, reference):
    assembled = torch.zeros_like(reference)
    for positions, logits in per_rank:
        assembled[:, positions] = logits
    return max(gemma._relative(assembled[:, s:s + gemma.BLOCK], reference[:, s:s + gemma.BLOCK])
               for s in range(gemma.BLOCK, gemma.SEQ, gemma.BLOCK))


@pytest.mark.parametrize("world", [1, 2], ids=["1 rank", "csbp2"])
def test_imported_logits_per_block_equal_transformers(converted, world):
    theirs = _load(converted / "hf")
    first = _transformers_logits(theirs)
    for name, signal in (("without self-conditioning", None), ("self-conditioned", first)):
        reference = first if signal is None else _transformers_logits(theirs, signal)
        error = _worst(run_ranks(_checkpoint_logits, world, str(converted), signal, timeout=600), reference)
        print(f"world {world}, {name}: worst relative error over blocks {error:.2e}")
        assert error <= TOLERANCE, (name, error)


def test_export_gives_back_every_tensor_and_loads_with_from_pretrained(converted):
    from safetensors import safe_open

    original = safe_open(str(converted / "hf" / "model.safetensors"), "pt")
    exported = safe_open(str(converted / "out" / "model.safetensors"), "pt")
    text = {key for key in original.keys() if not key.startswith(("model.encoder.vision_tower.",
                                                                   "model.encoder.embed_vision."))}
    assert set(exported.keys()) == text
    assert any(key.startswith("model.encoder.language_model.") for key in text)  # the encoder's layer scalars
    for key in sorted(text):
        theirs, ours = original.get_tensor(key), exported.get_tensor(key)
        if key == "model.decoder.embed_tokens.weight":  # one row more: MASK's (the mean row)
            assert ours.shape[0] == IDS + 1 and torch.equal(ours[:IDS], theirs), key
        else:
            assert torch.equal(ours, theirs), key
    with open(converted / "out" / "config.json", encoding="utf-8") as handle:
        config = json.load(handle)
    assert config["architectures"] == ["DiffusionGemmaForBlockDiffusion"] and config["canvas_length"] == gemma.BLOCK
    assert config["bdlm_objective"] == "diffusion-gemma" and config["text_config"]["sliding_window"] == gemma.WINDOW
    reloaded, original_model = _load(converted / "out"), _load(converted / "hf")
    ours, theirs = _transformers_logits(reloaded), _transformers_logits(original_model)
    error = gemma._relative(ours[:, gemma.BLOCK:, :IDS], theirs[:, gemma.BLOCK:])
    print(f"the export's logits against the original's: {error:.2e}")
    assert error <= 1e-6, error


def test_refusals_are_one_line_exit_2(converted, tmp_path):
    result = _convert("export", "--load", str(converted / "ckpt"), "--hf-dir", str(tmp_path / "sdar"),
                      "--format", "sdar")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "convert_hf.py: error: --format sdar: its engine has no DiffusionGemma; export it with --format hf "
        "(DiffusionGemmaForBlockDiffusion)"], result.stderr
    assert not (tmp_path / "sdar").exists()
    model = _make_hf(tmp_path / "scalars")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "scalars" / "model.safetensors"))
    tensors["model.encoder.language_model.layers.1.layer_scalar"] += 1  # the halves disagree
    save_file(tensors, str(tmp_path / "scalars" / "model.safetensors"), metadata={"format": "pt"})
    result = _convert("import", "--hf-dir", str(tmp_path / "scalars"), "--save", str(tmp_path / "scalars_ckpt"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert ("model.encoder.language_model.layers.1.layer_scalar ([1.55" in result.stderr
            and "is not model.decoder.layers.1.layer_scalar ([0.55" in result.stderr), result.stderr
    assert not (tmp_path / "scalars_ckpt").exists()
    del model
    with open(tmp_path / "scalars" / "config.json", encoding="utf-8") as handle:
        config = json.load(handle)
    config["text_config"]["use_bidirectional_attention"] = "all"
    with open(tmp_path / "scalars" / "config.json", "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    result = _convert("import", "--hf-dir", str(tmp_path / "scalars"), "--save", str(tmp_path / "bidirectional"))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "convert_hf.py: error: DiffusionGemmaForBlockDiffusion: use_bidirectional_attention 'all': the encoder "
        "converts as causal (the token-causal clean stream) only"], result.stderr
