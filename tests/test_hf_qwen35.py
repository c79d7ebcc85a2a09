"""Hugging Face import and export of Qwen3.5 (`Qwen3_5ForCausalLM`, a Gated DeltaNet hybrid: `tools/hf.py`'s
`GatedDeltaHybrid`) against `transformers` itself, on a tiny random model made locally: 4 layers, full attention every
2nd (Gated DeltaNet, full, Gated DeltaNet, full), 2 key heads serving 4 value heads, partial rotary 0.25, `1 + w`
norms, its decays set so that a state lives a few tokens (transformers' init forgets a token at once in most heads).

* the clean stream (`--bdlm-clean-attention token-causal`, the LM head over the clean rows) equals
  `Qwen3_5ForCausalLM` run on the clean tokens, <= 1e-5 relative, fp32;
* the noisy rows equal a reference made of transformers' own model run once per block on `[clean prefix ; noisy
  block]`: its convolution and delta rule run the noisy block from the clean state at its start, its full-attention
  layers under the BDLM mask restricted to those rows (docs/algorithm.md, "Gated DeltaNet layers"). Negative control:
  our noisy blocks started from a zero state miss;
* import -> export is bit-exact (every tensor, every key of config.json but the vocabulary's MASK row), and the
  export loads in `Qwen3_5ForCausalLM` with the original's logits;
* `--format fast-dllm-v2` and `--format sdar` are refused in one line, exit 2, nothing written: neither engine has an
  architecture for Qwen3.5 (`hf_formats`);
* configs the mapping cannot express are one line.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from attention_reference import bdlm_mask
from megatron_csbp.tools import convert_hf, hf, tiny_hf_model
from spawn import on_cpu_backend, run_ranks

pytest.importorskip("transformers")

SEQ, BLOCK, BATCH = 32, 4, 2
TOLERANCE = 1e-5
IDS = 300  # tokenizer ids; MASK is the new id 300
PATTERN = [1, 0, 1, 0]  # Gated DeltaNet (1) and full-attention (0) layers of the tiny model
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make_and_import(rank, world, root):
    from safetensors.torch import load_file, save_file

    hf_dir = tiny_hf_model.make_model(hf.QWEN3_5.name, os.path.join(root, "hf"), num_layers=4, tokenizer_ids=IDS)
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    for key in tensors:  # decays of 0.1 to 0.7 per token, so that the state entering a block matters
        if key.endswith("A_log"):
            tensors[key] = torch.linspace(-2.0, -0.5, tensors[key].numel())
    save_file(tensors, path, metadata={"format": "pt"})
    convert_hf.import_checkpoint(hf_dir, os.path.join(root, "ckpt"), make_vocab_size_divisible_by=64,
                                 log=lambda *_: None)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf_qwen35"))
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
    clean rows and the LM head over them; and with every noisy block started from a zero state (the control)."""
    import dataclasses

    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.gated_delta_net import BDLMGatedDeltaNet
    from megatron_csbp.training import checkpointing, providers
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.config import parse_args

    args = validate_args(parse_args(
        ["--config", os.path.join(root, "ckpt", "model.yaml"), f"seq-length={SEQ}", f"bdlm-block-size={BLOCK}",
         f"micro-batch-size={BATCH}", "train-iters=1", "lr=0", "data-path=unused", "bdlm-clean-attention=token-causal",
         "bdlm-ar-loss-weight=1"]), 1, check_paths=False)
    results = {}
    parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=1, clean_shards=1)
    try:
        model_parallel_cuda_manual_seed(1234)
        run_providers = providers.RunProviders(args)
        model = run_providers.model_provider()  # the run's config: the hybrid's fields set (`set_shape_config`)
        checkpointing.load_checkpoint(os.path.join(root, "ckpt", "iter_0000000"), model, None, None,
                                      run_providers.vocabulary.recorded(args), load_optimizer=False, load_rng=False,
                                      log=lambda *_: None)
        layers = [module for module in model.modules() if isinstance(module, BDLMGatedDeltaNet)]
        assert len(layers) == sum(PATTERN), len(layers)
        layout = run_providers.run.layout
        x0, x_t = _inputs()
        ids = torch.cat([x_t[:, layout.noisy_positions], x0[:, layout.clean_positions]], dim=1)
        rows = torch.cat([torch.as_tensor(layout.noisy_positions), SEQ + torch.as_tensor(layout.clean_positions)])
        model.eval()
        for control in (False, True):
            for layer in layers:
                if control:
                    layer.plan = dataclasses.replace(layer.plan, noisy_states=(0,) * len(layer.plan.noisy_states))
            with torch.no_grad():
                logits = model(ids, layout.row_positions.expand(BATCH, -1).contiguous(), labels=None)
            out = torch.empty_like(logits)
            out[:, rows] = logits
            results[control] = out
    finally:
        parallel_state.destroy_model_parallel()
    return results


