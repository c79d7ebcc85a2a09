"""Exact BDLM FLOPs and attention bytes, checked against brute-force counts and torch's FLOP counter."""

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_csbp.bdlm import flops
from megatron_csbp.core import rules
from megatron_csbp.core.model_shape import ModelShape

SHAPES = [(6, 1), (8, 2), (12, 3), (16, 4), (16, 16), (32, 8), (40, 5)]


def dense_bdlm_mask(seq_length, block_size, noisy_sees_own_block_clean=False):
    """The §2 mask over `[x_t ; x_0]`, built pair by pair; the flag breaks it (negative control)."""
    block = np.arange(seq_length) // block_size
    qb, kb = block[:, None], block[None, :]
    noisy_clean = (kb <= qb) if noisy_sees_own_block_clean else (kb < qb)
    top = np.concatenate([kb == qb, noisy_clean], axis=1)
    bottom = np.concatenate([np.zeros_like(top[:, :seq_length]), kb <= qb], axis=1)
    return np.concatenate([top, bottom], axis=0)


@pytest.mark.parametrize("seq_length,block_size", SHAPES)
def test_pairs_equal_brute_force(seq_length, block_size):
    mask = dense_bdlm_mask(seq_length, block_size)
    L = seq_length
    parts = flops.bdlm_attention_pair_parts(seq_length, block_size)
    assert parts == {"noisy_noisy": int(mask[:L, :L].sum()), "noisy_clean": int(mask[:L, L:].sum()),
                     "clean_clean": int(mask[L:, L:].sum())}
    assert flops.bdlm_attention_pairs(seq_length, block_size) == int(mask.sum()) == L * L + L * block_size
    broken = dense_bdlm_mask(seq_length, block_size, noisy_sees_own_block_clean=True)
    assert flops.bdlm_attention_pairs(seq_length, block_size) != int(broken.sum())


def test_bad_block_size_is_named():
    with pytest.raises(ValueError, match="--seq-length 10 is not a multiple of --bdlm-block-size 4"):
        flops.bdlm_attention_pairs(10, 4)


def _counted_linear_and_head_flops(L, batch, layers, h, heads, groups, d, ffn, vocab):
    """torch's FLOP counter over forward+backward of the linear layers (2L rows) and the noisy LM head."""
    torch.manual_seed(0)
    weight = lambda *shape: torch.randn(*shape, requires_grad=True)
    x = torch.randn(batch, 2 * L, h, requires_grad=True)
    params = [(weight(h, (heads + 2 * groups) * d), weight(heads * d, h), weight(h, ffn), weight(h, ffn),
               weight(ffn, h)) for _ in range(layers)]
    head = weight(h, vocab)
    with FlopCounterMode(display=False) as counter:
        for qkv, proj, gate, up, down in params:
            query = (x @ qkv)[..., :heads * d]  # attention itself is counted by pairs, not here
            x = x + query @ proj
            x = x + (torch.nn.functional.silu(x @ gate) * (x @ up)) @ down
        (x[:, :L] @ head).sum().backward()
    return counter.get_total_flops()


def test_step_flops_match_torch_counter_plus_pairs():
    shape = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                       ffn_hidden_size=48, swiglu=True)
    L, B, batch = 16, 4, 3
    counted = _counted_linear_and_head_flops(L, batch, 2, 32, 4, 2, 8, 48, 40)
    attention = batch * 3 * 2 * int(dense_bdlm_mask(L, B).sum()) * 4 * 4 * 8
    total = flops.bdlm_step_flops(shape, padded_vocab_size=40, seq_length=L, block_size=B, batch_size=batch)
    assert total == counted + attention
    assert total != counted + batch * 3 * 2 * (2 * L) ** 2 * 4 * 4 * 8  # a dense 2L grid is not it
    layer_forward = (counted - batch * 3 * 2 * L * 32 * 40) // 3 + attention // 3
    assert flops.bdlm_step_flops(shape, padded_vocab_size=40, seq_length=L, block_size=B, batch_size=batch,
                                 recompute=True) == total + layer_forward


