"""Training a Gated DeltaNet hybrid (three Gated DeltaNet layers, then one full-attention layer with an output gate
and partial rotary; `1 + w` norms, as Qwen3.5): one Megatron training step under CSBP2 (both transports), the
field's CP2, BP2, TP2xCSBP2+SP and PP2xCSBP2 (1F1B) equals one rank: the loss, every gradient and every updated
parameter, <= 1e-5 relative (fp32), under BD3-LM and Fast-dLLM v2. One rank's layer is exact against
transformers' recurrence (tests/test_gated_delta.py). Controls, which must miss: each noisy block started from a
zero state, and the clean state entering each chunk taken from the wrong chunk.
"""

import dataclasses

import pytest
import torch

from megatron_step import MASK, VOCAB, Topology, _config, micro_batches, run_steps, train_step, worst_error
from spawn import run_ranks

MICRO_BATCH, NUM_MICRO = 2, 2
TOLERANCE = 1e-5
ZERO_STATE, WRONG_CHUNK = "control: noisy blocks from a zero state", "control: the state of the wrong chunk"


@dataclasses.dataclass(frozen=True)
class Run:
    topology: Topology
    objective: str = "bd3lm"


def _shape():
    from megatron_csbp.core.model_shape import LinearAttentionShape, ModelShape

    linear = LinearAttentionShape.from_flags("gated_delta_net", 4, 4, conv_kernel_dim=4, key_head_dim=8,
                                             value_head_dim=6, num_key_heads=2, num_value_heads=4)
    return ModelShape(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                      swiglu=True, add_bias_linear=False, layernorm_bias=False, linear=linear,
                      attention_output_gate=True, layernorm_1p=True)


