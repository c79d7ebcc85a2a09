"""Hugging Face import and export of sliding-window models (`tools/hf.py`: `hf_windows`, `window_flags`;
`tools/convert_hf.py`: `_window_keys`) against `transformers` itself.

Tiny random models made locally: a Mistral windowed in every layer (`sliding_window` 6), a Qwen2 with
`use_sliding_window` from `max_window_layers` 1 on (window 5, layers 2-3 of 3), a Qwen3 with explicit `layer_types`
(sliding, full, sliding; window 7). transformers' `sliding_window` is the keys a token sees, itself included, so
`--window-size` is `sliding_window - 1, 0` (docs/algorithm.md §3).
* the clean stream (`--bdlm-clean-attention token-causal`, the LM head over the clean rows) equals the HF model run on
  the clean tokens under transformers' own windowed causal mask, <= 1e-5 relative, fp32; the noisy rows equal the HF
  model under the windowed BDLM mask (a custom mask per layer type). Negative controls: the window one position
  longer, or one shorter, misses;
* import -> export is bit-exact, and the exported config.json is read back by transformers with the same window and
  layers;
* configs the mapping cannot express are one line.
"""

import json
import os

import pytest
import torch

from attention_reference import bdlm_mask, windowed_bdlm_mask
from megatron_csbp.tools import convert_hf, tiny_hf_model
from megatron_csbp.tools import hf
from spawn import on_cpu_backend, run_ranks

pytest.importorskip("transformers")

SEQ, BLOCK, BATCH = 32, 4, 2
TOLERANCE = 1e-5
IDS = 300  # tokenizer ids; MASK is the new id 300
MODELS = {
    "mistral": dict(family="mistral", windows=dict(sliding_window=6)),
    "qwen2": dict(family="qwen2", num_layers=3, windows=dict(use_sliding_window=True, sliding_window=5,
                                                            max_window_layers=1)),
    "qwen3": dict(family="qwen3", num_layers=3, windows=dict(use_sliding_window=True, sliding_window=7,
                                                            layer_types=["sliding_attention", "full_attention",
                                                                         "sliding_attention"])),
}
PATTERNS = {"mistral": [1, 1], "qwen2": [0, 1, 1], "qwen3": [1, 0, 1]}
WINDOWS = {"mistral": 6, "qwen2": 5, "qwen3": 7}
SHIFTS = (0, 1, -1)  # the imported window, and one position longer / shorter (the negative controls)


def _make_and_import(rank, world, root):
    for name, settings in MODELS.items():
        hf_dir = tiny_hf_model.make_model(**settings, tokenizer_ids=IDS, output=os.path.join(root, name, "hf"))
        convert_hf.import_checkpoint(hf_dir, os.path.join(root, name, "ckpt"), make_vocab_size_divisible_by=64,
                                     log=lambda *_: None)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf_windows"))
    run_ranks(_make_and_import, 1, root, timeout=600)
    return root


def _inputs():
    generator = torch.Generator().manual_seed(5)
    x0 = torch.randint(0, IDS, (BATCH, SEQ), generator=generator)
    masked = torch.rand(BATCH, SEQ, generator=generator) < 0.5
    return x0, torch.where(masked, IDS, x0)


