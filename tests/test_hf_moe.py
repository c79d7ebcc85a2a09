"""Hugging Face import and export of a mixture of experts (Qwen3-MoE, `Qwen3MoeForCausalLM`) against `transformers`.

Two tiny random Qwen3-MoE models are made locally (tools/tiny_hf_model.py) and imported:
* `qwen3_moe`: 3 layers (layer 1 dense, by `mlp_only_layers`), 4 experts, top 2, `norm_topk_prob` true (megatron-core's
  default routing: a softmax over the top-k logits), saved per expert (the hub's layout);
* `qwen3_moe_pre_softmax`: 2 layers, 8 experts, top 2, `norm_topk_prob` false (`--moe-router-pre-softmax`: a softmax
  over every expert, then the top k), saved fused, as transformers 5 holds experts in memory.
The reference is transformers' model on the same `[x_t ; x_0]` rows under the BDLM attention mask (test_hf's).
* logits on the noisy rows: converted model == HF model, <= 1e-5 relative, on 1 rank and on EP2 x CSBP2 (the experts
  resharded from the import); negative controls (two experts swapped, gate and up swapped, the routing's
  normalisation flipped) miss by far;
* import -> export gives every HF tensor back bit for bit (in the hub's per-expert layout; MASK rows as documented),
  from the import and from a checkpoint our training loop saved at EP2 x CSBP2; the export loads with transformers
  and gives the very logits of the original;
* the sparse layers and the expert count in either spelling map both ways (a unit test);
* what does not map (Qwen2-MoE's gated shared expert, other MoE architectures, a sigmoid router or a shared expert
  on export) is one line, exit 2.
"""

import argparse
import json
import os
import shutil

import pytest
import torch

import test_hf
from megatron_csbp.tools import convert_hf, tiny_hf_model
from spawn import on_cpu_backend, run_ranks

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SEQ, BLOCK, BATCH, TOLERANCE, DIVISIBLE_BY = test_hf.SEQ, test_hf.BLOCK, test_hf.BATCH, 1e-5, test_hf.DIVISIBLE_BY
MODELS = {"qwen3_moe": dict(family="qwen3_moe", tokenizer_ids=300, model_rows=384, num_layers=3, mlp_only_layers=(1,),
                            num_experts=4),
          "qwen3_moe_pre_softmax": dict(family="qwen3_moe", tokenizer_ids=300, model_rows=384, num_experts=8,
                                        norm_topk_prob=False, fused_experts=True)}
CONTROLS = ("experts swapped", "gate and up swapped", "routing normalisation flipped")
LAYOUTS = {"1 rank": dict(cp=1, ep=1), "ep2 x csbp2": dict(cp=2, ep=2)}


def _make_and_import(rank, world, root):
    """On one spawned rank: the tiny HF models and their imports (`root/<name>/{hf,ckpt}`)."""
    for name, settings in MODELS.items():
        hf_dir = tiny_hf_model.make_model(**settings, output=os.path.join(root, name, "hf"))
        convert_hf.import_checkpoint(hf_dir, os.path.join(root, name, "ckpt"),
                                     make_vocab_size_divisible_by=DIVISIBLE_BY, log=lambda *_: None)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf_moe"))
    run_ranks(_make_and_import, 1, root, timeout=600)
    return root


def _mask_id(name):
    return MODELS[name]["tokenizer_ids"]  # a new MASK right after the tokenizer's ids (an unused row of the model's)


