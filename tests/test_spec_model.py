"""The CSBP layer spec, its core attention, the BDLM model pieces and the refusals of `validate_config`."""

import copy

import pytest
import torch

from spawn import on_cpu_backend, run_ranks

SEQ, BLOCK, VOCAB, MASK = 16, 4, 32, 31


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, use_cpu_initialization=True,
                  calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm")
    fields.update(overrides)
    return TransformerConfig(**fields)


def _dense_bdlm_attention(query, key, value, layout, scale):
    """BD3-LM attention of a whole layout's rows, dense, from the mask table of docs/algorithm.md §3."""
    block, clean = layout.row_positions // layout.block_size, layout.row_is_clean
    qb, kb, qc, kc = block[:, None], block[None, :], clean[:, None], clean[None, :]
    allowed = (~qc & ~kc & (kb == qb)) | (~qc & kc & (kb < qb)) | (qc & kc & (kb <= qb))
    group = query.shape[2] // key.shape[2]
    key, value = key.repeat_interleave(group, 2), value.repeat_interleave(group, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", query, key) * scale
    out = torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), value)
    return out.reshape(out.shape[0], out.shape[1], -1)


def test_spec_swaps_only_the_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_csbp.mcore import spec

    built = spec.get_csbp_layer_spec(qk_layernorm=True)
    megatron = get_gpt_layer_local_spec(qk_layernorm=True)
    assert built.submodules.self_attention.submodules.core_attention.module is spec.CSBPCoreAttention
    assert spec.csbp_layer_spec.submodules.self_attention.submodules.core_attention.module is spec.CSBPCoreAttention
    assert built.submodules.self_attention.submodules.linear_qkv is megatron.submodules.self_attention.submodules.linear_qkv
    assert built.submodules.mlp.module is megatron.submodules.mlp.module
    assert built.submodules.input_layernorm is spec.SequenceParallelTorchNorm
    with pytest.raises(ValueError, match="--multi-latent-attention"):
        spec.get_csbp_layer_spec(multi_latent_attention=True)


def test_a_given_layer_spec_is_honoured_with_csbp_core_attention():
    """`--spec MODULE NAME`: the named spec is the start, copied (never changed in place), with CSBP's core
    attention as its leaf; a spec that cannot be imported is refused naming the flag."""
    import argparse

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_csbp.training import providers
    from megatron_csbp.mcore import spec
    from megatron_csbp.core.rules import ConfigError

    given = get_gpt_layer_local_spec(qk_layernorm=True)
    given.submodules.self_attention.submodules.core_attention = DotProductAttention
    built = spec.get_csbp_layer_spec(base_spec=given)
    assert built.submodules.self_attention.submodules.core_attention.module is spec.CSBPCoreAttention
    assert given.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert built.submodules.self_attention.submodules.q_layernorm is not None
    found = providers.layer_spec_from_args(argparse.Namespace(spec=["megatron_csbp.mcore.spec", "csbp_layer_spec"]))
    assert found is spec.csbp_layer_spec
    assert providers.layer_spec_from_args(argparse.Namespace(spec=None)) is None
    with pytest.raises(ConfigError, match="--spec megatron_csbp.mcore.spec no_such_spec: cannot be imported"):
        providers.layer_spec_from_args(argparse.Namespace(spec=["megatron_csbp.mcore.spec", "no_such_spec"]))


def test_forward_step_refuses_the_megatron_arguments_it_cannot_honour():
    from megatron_csbp.training import providers
    from megatron_csbp.core.rules import ConfigError

    run_providers = providers.RunProviders(object())
    with pytest.raises(ConfigError, match="--num-microbatches-with-partial-activation-checkpoints"):
        run_providers.forward_step(iter([]), None, True)
    with pytest.raises(ConfigError, match="schedule plans"):
        run_providers.forward_step(iter([]), None, return_schedule_plan=True)


@pytest.mark.parametrize("field, value, flag", [
    ("calculate_per_token_loss", False, "--calculate-per-token-loss"),
    ("context_parallel_size", 2, "--context-parallel-size"),
    ("hierarchical_context_parallel_sizes", [1, 1], "--hierarchical-context-parallel-sizes"),
    ("cp_comm_type", "a2a", "--cp-comm-type"),
    ("hybrid_context_parallel", True, "--hybrid-context-parallel"),
    ("multi_latent_attention", True, "--multi-latent-attention"),
    ("mtp_num_layers", 1, "--mtp-num-layers"),
    ("attention_dropout", 0.1, "--attention-dropout"),
])
def test_validate_config_refusals_name_the_flag(field, value, flag):
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.mcore.model import validate_config

    config, layout = _config(), CSBPLayout(SEQ, BLOCK, 1, 1)
    validate_config(config, layout, VOCAB, MASK)
    bad = copy.copy(config)
    setattr(bad, field, value)
    with pytest.raises(ValueError, match=flag):
        validate_config(bad, layout, VOCAB, MASK)


