"""Gemma 4's MoE block (`--gemma4-moe`, `mcore/gemma4_moe.py`) against transformers' DiffusionGemma text layer.

* Exactness: a tiny random `DiffusionGemmaTextConfig` (4 experts, top 2, fp32) builds transformers'
  `DiffusionGemmaEncoderTextLayer`, its attention replaced by zeros so the layer is the residual plus its feed-forward
  block (dense MLP, router, experts and the five norms, combined by transformers' own code). Every weight, norms and
  scales drawn away from their initial ones, is copied into our megatron-core MoE layer; on random hidden states
  `x + block(x)` equals the layer's output, and the gradients of the input and of every weight, to 1e-5.
* Negative controls, each of which must miss: the per-expert scale ignored, the router's input norm and scale
  ignored, two experts' weights swapped.
* Composition: one training step of a tiny BDLM with the block in every layer on EP2 x CSBP2 equals the one-rank
  run (dense BD3-LM attention, `test_megatron_composition`): loss, grad norm, every gradient and every parameter
  after the step, to 1e-5.
* Refusals: the flags it cannot take, in one line, exit 2, before any work.
"""

import os

import pytest
import torch

import drawn_weights
import megatron_step
import test_megatron_composition as composition
import test_moe
from spawn import on_cpu_backend, run_ranks

pytest.importorskip("transformers")
HIDDEN, DENSE_FFN, EXPERT_FFN, EXPERTS, TOPK = 32, 40, 24, 4, 2
TOLERANCE = 1e-5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _transformers_layer():
    """transformers' DiffusionGemma text layer (tiny, fp32), its weights drawn, its attention adding nothing."""
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as dg
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig

    config = DiffusionGemmaTextConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=DENSE_FFN, moe_intermediate_size=EXPERT_FFN,
        num_experts=EXPERTS, top_k_experts=TOPK, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh")
    layer = dg.DiffusionGemmaEncoderTextLayer(config, 0).float()

    class NoAttention(torch.nn.Module):
        def forward(self, hidden_states, **unused):
            return torch.zeros_like(hidden_states), None

    layer.self_attn = NoAttention()
    return drawn_weights.draw(layer, torch.Generator().manual_seed(3))


def _megatron_config():
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.mcore.gemma4_moe import gelu_tanh

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=DENSE_FFN, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_shared_expert_intermediate_size=DENSE_FFN,
        moe_layer_freq=1, moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", gated_linear_unit=True, activation_func=gelu_tanh,
        add_bias_linear=False, normalization="RMSNorm", layernorm_epsilon=1e-6, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True)
    config.gemma4_moe = True
    return config


def _copy_weights(ours, theirs):
    """Our block's parameter for each of transformers' (name pairs), the tensors copied."""
    pairs = {"router.weight": "router.proj.weight", "router.scale": "router.scale",
             "router.per_expert_scale": "router.per_expert_scale",
             "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm.weight",
             "shared_experts.linear_fc2.weight": "mlp.down_proj.weight",
             "post_dense_layernorm.weight": "post_feedforward_layernorm_1.weight",
             "pre_experts_layernorm.weight": "pre_feedforward_layernorm_2.weight",
             "post_experts_layernorm.weight": "post_feedforward_layernorm_2.weight",
             "post_feedforward_layernorm.weight": "post_feedforward_layernorm.weight"}
    theirs_params = dict(theirs.named_parameters())
    with torch.no_grad():
        for our, their in pairs.items():
            ours.get_parameter(our).copy_(theirs_params[their])
        ours.shared_experts.linear_fc1.weight.copy_(torch.cat([theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight]))
        for e, expert in enumerate(ours.experts.local_experts):
            expert.linear_fc1.weight.copy_(theirs.experts.gate_up_proj[e])  # [gate; up], as megatron-core's GLU
            expert.linear_fc2.weight.copy_(theirs.experts.down_proj[e])
    covered = {*pairs.values(), "mlp.gate_proj.weight", "mlp.up_proj.weight", "experts.gate_up_proj",
               "experts.down_proj"}
    assert set(theirs_params) - covered == {"input_layernorm.weight", "post_attention_layernorm.weight"}  # attention's
    return pairs