def _hf_model(hf_dir):
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert [int(kind == "linear_attention") for kind in model.config.layer_types] == PATTERN
    return model


def _hf_noisy_logits(model, x_t, x0):
    """transformers' model once per block `b` on `[x0[:bB] ; x_t[bB:(b+1)B]]`: its Gated DeltaNet layers (convolution
    and delta rule) run the noisy block on from the clean prefix's state, its full-attention layers under the BDLM
    mask's rows and columns of those tokens (the prefix token-causal, the block bidirectional over itself and the
    prefix). The noisy block's rows are its logits."""
    table = model.get_input_embeddings().weight.detach()
    mask = bdlm_mask(SEQ, BLOCK, token_causal=True)
    out = []
    for start in range(0, SEQ, BLOCK):
        rows = torch.cat([SEQ + torch.arange(start), torch.arange(start, start + BLOCK)])
        ids = torch.cat([x0[:, :start], x_t[:, start:start + BLOCK]], dim=1)
        embeds = table[ids.clamp(max=table.shape[0] - 1)]
        embeds[ids == IDS] = table[:IDS].double().mean(0).to(table.dtype)  # the documented MASK initialisation
        allowed = mask[rows][:, rows]
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).expand(BATCH, 1, -1, -1)
        with torch.no_grad():
            logits = model(inputs_embeds=embeds, position_ids=torch.arange(start + BLOCK).expand(BATCH, -1),
                           attention_mask={"full_attention": additive, "linear_attention": None}).logits
        out.append(logits[:, start:])
    return torch.cat(out, dim=1)


def _errors(ours, reference):
    """(relative Frobenius error, worst absolute error) of `ours` over the HF vocabulary's columns."""
    ours, reference = ours[..., :reference.shape[-1]].double(), reference.double()
    return ((ours - reference).norm() / reference.norm()).item(), (ours - reference).abs().max().item()


def test_import_reads_the_layers_and_flags(converted):
    config = json.load(open(os.path.join(converted, "hf", "config.json")))
    flags = hf.model_flags(config)
    assert hf.model_family(config) == hf.QWEN3_5.name
    assert (flags["experimental-attention-variant"], flags["linear-attention-freq"], flags["linear-num-key-heads"],
            flags["linear-num-value-heads"], flags["linear-key-head-dim"], flags["linear-value-head-dim"],
            flags["linear-conv-kernel-dim"], flags["rotary-percent"]) == ("gated_delta_net", 2, 2, 4, 8, 6, 4, 0.25)
    assert flags["attention-output-gate"] and flags["apply-layernorm-1p"] and flags["qk-layernorm"]
    irregular = {**config, "layer_types": ["linear_attention", "full_attention", "full_attention", "linear_attention"]}
    assert hf.model_flags(irregular)["linear-attention-freq"] == [1, 0, 0, 1]  # no N says it: the pattern itself
    default = {key: value for key, value in config.items() if key != "layer_types"}  # transformers' interval 4
    assert hf.model_flags(default)["linear-attention-freq"] == 4


def test_logits_equal_transformers_causally_and_per_block_and_a_zero_state_misses(converted):
    per_rank = run_ranks(_our_logits, 1, converted, timeout=600)
    model = _hf_model(os.path.join(converted, "hf"))
    x0, x_t = _inputs()
    with torch.no_grad():
        clean = model(input_ids=x0).logits
    noisy = _hf_noisy_logits(model, x_t, x0)
    ours, control = per_rank[0][False], per_rank[0][True]
    (clean_rel, clean_abs), (noisy_rel, noisy_abs) = _errors(ours[:, SEQ:], clean), _errors(ours[:, :SEQ], noisy)
    print(f"clean stream vs Qwen3_5ForCausalLM: {clean_rel:.2e} relative, {clean_abs:.2e} worst; noisy rows vs the "
          f"per-block reference: {noisy_rel:.2e} relative, {noisy_abs:.2e} worst")
    assert clean_rel <= TOLERANCE and noisy_rel <= TOLERANCE, (clean_rel, noisy_rel)
    wrong, _ = _errors(control[:, :SEQ], noisy)
    first, _ = _errors(control[:, :BLOCK], noisy[:, :BLOCK])
    print(f"control, noisy blocks from a zero state: {wrong:.2e} relative (block 0, whose state is zero: {first:.2e})")
    assert wrong > 100 * TOLERANCE, wrong
    assert first <= TOLERANCE, first  # the control changes only what it claims to


def _export(rank, world, load, out):
    convert_hf.export_checkpoint(load, out, log=lambda *_: None)