def test_validate_config_refuses_a_mask_token_outside_the_vocabulary():
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.mcore.model import validate_config

    with pytest.raises(ValueError, match="--bdlm-mask-token-id=32 .* at least 33"):
        validate_config(_config(), CSBPLayout(SEQ, BLOCK, 1, 1), VOCAB, VOCAB)


def test_layout_refuses_a_sequence_it_cannot_take():
    from megatron_csbp.core.layout import CSBPLayout

    with pytest.raises(ValueError, match="--seq-length 18 is not a multiple of --bdlm-block-size 4"):
        CSBPLayout(18, BLOCK, 1, 1)


@on_cpu_backend
def _single_rank_checks(rank, world_size):
    from megatron.core import parallel_state as mpu
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.mcore.model import model_provider
    from megatron_csbp.mcore.spec import AttentionContext, CSBPCoreAttention

    mpu.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    layout = CSBPLayout(SEQ, BLOCK, 1, 1)  # dual-end order: rows are not in position order
    config = _config()

    # Core attention: GQA un-expanded in, the dense BD3-LM attention out, with Megatron's scale or a given one.
    query = torch.randn(layout.num_rows, 2, 4, 8, dtype=torch.float64)
    key, value = torch.randn(2, layout.num_rows, 2, 2, 8, dtype=torch.float64)
    for scale in (None, 0.3):
        attention = CSBPCoreAttention(config, 1, softmax_scale=scale, context=AttentionContext(layout))
        expected = _dense_bdlm_attention(query, key, value, layout, 8 ** -0.5 if scale is None else scale)
        got = attention(query, key, value, None)
        assert ((got - expected).norm() / expected.norm()) < 1e-10
    padded = [torch.cat([t, torch.randn(2, *t.shape[1:], dtype=t.dtype)]) for t in (query, key, value)]
    got = attention(*padded, None)
    assert got.shape[0] == layout.num_rows + 2 and not got[-2:].any()
    with pytest.raises(ValueError, match="THD packed sequences"):
        attention(query, key, value, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match="--attention-dropout must be 0"):
        CSBPCoreAttention(_config(attention_dropout=0.1), 1)
    with pytest.raises(RuntimeError, match="no attention context"):
        CSBPCoreAttention(config, 1)

    # Model: RoPE at the batch's positions, head over noisy rows only, MASK excluded, CE of the noisy rows.
    from megatron_csbp.mcore import spec as spec_module

    plans, real_plan = [], spec_module.ring_plan  # the op's plan: made once for the model, on first use
    spec_module.ring_plan = lambda *args: plans.append(real_plan(*args)) or plans[-1]
    model = model_provider(config=config, layout=layout, vocab_size=VOCAB, mask_token_id=MASK)
    assert plans == []  # building (or loading) a model makes none
    table = model.rotary_pos_emb.rotary.get_emb(SEQ)
    tokens = torch.randint(0, MASK, (2, layout.num_rows))
    positions = layout.row_positions.expand(2, -1)
    assert torch.equal(model._preprocess(tokens, positions)[1], table[layout.row_positions])
    logits = model(tokens, positions)
    shifted = model(tokens, positions.roll(1, dims=1))  # negative control: RoPE reads the positions given
    assert (shifted - logits)[..., :MASK].abs().max() > 1e-3
    assert logits.shape == (2, layout.num_noisy_rows, VOCAB)
    assert torch.isneginf(logits[..., MASK]).all() and torch.isfinite(logits[..., :MASK]).all()
    labels = tokens[:, :layout.num_noisy_rows]
    per_token = model(tokens, positions, labels=labels)
    expected = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    assert per_token.shape == labels.shape and torch.allclose(per_token, expected, rtol=1e-5, atol=1e-6)
    per_token.sum().backward()
    assert model.output_layer.weight.grad[MASK].abs().max() == 0
    spec_module.ring_plan = real_plan
    assert len(plans) == 1, f"{len(plans)} plans for one layout"  # every layer, call and backward share it
    with pytest.raises(ValueError, match="rows"):
        model(tokens[:, :-1], positions[:, :-1])
    with pytest.raises(ValueError, match="THD packed sequences"):
        model(tokens, positions, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(ValueError, match="--calculate-per-token-loss"):
        model_provider(config=_config(calculate_per_token_loss=False), layout=layout, vocab_size=VOCAB)
    mpu.destroy_model_parallel()


def test_core_attention_and_model_on_one_rank():
    run_ranks(_single_rank_checks, 1, timeout=300)