def _relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@on_cpu_backend
def _block_against_transformers(rank, world_size):
    """{case: worst relative error of the output, the input's gradient and every weight's} for the block and its
    negative controls, against transformers' layer."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.spec_utils import build_module

    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.gemma4_moe import get_gemma4_block_spec

    parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=1, clean_shards=1)
    try:
        torch.manual_seed(0)
        theirs = _transformers_layer()
        config = _megatron_config()
        spec = get_gemma4_block_spec(config).layer_specs[0]
        assert spec.submodules.pre_mlp_layernorm.__name__ == "IdentityOp"
        generator = torch.Generator().manual_seed(11)
        x = torch.randn(6, 2, HIDDEN, generator=generator)  # [s, b, h], megatron's order
        cotangent = torch.randn(6, 2, HIDDEN, generator=generator)

        def transformers_run():
            inputs = x.transpose(0, 1).clone().requires_grad_()
            out = theirs(inputs, position_embeddings=None, attention_mask=None)
            theirs.zero_grad()
            out.backward(cotangent.transpose(0, 1))
            return out.detach().transpose(0, 1), inputs.grad.transpose(0, 1), dict(theirs.named_parameters())

        reference, reference_grad, their_params = transformers_run()
        errors = {}
        for case in ("block", "control: per-expert scale ignored", "control: router norm and scale ignored",
                     "control: two experts swapped"):
            ours = build_module(spec.submodules.mlp, config=config)
            pairs = _copy_weights(ours, theirs)
            if case == "control: per-expert scale ignored":
                ours.router.per_expert_scale.data.fill_(1.0)
            elif case == "control: router norm and scale ignored":
                ours.router.gating = lambda input, router=ours.router: TopKRouter.gating(router, input)
            elif case == "control: two experts swapped":
                first, second = ours.experts.local_experts[0], ours.experts.local_experts[1]
                for a, b in zip(first.parameters(), second.parameters()):
                    a.data, b.data = b.data.clone(), a.data.clone()
            if case == "block":  # the checkpoint holds every weight (megatron-core's sharded state dict)
                saved = ours.sharded_state_dict(metadata={})
                assert {name for name, _ in ours.named_parameters()} <= set(saved), set(saved)
            inputs = x.clone().requires_grad_()
            block, bias = ours(inputs)
            assert bias is None
            out = inputs + block
            out.backward(cotangent)
            worst = {"output": _relative(out.detach(), reference), "input gradient": _relative(inputs.grad,
                                                                                               reference_grad)}
            errors[case] = worst
            if case != "block":  # a control need only miss the output
                continue
            for our, their in pairs.items():
                worst[our] = _relative(ours.get_parameter(our).grad, their_params[their].grad)
            gate, up = their_params["mlp.gate_proj.weight"].grad, their_params["mlp.up_proj.weight"].grad
            worst["shared_experts.linear_fc1.weight"] = _relative(ours.shared_experts.linear_fc1.weight.grad,
                                                                  torch.cat([gate, up]))
            for e, expert in enumerate(ours.experts.local_experts):
                worst[f"expert {e}"] = max(
                    _relative(expert.linear_fc1.weight.grad, their_params["experts.gate_up_proj"].grad[e]),
                    _relative(expert.linear_fc2.weight.grad, their_params["experts.down_proj"].grad[e]))
        return errors
    finally:
        parallel_state.destroy_model_parallel()


def test_the_block_equals_transformers_and_the_controls_miss():
    errors = run_ranks(_block_against_transformers, 1, timeout=300)[0]
    for case, worst in errors.items():
        name, error = max(worst.items(), key=lambda item: item[1])
        print(f"{case}: worst relative error {error:.2e} ({name}); output {worst['output']:.2e}, input gradient "
              f"{worst['input gradient']:.2e}")
        if case.startswith("control"):
            assert worst["output"] > 1e-3, f"{case} should miss transformers' output ({worst['output']:.2e})"
        else:
            assert error <= TOLERANCE, f"{case}: {name} relative error {error:.2e}"
            assert len(worst) == 2 + 10 + EXPERTS  # output, input grad, 9 copied weights + fc1, every expert


# --- one training step: EP2 x CSBP2 against one rank ------------------------------------------------------------

REFERENCE = test_moe.MoETopology("reference", mode="reference")
EP2_CSBP2 = test_moe.MoETopology("ep2 x csbp2", ep=2, block_parallel=2, clean_shards=2)


def _config(topology):
    """`megatron_step._config` with Gemma 4's block in every layer: top 2 of 4 experts, the dense MLP beside them,
    the load-balancing loss on."""
    from megatron_csbp.mcore.gemma4_moe import gelu_tanh

    config = megatron_step._config(
        topology, num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_layer_freq=1,
        moe_shared_expert_intermediate_size=DENSE_FFN, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type=topology.dispatcher, moe_router_dtype="fp32",
        add_bias_linear=False, gated_linear_unit=True, activation_func=gelu_tanh)
    config.gemma4_moe = True
    return config


def _train_step(topology, weights):
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective

    objective = BDLMObjective(block_size=topology.block, mask_token_id=megatron_step.MASK, seed=99)
    return megatron_step.train_step(
        topology, weights, composition._build_model, lambda layout: BDLMForwardStep(objective, layout),
        lambda dp_rank, dp_size: composition._batches(topology.seq, dp_rank, dp_size), composition.MICRO_BATCH,
        make_config=_config)


def test_one_training_step_on_ep2_x_csbp2_equals_one_rank():
    reference = run_ranks(megatron_step.run_steps, 1, _train_step, [REFERENCE], None, timeout=300)[0][0]
    assert any(name.endswith("router.per_expert_scale") for name in reference["grads"])
    results = run_ranks(megatron_step.run_steps, 2, _train_step, [EP2_CSBP2], reference["initial"], timeout=600)
    per_rank = [results[rank][0] for rank in range(2)]
    error = megatron_step.worst_error(per_rank, reference, scalars=("grad_norm",))
    print(f"{EP2_CSBP2.name}: worst relative error {error:.2e} (loss {per_rank[-1]['loss']}, reference "
          f"{reference['loss']})")
    assert error <= TOLERANCE, f"{EP2_CSBP2.name}: relative error {error:.2e}"


# --- the flag: refusals and where it lands ------------------------------------------------------------------------

TRAINER = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
           "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--bdlm-block-size", "8", "--eval-iters", "0",
           "--training-loop", "megatron-core", "--disable-bias-linear", "--normalization", "RMSNorm",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24"]
GEMMA4 = ["--moe-shared-expert-intermediate-size", "40", "--gemma4-moe"]
REFUSALS = [
    (GEMMA4 + ["--moe-layer-freq", "2"], "--gemma4-moe: every Gemma 4 layer has the MoE block, but --moe-layer-freq "
                                         "makes dense layers; give --moe-layer-freq 1"),
    (GEMMA4 + ["--swiglu"], "--gemma4-moe's MLPs are gated GELU-tanh, not SwiGLU: drop --swiglu"),
    (GEMMA4 + ["--moe-router-pre-softmax"], "--gemma4-moe weighs the top-k experts by a softmax over the top k: give "
                                            "--moe-router-score-function softmax without --moe-router-pre-softmax"),
    (["--gemma4-moe"], "--gemma4-moe needs --moe-shared-expert-intermediate-size: the dense MLP's size beside the "
                       "experts (transformers' intermediate_size)"),
]


def test_the_flag_refuses_in_one_line_exit_2_and_reaches_the_model_config(tmp_path, capsys):
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp.core import rules
    from megatron_csbp.core.run_config import RunConfig
    from megatron_csbp.mcore.gemma4_moe import gelu_tanh
    from megatron_csbp.mcore.model import set_shape_config
    from megatron_csbp.training import pretrain
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.flags import build_parser

    prefix = tmp_path / "corpus"
    for suffix in (".bin", ".idx"):
        (tmp_path / ("corpus" + suffix)).write_bytes(b"")
    for extra, message in REFUSALS:
        assert pretrain.main(TRAINER + ["--data-path", str(prefix)] + extra) == 2, extra
        captured = capsys.readouterr()
        assert captured.err.strip().splitlines() == [f"pretrain_bdlm.py: error: {message}"], extra
    assert rules.gemma4_moe_problem(None, (), 40, False, "softmax", False).startswith(
        "--gemma4-moe builds a mixture of experts: give --num-experts")
    # control: the recipe passes, the block is the shape's, and the model's config gets it with its activation
    args = validate_args(build_parser().parse_args(TRAINER + GEMMA4 + ["--data-path", str(prefix)]), 1,
                         on_accelerator=False)
    shape = RunConfig.from_args(args).shape
    assert shape.moe.gemma4 and shape.swiglu and shape.moe.shared_expert_ffn_hidden_size == 40
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    set_shape_config(config, shape)
    assert config.gemma4_moe and config.gated_linear_unit and config.activation_func is gelu_tanh