@on_cpu_backend
def _our_logits(rank, world, root):
    """Our import's logits on every row `[b, 2L, V]` (noisy rows, then clean rows, in position order), with token-causal
    clean rows and the LM head over them, at the imported window and one position longer / shorter."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.training import checkpointing, providers
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.config import parse_args
    from megatron_csbp.training.megatron_config import transformer_config_from_args

    results = {}
    for name in MODELS:
        for shift in SHIFTS:
            args = validate_args(parse_args(
                ["--config", os.path.join(root, name, "ckpt", "model.yaml"), f"seq-length={SEQ}",
                 f"bdlm-block-size={BLOCK}", f"micro-batch-size={BATCH}", "train-iters=1", "lr=0",
                 "data-path=unused", "bdlm-clean-attention=token-causal", "bdlm-ar-loss-weight=1"]), 1,
                check_paths=False)
            assert args.window_size == (WINDOWS[name] - 1, 0), args.window_size
            args.window_size = (args.window_size[0] + shift, 0)
            parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=1, clean_shards=1)
            try:
                model_parallel_cuda_manual_seed(1234)
                run_providers = providers.RunProviders(args)
                model = run_providers.model_provider(config=transformer_config_from_args(args))
                checkpointing.load_checkpoint(os.path.join(root, name, "ckpt", "iter_0000000"), model, None, None,
                                              run_providers.vocabulary.recorded(args), load_optimizer=False,
                                              load_rng=False, log=lambda *_: None)
                layout = run_providers.run.layout
                x0, x_t = _inputs()
                ids = torch.cat([x_t[:, layout.noisy_positions], x0[:, layout.clean_positions]], dim=1)
                model.eval()
                with torch.no_grad():
                    logits = model(ids, layout.row_positions.expand(BATCH, -1).contiguous(), labels=None)
                rows = torch.cat([torch.as_tensor(layout.noisy_positions),
                                  SEQ + torch.as_tensor(layout.clean_positions)])
                out = torch.empty_like(logits)
                out[:, rows] = logits
                results[name, shift] = out
            finally:
                parallel_state.destroy_model_parallel()
    return results


def _mask_row(table):
    return table[:IDS].double().mean(0).to(table.dtype)  # the documented MASK initialisation


def _hf_clean_logits(hf_dir, x0):
    """transformers' own model on the clean tokens: its windowed causal mask, built by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=x0).logits