def _hybrid_config(topology):
    import torch.nn.functional as F

    from megatron_csbp.mcore.model import set_shape_config

    config = _config(topology, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    set_shape_config(config, _shape())
    return config


def _control_plan(plan, control):
    if control == ZERO_STATE:
        return dataclasses.replace(plan, noisy_states=(0,) * len(plan.noisy_states))
    return dataclasses.replace(plan, mine=tuple(reversed(plan.mine)) if len(plan.mine) > 1 else
                               ((plan.mine[0] + 1) % (plan.members * plan.chunks_per_member),))


def _build_model(topology, config):
    from megatron.core import parallel_state as mpu

    from megatron_csbp.core.layout import layout_for
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.gated_delta_net import BDLMGatedDeltaNet
    from megatron_csbp.mcore.model import model_provider

    mode = "csbp" if topology.mode == "reference" else topology.mode
    layout = layout_for(mode, topology.seq, topology.block, topology.block_parallel, topology.clean_shards,
                        rank=mpu.get_context_parallel_rank())
    model = model_provider(config=config, layout=layout, group=parallel_state.get_block_parallel_groups(),
                           transport=topology.transport, pre_process=mpu.is_pipeline_first_stage(),
                           post_process=mpu.is_pipeline_last_stage(), vocab_size=VOCAB, mask_token_id=MASK,
                           share_embeddings_and_output_weights=True, rotary_percent=0.5)
    layers = [module for module in model.modules() if isinstance(module, BDLMGatedDeltaNet)]
    assert layers, "no Gated DeltaNet layer was built"
    for layer in layers:  # decays of 0.1 to 0.7 per token (megatron-core's init A in [1, 16] forgets each token
        layer.A_log.data.copy_(torch.linspace(-2.0, -0.5, layer.A_log.numel()))  # at once, and A's grad is noise)
    if topology.name.startswith("control"):
        for layer in layers:
            layer.plan = _control_plan(layer.plan, topology.name)
    return model, layout


def _batches(dp_rank, dp_size):
    return micro_batches(dp_rank, dp_size, micro_batch=MICRO_BATCH, num_micro=NUM_MICRO, seed=2025)


def _train_step(run, weights):
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective

    objective = BDLMObjective(block_size=run.topology.block, mask_token_id=MASK, seed=99, objective=run.objective)
    return train_step(run.topology, weights, _build_model, lambda layout: BDLMForwardStep(objective, layout),
                      _batches, MICRO_BATCH * (2 if run.objective == "fast-dllm-v2" else 1),
                      make_config=_hybrid_config)


REFERENCE = Topology("reference", mode="reference")
WORLD_2 = [Topology("csbp P=C=2", block_parallel=2, clean_shards=2),
           Topology("csbp P=C=2 streaming", block_parallel=2, clean_shards=2, transport="streaming"),
           Topology("cp baseline 2", mode="cp", block_parallel=2, clean_shards=2),
           Topology("bp baseline 2", mode="bp", block_parallel=2, clean_shards=1),
           Topology(ZERO_STATE, block_parallel=2, clean_shards=2),
           Topology(WRONG_CHUNK, block_parallel=2, clean_shards=2)]
WORLD_4 = [Topology("tp2 x csbp2 + sp", tp=2, block_parallel=2, clean_shards=2, sequence_parallel=True),
           Topology("pp2 x csbp2 (1f1b)", pp=2, block_parallel=2, clean_shards=2)]
OBJECTIVES = ("bd3lm", "fast-dllm-v2")


@pytest.fixture(scope="module")
def references():
    """One rank's step under each objective, from the same initial weights."""
    return run_ranks(run_steps, 1, _train_step, [Run(REFERENCE, objective) for objective in OBJECTIVES], None,
                     timeout=600)[0]


def _check_world(world_size, topologies, references, timeout):
    runs = [Run(topology, objective) for objective in OBJECTIVES for topology in topologies]
    results = run_ranks(run_steps, world_size, _train_step, runs, references[0]["initial"], timeout=timeout)
    failures = []
    for index, run in enumerate(runs):
        reference = references[OBJECTIVES.index(run.objective)]
        error = worst_error([results[rank][index] for rank in range(world_size)], reference)
        print(f"{run.objective}, {run.topology.name}: worst relative error {error:.2e}")
        if run.topology.name.startswith("control"):
            if error <= 1e-3:
                failures.append(f"{run.objective}, {run.topology.name} should miss ({error:.2e})")
        elif error > TOLERANCE:
            failures.append(f"{run.objective}, {run.topology.name}: relative error {error:.2e}")
    assert not failures, failures


def test_one_rank_objectives_differ(references):
    """The two objectives' steps are not the same step (the comparisons below test each)."""
    assert abs(references[0]["loss"] - references[1]["loss"]) > 1e-3 * abs(references[0]["loss"])


def test_world_2_gated_delta_step_equals_one_rank(references):
    _check_world(2, WORLD_2, references, timeout=900)


def test_world_4_gated_delta_step_equals_one_rank(references):
    _check_world(4, WORLD_4, references, timeout=900)


def test_the_flags_reach_the_run_and_the_models_config():
    """Megatron's flags, parsed by our loop, are read once into the `RunConfig` (the shape this file trains), and
    `set_shape_config` puts them on megatron-core's config as its hybrid spec reads them; the pattern is
    megatron-core's (`get_linear_attention_pattern`)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern

    from megatron_csbp.core.run_config import RunConfig
    from megatron_csbp.mcore.model import set_shape_config
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.flags import build_parser

    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--ffn-hidden-size", "64", "--swiglu", "--disable-bias-linear",
            "--normalization", "RMSNorm", "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "1",
            "--lr", "1e-3", "--data-path", "unused/prefix", "--bdlm-block-size", "4",
            "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4",
            "--linear-conv-kernel-dim", "4", "--linear-key-head-dim", "8", "--linear-value-head-dim", "6",
            "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--attention-output-gate",
            "--apply-layernorm-1p"]
    args = validate_args(build_parser().parse_args(argv), 1, on_accelerator=False, check_paths=False)
    shape = RunConfig.from_args(args).shape
    assert shape == _shape() and shape.linear.pattern == (1, 1, 1, 0)
    config = _config(Topology("flags", block_parallel=2))
    set_shape_config(config, shape)
    assert get_linear_attention_pattern(config) == [1, 1, 1, 0]
    assert (config.experimental_attention_variant, config.linear_conv_kernel_dim, config.linear_key_head_dim,
            config.linear_value_head_dim, config.linear_num_key_heads, config.linear_num_value_heads,
            config.attention_output_gate, config.layernorm_zero_centered_gamma) == (
        "gated_delta_net", 4, 8, 6, 2, 4, True, True)
    plain = RunConfig.from_args(validate_args(build_parser().parse_args(argv[:-16]), 1, on_accelerator=False,
                                              check_paths=False)).shape
    set_shape_config(config, plain)  # control: without the flags, no hybrid
    assert plain.linear is None and config.experimental_attention_variant is None
    assert not config.attention_output_gate and not config.layernorm_zero_centered_gamma


def test_heads_tp_cannot_split_are_refused_in_one_line():
    from megatron_csbp.core.model_shape import LinearAttentionShape
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.core.run_config import RunConfig

    shape = dataclasses.replace(_shape(), linear=LinearAttentionShape((1, 1, 1, 0), 4, 8, 6, 1, 2))
    with pytest.raises(ConfigError) as refused:
        RunConfig(shape=shape, seq_length=32, block_size=4, tensor_parallel_size=2)
    assert str(refused.value) == ("--tensor-model-parallel-size 2 does not divide --linear-num-key-heads 1: each TP "
                                  "rank holds whole Gated DeltaNet heads; use a TP size dividing 1")
    RunConfig(shape=shape, seq_length=32, block_size=4)  # control: one TP rank takes it


def test_the_hf_export_refuses_a_hybrid_qwen35_cannot_hold_in_one_line():
    """This file's hybrid has no QK-norm, which Qwen3.5, the one HF family with Gated DeltaNet layers, has: no HF
    form (tests/test_hf_qwen35.py exports an imported Qwen3.5)."""
    import argparse

    from megatron_csbp.tools.convert_hf import export_config
    from megatron_csbp.tools.hf import UnsupportedModel

    recorded = argparse.Namespace(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                                  experimental_attention_variant="gated_delta_net", attention_output_gate=True,
                                  apply_layernorm_1p=True, qk_layernorm=False)
    with pytest.raises(UnsupportedModel) as refused:
        export_config(recorded, None, 64, torch.float32)
    assert str(refused.value) == ("this checkpoint has --experimental-attention-variant gated_delta_net, "
                                  "--attention-output-gate, --apply-layernorm-1p without --qk-layernorm: Qwen3.5 "
                                  "(Qwen3_5ForCausalLM), the one Hugging Face family with Gated DeltaNet layers, an "
                                  "attention output gate or 1 + w norms, has all four; it has no Hugging Face form")


def test_the_counted_parameters_are_the_built_models(references):
    """`flops.parameter_count` (the checkpoint-size estimate's and, layer by layer, the planner's count: Gated
    DeltaNet layers by `flops.gated_delta_layer_parameter_count`, the gated attention's QKV with its gate rows)
    equals the parameters megatron-core builds for the hybrid (tied embeddings of VOCAB rows)."""
    from megatron_csbp.bdlm import flops

    built = sum(weight.size for weight in references[0]["initial"].values())
    assert built == flops.parameter_count(_shape(), VOCAB)
    ungated = dataclasses.replace(_shape(), attention_output_gate=False)  # control: the gate's rows are counted
    assert built != flops.parameter_count(ungated, VOCAB)