def test_megatron_causal_count_differs_by_attention_and_head():
    shape = ModelShape(num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=16,
                       ffn_hidden_size=96, swiglu=True)
    L, B = 64, 8
    causal = flops.megatron_causal_flops(shape, padded_vocab_size=128, seq_length=L, batch_size=2)
    bdlm = flops.bdlm_step_flops(shape, padded_vocab_size=128, seq_length=L, block_size=B, batch_size=2)
    attention = 2 * 3 * 3 * 4 * 8 * 16 * ((2 * L) ** 2 // 2 - (L * L + L * B))
    head = 2 * 3 * L * 2 * 64 * 128
    assert causal - bdlm == attention + head


def test_defaults_follow_megatron():
    step = dict(padded_vocab_size=128, seq_length=32, block_size=4)
    explicit = ModelShape(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, num_query_groups=4,
                          kv_channels=16)
    defaulted = ModelShape(num_layers=1, hidden_size=64, num_attention_heads=4)
    assert defaulted == explicit  # the defaults are filled once, in the shape
    assert flops.bdlm_step_flops(explicit, **step) == flops.bdlm_step_flops(defaulted, **step)
    assert ModelShape(num_layers=1, hidden_size=96, num_attention_heads=4, swiglu=True).ffn_hidden_size == 256
    assert rules.default_ffn_hidden_size(4096, swiglu=True) == 10880


# Multiples of L(C-1)/C·beta per layer per rank, docs/algorithm.md §9 (second number: full recompute).
TABLE = {("cp", "collective"): (4, 6), ("csbp", "collective"): (2, 3),
         ("cp", "streaming"): (6, 8), ("csbp", "streaming"): (3, 4)}


@pytest.mark.parametrize("seq_length,clean_shards", [(64, 2), (96, 3), (4096, 8), (262144, 16)])
def test_traffic_table(seq_length, clean_shards):
    beta = flops.kv_bytes_per_token(2, 16, 2)
    unit = seq_length * (clean_shards - 1) // clean_shards * beta
    for (mode, transport), multiples in TABLE.items():
        for recompute, multiple in zip((False, True), multiples):
            sent = flops.attention_traffic_bytes(mode, seq_length, clean_shards, 2, 16, 2, transport, recompute)
            assert sent == multiple * unit, (mode, transport, recompute)
        halves = [flops.attention_traffic_bytes(m, seq_length, clean_shards, 2, 16, 2, transport, True)
                  for m in ("csbp", "cp")]
        assert 2 * halves[0] == halves[1]
    assert flops.attention_traffic_bytes("bp", seq_length, 1, 2, 16, 2, recompute=True) == 0


def test_paper_traffic_is_exact():
    """14B, 40 layers, 8 KV heads x 128, bf16, CP8, L = 256K = 262144, full recompute: 210 -> 105 GiB."""
    per_layer = {m: flops.attention_traffic_bytes(m, 262144, 8, 8, 128, 2, recompute=True) for m in ("cp", "csbp")}
    assert 40 * per_layer["cp"] == 210 * 2 ** 30
    assert 40 * per_layer["csbp"] == 105 * 2 ** 30


def test_traffic_bad_input():
    with pytest.raises(ValueError, match="mode"):
        flops.attention_traffic_bytes("ring", 64, 2, 1, 8)
    with pytest.raises(ValueError, match="transport"):
        flops.attention_traffic_bytes("cp", 64, 2, 1, 8, transport="p2p")
    with pytest.raises(ValueError, match="clean_shards"):
        flops.attention_traffic_bytes("csbp", 64, 3, 1, 8)


def test_moe_step_flops_count_the_router_the_topk_experts_and_the_shared_expert():
    """A hand-derived count: 2 layers of which 1 is MoE (4 experts of FFN 24, top-2, shared expert of 16, SwiGLU),
    h = 32, L = 16 (32 rows per sample: noisy and clean rows are all routed), 3 samples, 3 passes per step."""
    sizes = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                 ffn_hidden_size=48, swiglu=True)
    step = dict(padded_vocab_size=40, seq_length=16, block_size=4, batch_size=3)
    moe = flops.MoEShape(num_experts=4, topk=2, ffn_hidden_size=24, num_moe_layers=1, shared_expert_ffn_hidden_size=16)
    dense = flops.bdlm_step_flops(ModelShape(**sizes), **step)
    rows, passes = 3 * 2 * 16, 3
    dense_mlp = 2 * 32 * 48 * 3  # per row: fc1 (2 x 48 wide) and fc2
    moe_mlp = 2 * 32 * 4 + 2 * (2 * 32 * 24 * 3) + 2 * 32 * 16 * 3  # router + 2 experts + shared expert
    assert flops.bdlm_step_flops(ModelShape(**sizes, moe=moe), **step) == dense + passes * rows * (moe_mlp - dense_mlp)
    assert moe_mlp - dense_mlp == 256 + 9216 + 3072 - 9216