def test_round_trip_is_bit_exact_and_transformers_loads_it_with_the_same_logits(converted, tmp_path):
    from safetensors.torch import load_file

    out = str(tmp_path / "export")
    run_ranks(_export, 1, os.path.join(converted, "ckpt"), out, timeout=600)
    original = json.load(open(os.path.join(converted, "hf", "config.json")))
    exported = json.load(open(os.path.join(out, "config.json")))
    assert exported["vocab_size"] == IDS + 1  # the new MASK row
    assert {key: value for key, value in exported.items() if key in original and key != "vocab_size"} == \
        {key: value for key, value in original.items() if key != "vocab_size"}
    assert (exported["mask_token_id"], exported["bdlm_block_size"]) == (IDS, 16)
    theirs, ours = load_file(os.path.join(converted, "hf", "model.safetensors")), load_file(
        os.path.join(out, "model.safetensors"))
    assert set(theirs) == set(ours)
    for key, tensor in theirs.items():
        mine = ours[key][:IDS] if key in ("model.embed_tokens.weight", "lm_head.weight") else ours[key]
        assert torch.equal(mine, tensor), key
    x0, _ = _inputs()
    with torch.no_grad():
        before = _hf_model(os.path.join(converted, "hf"))(input_ids=x0).logits
        after = _hf_model(out)(input_ids=x0).logits
    relative, worst = _errors(after, before)
    print(f"exported Qwen3_5ForCausalLM vs the original: {relative:.2e} relative, {worst:.2e} worst")
    assert relative <= TOLERANCE, relative


@pytest.mark.parametrize("export_format, engine", [("fast-dllm-v2", "Fast-dLLM v2's model code"),
                                                   ("sdar", "SGLang and lmdeploy")])
def test_formats_without_a_qwen35_architecture_refuse_in_one_line(converted, tmp_path, export_format, engine):
    out = tmp_path / "export"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "convert_hf.py"), "export", "--load",
                           os.path.join(converted, "ckpt"), "--hf-dir", str(out), "--format", export_format],
                          capture_output=True, text=True, timeout=600)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines[-1].startswith(f"convert_hf.py: error: --format {export_format}: {engine} has no architecture for "
                                f"Qwen3.5 (Gated DeltaNet hybrid) models"), lines[-1]
    assert "export it with --format hf" in lines[-1]
    assert not out.exists() and os.listdir(tmp_path) == []


BASE = dict(architectures=["Qwen3_5ForCausalLM"], num_hidden_layers=4, hidden_size=64, intermediate_size=96,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("config, message", [
    (dict(architectures=["Qwen3_5ForConditionalGeneration"]), "its vision model does not convert"),
    (dict(architectures=["Qwen3_5MoeForCausalLM"]), "experts beside Gated DeltaNet layers are not supported"),
    (dict(layer_types=["linear_attention", "sliding_attention"] * 2), "only linear- and full-attention layers"),
    (dict(layer_types=["linear_attention", "full_attention"]), "layer_types names 2 layers, num_hidden_layers is 4"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=4), "not a multiple of linear_num_key_heads 3"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=10000.0)), "plain RoPE"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.1)),
     "turns 1 of head_dim 16 channels"),
    (dict(architectures=["Qwen3ForCausalLM"], layer_types=["linear_attention", "full_attention"] * 2),
     "linear-attention layers convert in Qwen3.5"),
    (dict(architectures=["Qwen3ForCausalLM"], rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=0.5)),
     "partial rotary embeddings do not convert"),
])
def test_configs_the_mapping_cannot_express_are_one_line(config, message):
    with pytest.raises(hf.UnsupportedModel, match=message) as error:
        hf.model_flags({**BASE, **config})
    assert "\n" not in str(error.value)


def test_export_refuses_a_checkpoint_only_part_qwen35_in_one_line():
    """Gated DeltaNet layers, the attention output gate, the `1 + w` norms and QK-norm come together in Qwen3.5, the
    one family with any of them; beside experts or windows it has no form either."""
    import argparse

    recorded = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=False,
                    experimental_attention_variant="gated_delta_net", attention_output_gate=True,
                    apply_layernorm_1p=False, qk_layernorm=True)
    with pytest.raises(hf.UnsupportedModel) as refused:
        convert_hf.export_config(argparse.Namespace(**recorded), None, 64, torch.float32)
    assert str(refused.value) == (
        "this checkpoint has --experimental-attention-variant gated_delta_net, --attention-output-gate, "
        "--qk-layernorm without --apply-layernorm-1p: Qwen3.5 (Qwen3_5ForCausalLM), the one Hugging Face family "
        "with Gated DeltaNet layers, an attention output gate or 1 + w norms, has all four; it has no Hugging Face "
        "form")
    recorded.update(apply_layernorm_1p=True, num_experts=4)
    with pytest.raises(hf.UnsupportedModel, match=r"^--num-experts: Qwen3.5 \(Qwen3_5ForCausalLM\) has none"):
        convert_hf.export_config(argparse.Namespace(**recorded), None, 64, torch.float32)