def _hf_noisy_logits(hf_dir, x_t, x0, window):
    """The HF model on `[x_t ; x0]` under the BDLM mask, windowed (`window - 1` positions back) in its sliding
    layers: one custom mask per layer type."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    table = model.get_input_embeddings().weight.detach()
    ids = torch.cat([x_t, x0], dim=1)
    embeds = table[ids.clamp(max=table.shape[0] - 1)]
    embeds[ids == IDS] = _mask_row(table)

    def additive(allowed):
        return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).expand(BATCH, 1, -1, -1)

    sliding = additive(windowed_bdlm_mask(SEQ, BLOCK, window - 1, token_causal=True))
    masks = {"full_attention": additive(bdlm_mask(SEQ, BLOCK, True)), "sliding_attention": sliding}
    positions = torch.arange(SEQ).expand(BATCH, -1)
    with torch.no_grad():
        mask = masks if hasattr(model.config, "layer_types") and model.config.layer_types else sliding
        return model(inputs_embeds=embeds, attention_mask=mask,
                     position_ids=torch.cat([positions, positions], dim=1)).logits[:, :SEQ]


def _relative_error(ours, reference):
    keep = torch.ones(reference.shape[-1], dtype=torch.bool)
    if IDS < keep.numel():
        keep[IDS] = False
    ours, reference = ours[..., :reference.shape[-1]][..., keep].double(), reference[..., keep].double()
    return ((ours - reference).norm() / reference.norm()).item()


def test_import_reads_transformers_window_and_layers(converted):
    for name in MODELS:
        config = json.load(open(os.path.join(converted, name, "hf", "config.json")))
        window, pattern = hf.hf_windows(config, name, hf.FAMILIES[hf.model_family(config)])
        assert (window, pattern) == (WINDOWS[name], PATTERNS[name])
        flags = hf.model_flags(config)
        assert flags["window-size"] == [WINDOWS[name] - 1, 0]
        assert flags.get("window-attn-skip-freq", [1] * len(pattern)) == PATTERNS[name]


def test_logits_equal_transformers_under_its_windowed_mask_and_an_off_by_one_window_misses(converted):
    per_rank = run_ranks(_our_logits, 1, converted, timeout=600)
    x0, x_t = _inputs()
    for name in MODELS:
        hf_dir = os.path.join(converted, name, "hf")
        clean = _hf_clean_logits(hf_dir, x0)
        noisy = _hf_noisy_logits(hf_dir, x_t, x0, WINDOWS[name])
        ours = per_rank[0][name, 0]
        clean_error, noisy_error = _relative_error(ours[:, SEQ:], clean), _relative_error(ours[:, :SEQ], noisy)
        print(f"{name}: clean stream vs transformers {clean_error:.2e}, noisy rows {noisy_error:.2e}")
        assert clean_error <= TOLERANCE and noisy_error <= TOLERANCE, (name, clean_error, noisy_error)
        for shift in SHIFTS[1:]:
            wrong = _relative_error(per_rank[0][name, shift][:, SEQ:], clean)
            print(f"{name}: window {shift:+d}: clean stream vs transformers {wrong:.2e}")
            assert wrong > 100 * TOLERANCE, (name, shift, wrong)


def test_round_trip_is_bit_exact_and_transformers_reads_the_same_window(converted, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    for name in MODELS:
        out = str(tmp_path / name)
        run_ranks(_export, 1, os.path.join(converted, name, "ckpt"), out, timeout=600)
        original = AutoConfig.from_pretrained(os.path.join(converted, name, "hf"))
        exported = AutoConfig.from_pretrained(out)
        assert exported.architectures == original.architectures
        assert exported.sliding_window == original.sliding_window == WINDOWS[name]
        assert getattr(exported, "layer_types", None) == getattr(original, "layer_types", None)
        theirs, ours = load_file(os.path.join(converted, name, "hf", "model.safetensors")), _tensors(out)
        for key, tensor in theirs.items():
            if key in ("model.embed_tokens.weight", "lm_head.weight"):
                tensor, mine = tensor[:IDS], ours[key][:IDS]  # the export adds the MASK row
            else:
                mine = ours[key]
            assert torch.equal(mine, tensor), (name, key)


def _export(rank, world, load, out):
    convert_hf.export_checkpoint(load, out, log=lambda *_: None)


def _tensors(directory):
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, file)))
    return tensors


@pytest.mark.parametrize("config, message", [
    (dict(architectures=["LlamaForCausalLM"], sliding_window=8), "cannot be expressed for Llama"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=8,
          layer_types=["sliding_attention", "full_attention"]), "takes no per-layer sliding window"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
          layer_types=["sliding_attention", "full_attention"]), "the config has no window"),
    (dict(architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=4,
          layer_types=["sliding_attention"]), "layer_types names 1 layers, num_hidden_layers is 2"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=0), "at least the token itself"),
])
def test_windows_the_mapping_cannot_express_are_one_line(config, message):
    with pytest.raises(hf.UnsupportedModel, match=message) as error:
        hf.model_family({"num_hidden_layers": 2, **config})
    assert "\n" not in str(error.value)


def test_a_window_default_is_transformers():
    """A Mistral config without `sliding_window` has transformers' 4096; a Qwen2's switch is off unless given."""
    assert hf.hf_windows({"num_hidden_layers": 2}, "m", hf.MISTRAL) == (4096, [1, 1])
    assert hf.hf_windows({"num_hidden_layers": 2, "sliding_window": 8}, "q", hf.QWEN2) == (None, [0, 0])
    assert hf.hf_windows({"num_hidden_layers": 30, "use_sliding_window": True}, "q", hf.QWEN2) == (
        4096, [0] * 28 + [1, 1])


def test_export_writes_the_windows_the_family_holds_and_refuses_the_others():
    """A Llama-shaped model windowed in every layer is a Mistral; a per-layer pattern only a Qwen2 / Qwen3 holds;
    the engines of the other formats attend fully. No window: no keys."""
    from types import SimpleNamespace

    args = SimpleNamespace(window_size=(5, 0), window_attn_skip_freq=None, num_layers=2)
    assert convert_hf._window_keys(args, hf.LLAMA, None, "hf") == ({"sliding_window": 6}, hf.MISTRAL)
    args.window_attn_skip_freq = [0, 1]
    with pytest.raises(hf.UnsupportedModel, match="Mistral windows every layer or none, and this checkpoint keeps "
                                                  r"layers \[0\] global") as error:
        convert_hf._window_keys(args, hf.LLAMA, None, "hf")
    assert "\n" not in str(error.value)
    assert convert_hf._window_keys(args, hf.QWEN3, None, "hf") == (
        {"sliding_window": 6, "use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"],
         "max_window_layers": 1}, hf.QWEN3)
    with pytest.raises(hf.UnsupportedModel, match="--format sdar: its engines run full attention in every layer"):
        convert_hf._window_keys(args, hf.QWEN3, None, "sdar")
    args.window_size = None
    args.window_attn_skip_freq = None
    assert convert_hf._window_keys(args, hf.QWEN3, None, "sdar") == ({}, hf.QWEN3)