def test_the_run_reads_the_experts_off_the_flags():
    """`RunConfig.from_args`: the MoE layers of `--moe-layer-freq`, each expert's FFN size defaulting to the dense
    one (resolved in the shape), no experts without `--num-experts` (0 too, as Megatron-LM reads it)."""
    from megatron_csbp.core.run_config import RunConfig
    from megatron_csbp.training.flags import build_parser

    def shape(*extra):
        args = build_parser().parse_args(["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
                                          "--ffn-hidden-size", "48", "--seq-length", "64", "--micro-batch-size", "1",
                                          *extra])
        return RunConfig.from_args(args).shape

    experts = ("--num-experts", "4", "--moe-router-topk", "2")
    assert shape(*experts, "--moe-layer-freq", "2").moe == flops.MoEShape(4, 2, 48, 2, 0)  # layers 0 and 2
    assert shape(*experts, "--moe-layer-freq", "[0,1,1]").moe.num_moe_layers == 2
    assert shape().moe is None and shape("--num-experts", "0").moe is None


def test_moe_parameter_count_holds_the_router_every_expert_and_the_shared_expert():
    """Hand count: the dense MLP (h 32, ffn 48, SwiGLU, no biases) of 1 of 2 layers replaced by a router (32 x 4),
    4 experts of FFN 24 and a shared expert of FFN 16."""
    sizes = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, swiglu=True,
                 add_bias_linear=False)
    moe = flops.MoEShape(num_experts=4, topk=2, ffn_hidden_size=24, num_moe_layers=1, shared_expert_ffn_hidden_size=16)
    dense_mlp, expert, shared = 3 * 32 * 48, 3 * 32 * 24, 3 * 32 * 16
    assert flops.parameter_count(ModelShape(**sizes, moe=moe), 40) == flops.parameter_count(ModelShape(**sizes), 40) \
        + 32 * 4 + 4 * expert + shared - dense_mlp


def test_gemma4_global_layers_count_their_own_head_size_k_v_heads_and_no_value_projection():
    """Gemma 4's attention (`shape.gemma4_attention`): a global layer (the window pattern leaves it global) takes its
    own head size (32 here) and K/V heads (1), its key projection doubling as the value; a sliding layer the model's
    (16, 2, key and value). Counted by hand for hidden 64, 4 heads, FFN 128 (GELU: 2 matrices), RMSNorm, no biases."""
    from megatron_csbp.core.model_shape import Gemma4AttentionShape
    from megatron_csbp.core.windows import GLOBAL, Sliding

    sizes = dict(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                 ffn_hidden_size=128, add_bias_linear=False, layernorm_bias=False)
    shape = ModelShape(**sizes, gemma4_attention=Gemma4AttentionShape(32, 1))
    plain = ModelShape(**sizes)
    mlp = 2 * 64 * 128 * 2
    sliding_row = 2 * (64 * (4 * 16 + 2 * 2 * 16) + 4 * 16 * 64) + mlp  # Q, K, V of 16; the projection
    global_row = 2 * (64 * (4 * 32 + 1 * 32) + 4 * 32 * 64) + mlp  # Q and K (= V) of 32; the projection
    assert (flops.linear_flops_per_row(shape, Sliding(8)), flops.linear_flops_per_row(shape, GLOBAL)) == \
        (sliding_row, global_row) == (57344, 69632)
    assert flops.linear_flops_per_row(plain, GLOBAL) == sliding_row  # Megatron's attention: one shape
    sliding_params = (4 + 2 * 2) * 16 * 64 + 4 * 16 * 64 + 2 * 64 * 128 + 2 * 64
    global_params = (4 + 1) * 32 * 64 + 4 * 32 * 64 + 2 * 64 * 128 + 2 * 64
    assert (flops.layer_parameter_count(shape, Sliding(8)), flops.layer_parameter_count(shape)) == \
        (sliding_params, global_params) == (28800, 34944)
    windows = (Sliding(8), Sliding(8), GLOBAL)
    assert flops.parameter_count(shape, 40, windows) == 2 * sliding_params + global_params + 64 + 40 * 64
    assert flops.parameter_count(plain, 40, windows) == 3 * sliding_params + 64 + 40 * 64
    L, B, V = 64, 16, 40
    pairs = {window: flops.bdlm_attention_pairs(L, B, window=window) for window in (Sliding(8), GLOBAL)}
    assert pairs[Sliding(8)] < pairs[GLOBAL]
    forward = (2 * (2 * L * sliding_row + pairs[Sliding(8)] * 4 * 4 * 16)
               + 2 * L * global_row + pairs[GLOBAL] * 4 * 4 * 32)  # 4 FLOPs per pair per head and dim
    expected = 3 * (forward + L * 2 * 64 * V)
    assert flops.bdlm_step_flops(shape, padded_vocab_size=V, seq_length=L, block_size=B, layer_windows=windows) \
        == expected
    assert flops.bdlm_step_flops(plain, padded_vocab_size=V, seq_length=L, block_size=B, layer_windows=windows) \
        < expected  # the global layer at the sliding shape: a miss