def _apply_control(model, control):
    """Breaks the loaded model's first MoE layer as `control` says."""
    layers = [layer for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    if control == "experts swapped":  # global experts 0 and 1 (on this rank, whichever it holds: every EP rank
        experts = layers[0].mlp.experts.local_experts  # swaps its own first two, so no layout keeps the original)
        for name in ("linear_fc1", "linear_fc2"):
            first, second = getattr(experts[0], name).weight, getattr(experts[1], name).weight
            saved = first.data.clone()
            first.data.copy_(second.data)
            second.data.copy_(saved)
    elif control == "gate and up swapped":
        for expert in layers[0].mlp.experts.local_experts:
            gate, up = expert.linear_fc1.weight.data.chunk(2)
            expert.linear_fc1.weight.data.copy_(torch.cat([up, gate]))


@on_cpu_backend
def _our_logits(rank, world, root, names, cp, ep, controls):
    """On each rank: our converted model's logits on its noisy rows, per model and control."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.training import checkpointing, providers
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.config import parse_args
    from megatron_csbp.training.megatron_config import transformer_config_from_args

    results = {}
    for name in names:
        for control in ("none", *controls):
            args = validate_args(parse_args(
                ["--config", os.path.join(root, name, "ckpt", "model.yaml"), f"seq-length={SEQ}",
                 f"bdlm-block-size={BLOCK}", f"micro-batch-size={BATCH}", "train-iters=1", "lr=0", "data-path=unused",
                 f"context-block-parallel={cp}", f"expert-model-parallel-size={ep}",
                 "moe-token-dispatcher-type=alltoall"]), world, check_paths=False)
            parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=cp, clean_shards=cp,
                                                     expert_model_parallel_size=ep)
            try:
                model_parallel_cuda_manual_seed(1234)
                config = transformer_config_from_args(args)
                if control == "routing normalisation flipped":  # norm_topk_prob read the other way round
                    config.moe_router_pre_softmax = not config.moe_router_pre_softmax
                run_providers = providers.RunProviders(args)
                model = run_providers.model_provider(config=config)
                checkpointing.load_checkpoint(os.path.join(root, name, "ckpt", "iter_0000000"), model, None, None,
                                              run_providers.vocabulary.recorded(args), load_optimizer=False,
                                              load_rng=False, log=lambda *_: None)
                _apply_control(model, control)
                layout = run_providers.run.layout
                x0, x_t = test_hf._inputs(run_providers.vocabulary.mask_token_id, MODELS[name]["tokenizer_ids"])
                input_ids = torch.cat([x_t[:, layout.noisy_positions], x0[:, layout.clean_positions]], dim=1)
                positions = layout.row_positions.expand(BATCH, -1).contiguous()
                model.eval()
                with torch.no_grad():
                    logits = model(input_ids, positions, labels=None)
                results[name, control] = (layout.noisy_positions, logits)
            finally:
                parallel_state.destroy_model_parallel()
    return results


def _reference(hf_dir, name):
    mask_id = _mask_id(name)
    x0, x_t = test_hf._inputs(mask_id, MODELS[name]["tokenizer_ids"])
    return test_hf.hf_reference(hf_dir, x_t, x0, mask_id, MODELS[name]["tokenizer_ids"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_equal_huggingface(converted, layout):
    """Our import's logits equal transformers' (1 rank; EP2 x CSBP2, the experts resharded), both routings; the
    controls miss. (The `--moe-router-pre-softmax` flag's test: Qwen3-MoE's `norm_topk_prob` false.)"""
    controls = list(CONTROLS) if layout == "1 rank" else []
    sizes = LAYOUTS[layout]
    world = sizes["cp"]
    per_rank = run_ranks(_our_logits, world, converted, list(MODELS), sizes["cp"], sizes["ep"], controls,
                         timeout=600)
    for name in MODELS:
        reference = _reference(os.path.join(converted, name, "hf"), name)
        error = test_hf._relative_error(test_hf._assemble(per_rank, name, "none"), reference, _mask_id(name))
        print(f"{name} {layout}: relative error {error:.2e}")
        assert error <= TOLERANCE, (name, layout, error)
        for control in controls:
            wrong = test_hf._relative_error(test_hf._assemble(per_rank, name, control), reference, _mask_id(name))
            print(f"{name} control '{control}': relative error {wrong:.2e}")
            assert wrong > 100 * TOLERANCE, (name, control, wrong)


def test_import_writes_the_moe_flags(converted):
    """The fragment training reads names the same model: experts, top k, expert FFN, sparse layers, routing."""
    import yaml

    fragments = {name: yaml.safe_load(open(os.path.join(converted, name, "ckpt", "model.yaml"))) for name in MODELS}
    keys = ("num-experts", "moe-router-topk", "moe-ffn-hidden-size", "moe-layer-freq", "moe-router-pre-softmax",
            "moe-router-load-balancing-type", "moe-aux-loss-coeff", "ffn-hidden-size", "qk-layernorm")
    assert {key: fragments["qwen3_moe"][key] for key in keys} == {
        "num-experts": 4, "moe-router-topk": 2, "moe-ffn-hidden-size": 32, "moe-layer-freq": [1, 0, 1],
        "moe-router-pre-softmax": False, "moe-router-load-balancing-type": "aux_loss", "moe-aux-loss-coeff": 0.01,
        "ffn-hidden-size": 96, "qk-layernorm": True}
    assert {key: fragments["qwen3_moe_pre_softmax"][key] for key in keys[:5]} == {
        "num-experts": 8, "moe-router-topk": 2, "moe-ffn-hidden-size": 32, "moe-layer-freq": 1,
        "moe-router-pre-softmax": True}


def _expected_export(name, original):
    """The original weights in the hub's per-expert layout, with the MASK rows as documented (the unused row MASK
    takes holds the mean of the original ids' rows)."""
    from megatron_csbp.training import hf

    expected = {}
    for key, tensor in original.items():
        parts = hf.unfused_names(key, list(tensor.shape))
        if parts:  # a fused expert tensor: its experts' hub tensors, sliced here
            expected.update({part: tensor[expert, start:stop] for part, (expert, start, stop, _) in parts.items()})
        else:
            expected[key] = tensor
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        table = expected[key].clone()
        table[_mask_id(name)] = test_hf._mask_embedding(table, MODELS[name]["tokenizer_ids"])
        expected[key] = table
    return expected


def _check_export(out, name, converted):
    """Bit-exact weights, the hub's per-expert layout, and transformers' logits of the export = the original's."""
    from transformers import AutoConfig

    original = test_hf._safetensors(os.path.join(converted, name, "hf"))
    exported = test_hf._safetensors(out)
    assert not any(key.endswith(("gate_up_proj", "experts.down_proj")) for key in exported), "the hub's layout"
    test_hf._assert_bit_exact(exported, _expected_export(name, original))
    config = AutoConfig.from_pretrained(out, local_files_only=True)
    assert config.architectures == ["Qwen3MoeForCausalLM"] and config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == \
        (MODELS[name]["num_experts"], 2, MODELS[name].get("norm_topk_prob", True))
    keep = torch.arange(MODELS[name]["model_rows"]) != _mask_id(name)
    ours, theirs = _reference(out, name)[..., keep], _reference(os.path.join(converted, name, "hf"), name)[..., keep]
    error = ((ours - theirs).norm() / theirs.norm()).item()
    print(f"{name}: transformers' logits of the export vs the original: relative error {error:.2e}")
    assert error <= 1e-7, error


def test_import_export_round_trip_is_bit_exact(converted, tmp_path):
    run_ranks(test_hf._run_conversions, 1, [("export_checkpoint", dict(load=os.path.join(converted, name, "ckpt"),
                                                                        out=str(tmp_path / name))) for name in MODELS],
              timeout=600)
    for name in MODELS:
        stored = test_hf._safetensors(os.path.join(converted, name, "hf"))  # the layout the import read
        fused = any(key.endswith("mlp.experts.gate_up_proj") for key in stored)
        assert fused == MODELS[name].get("fused_experts", False) != any(".experts.0.gate_proj." in key for key in stored)
        _check_export(str(tmp_path / name), name, converted)


@pytest.fixture(scope="module")
def moe_data(converted):
    return test_hf.training_data(converted, "qwen3_moe", _mask_id("qwen3_moe"))


def test_round_trip_from_an_ep2_csbp2_training_checkpoint(converted, moe_data, tmp_path):
    """Our loop loads the import at EP2 x CSBP2 and saves after one step at lr 0 (Adam moves nothing): exporting
    that checkpoint (each rank saved half the experts) gives the very same HF weights."""
    save = str(tmp_path / "ep2")
    output = test_hf._pretrain(2, test_hf.finetune_config(converted, "qwen3_moe", tmp_path), f"data-path={moe_data}",
                               f"seq-length={SEQ}", f"bdlm-block-size={BLOCK}", "context-block-parallel=2",
                               "expert-model-parallel-size=2", "moe-token-dispatcher-type=alltoall", "train-iters=1",
                               "lr=0", "min-lr=0", "lr-warmup-iters=0", "eval-iters=0", f"save={save}",
                               "save-interval=1", "micro-batch-size=1", "global-batch-size=1")
    assert "load_balancing_loss" in output, output[-3000:]
    out = str(tmp_path / "exported")
    code, text = test_hf._convert("export", "--load", save, "--hf-dir", out)
    assert code == 0, text
    _check_export(out, "qwen3_moe", converted)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"},
     "Qwen2MoeForCausalLM is a mixture-of-experts model that does not convert: its shared expert's sigmoid gate"),
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
     "MixtralForCausalLM is a mixture-of-experts model the mapping does not know"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds num_experts 4"),
    ({"mlp_only_layers": [0, 1, 2]}, "no layer is sparse"),
])
def test_import_refuses_what_the_mapping_cannot_express(converted, tmp_path, capsys, change, message):
    hf_dir = str(tmp_path / "model")
    shutil.copytree(os.path.join(converted, "qwen3_moe", "hf"), hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    config.update(change)
    json.dump(config, open(os.path.join(hf_dir, "config.json"), "w"))
    code = convert_hf.main(["import", "--hf-dir", hf_dir, "--save", str(tmp_path / "ckpt")])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1 and error.startswith("convert_hf.py: error: "), error
    assert message in error, error
    assert not os.path.exists(tmp_path / "ckpt")


def test_export_refuses_what_qwen3_moe_cannot_hold(converted):
    """A checkpoint's MoE that Qwen3-MoE has no form for: one line naming the flag, before any tensor is read."""
    from megatron.core import dist_checkpointing

    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.training import checkpointing, hf

    directory = os.path.join(converted, "qwen3_moe", "ckpt", "iter_0000000")
    saved = checkpointing.saved_args(dist_checkpointing.load_common_state_dict(directory))
    config = convert_hf.export_config(argparse.Namespace(**saved), None, 384, torch.float32)
    assert (config["architectures"], config["mlp_only_layers"], config["decoder_sparse_step"]) == \
        (["Qwen3MoeForCausalLM"], [1], 1)
    for change, message in [({"moe_router_score_function": "sigmoid"}, "--moe-router-score-function sigmoid"),
                            ({"moe_shared_expert_intermediate_size": 32}, "Qwen3-MoE has no shared expert"),
                            ({"qk_layernorm": False}, "with --num-experts and without --llama-4-scaling-beta has no Hugging Face family"),
                            ({"add_qkv_bias": True}, "with --num-experts and without --llama-4-scaling-beta has no Hugging Face family")]:
        with pytest.raises(hf.UnsupportedModel) as raised:
            convert_hf.export_config(argparse.Namespace(**{**saved, **change}), None, 384, torch.float32)
        assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
    with pytest.raises(ConfigError, match="--format sdar: SDARForCausalLM"):
        convert_hf.export_config(argparse.Namespace(**saved), None, 384, torch.float32, "sdar")


def test_sparse_layers_and_the_expert_count_in_either_spelling():
    """transformers' sparse layers (`decoder_sparse_step`, `mlp_only_layers`) as `--moe-layer-freq`, and the expert
    count under the hub's `num_experts` or transformers 5's `num_local_experts`, both ways."""
    from megatron_csbp.core import rules
    from megatron_csbp.training import hf

    experts = hf.QWEN3_MOE.experts
    config = {"num_hidden_layers": 6, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
              "norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert experts.layer_pattern(config) == [0, 1, 0, 0, 0, 1]  # layers 1, 3, 5 by the step; 3 kept dense
    flags = experts.flags(config)
    assert (flags["num-experts"], flags["moe-layer-freq"], flags["moe-router-pre-softmax"]) == (8, [0, 1, 0, 0, 0, 1],
                                                                                              False)
    local = {**{key: value for key, value in config.items() if key != "num_experts"}, "num_local_experts": 8}
    assert experts.flags(local) == flags and experts.problem("Qwen3MoeForCausalLM", local) is None
    assert rules.moe_layer_pattern(flags["moe-layer-freq"], 6) == experts.layer_pattern(config)
    args = argparse.Namespace(num_layers=6, num_experts=8, moe_layer_freq=flags["moe-layer-freq"], moe_router_topk=2,
                              moe_ffn_hidden_size=16, ffn_hidden_size=64, moe_router_pre_softmax=False,
                              moe_aux_loss_coeff=[0.01], moe_router_load_balancing_type=["aux_loss"])
    assert experts.config(args, config) == {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                            "norm_topk_prob": True, "router_aux_loss_coef": 0.01}  # base's words kept
    assert experts.config(args, local)["num_local_experts"] == 8
    assert experts.config(args)["mlp_only_layers"] == [0, 2, 3, 4] and "num_experts" in experts.config(args)
    assert "needs a softmax before the top 1" in experts.problem("Qwen3MoeForCausalLM",
                                                                 {**config, "num_experts_per_tok": 1})
