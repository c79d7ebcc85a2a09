"""The token-causal clean stream (`--bdlm-clean-attention token-causal`, Nemotron-Labs-Diffusion's): a clean row
sees the clean tokens up to its own position, not its whole block.

The op in every mode (CSBP, the field's CP, cp-traffic, BP) and both transports, with and without packed
documents, equals dense fp64 attention under that mask, forward and backward, on 1, 2 and 4 ranks; the
block-causal mask must miss it (negative control). What the kernels compute is counted off their plans, and the
modes' analytic counts (`ParallelMode.kernel_calls`, the planner's) and the FLOP count agree with a pair-by-pair
count of the mask."""

from dataclasses import dataclass

import pytest
import torch

from attention_reference import bdlm_mask, global_rows
from op_cases import OpCase, compare, run_cases, run_single
from spawn import run_ranks

TOLERANCE = 1e-5
TILE = 8
TOKEN_CAUSAL = {"clean_attention": "token-causal"}


@dataclass(frozen=True)
class Case(OpCase):
    """An op case with token-causal clean rows (`options`), of a packed sample where `starts` has several
    documents."""

    starts: tuple = (0,)


def reference_mask(case, token_causal=True):
    """The dense mask of the case: token-causal clean rows (or block-causal, the control), cut to documents."""
    from megatron_csbp.core.documents import Documents

    mask = bdlm_mask(case.seq_length, case.block_size, token_causal=token_causal)
    ids = Documents(case.seq_length, case.starts).ids().repeat(2)
    return mask & (ids.view(-1, 1) == ids.view(1, -1))


def _attend(case, layout, group, query, key, value):
    from megatron_csbp.core import ops
    from megatron_csbp.core.documents import Documents

    documents = Documents(case.seq_length, case.starts)
    return ops.context_sharded_block_attention(query, key, value, layout, group, transport=case.transport,
                                               documents=None if documents.is_single else documents)


def _kernels():
    from megatron_csbp.core.kernels import CPUKernels

    return CPUKernels(tile=TILE, masked_tile=TILE)


UNALIGNED = (0, 5, 19, 20, 47)  # documents with boundaries inside blocks, a one-token document
CASES = {
    1: [Case(f"one_rank_{mode}_{transport}", mode, 32, 8, 1, transport, options=TOKEN_CAUSAL)
        for mode in ("csbp", "cp") for transport in ("collective", "streaming")]
       + [Case("one_rank_packed", "csbp", 64, 8, 1, options=TOKEN_CAUSAL, starts=UNALIGNED)],
    2: [Case(f"{mode}_{transport}", mode, 64, 8, 2 if mode != "bp" else 1, transport, options=TOKEN_CAUSAL)
        for mode in ("csbp", "cp", "cp-traffic", "bp") for transport in ("collective", "streaming")]
       + [Case(f"{mode}_packed_{transport}", mode, 64, 8, 2 if mode != "bp" else 1, transport, options=TOKEN_CAUSAL,
               starts=UNALIGNED) for mode in ("csbp", "cp", "bp") for transport in ("collective", "streaming")],
    4: [Case(f"csbp_p4_c{c}_{transport}", "csbp", 64, 4, c, transport, options=TOKEN_CAUSAL)
        for c in (2, 4) for transport in ("collective", "streaming")]
       + [Case("cp_p4", "cp", 64, 4, 4, options=TOKEN_CAUSAL), Case("bp_p4", "bp", 64, 4, 1, options=TOKEN_CAUSAL),
          Case("csbp_p4_c2_packed", "csbp", 64, 4, 2, "streaming", options=TOKEN_CAUSAL, starts=(0, 8, 21, 40))],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def topology(request):
    cases = CASES[request.param]
    if request.param == 1:
        return cases, [run_single(cases, _kernels(), _attend)]
    return cases, run_ranks(run_cases, request.param, cases, _kernels(), _attend, timeout=600)


def test_token_causal_attention_matches_the_dense_mask_and_the_block_causal_one_misses(topology):
    cases, per_rank = topology
    worst = {}
    for case in cases:
        errors = compare(case, per_rank, reference_mask(case))
        worst[case.name] = max(errors.values())
        missed = compare(case, per_rank, reference_mask(case, token_causal=False))
        assert max(missed.values()) > 1e-2, f"{case.name}: the block-causal mask matches too ({missed})"
    print({name: f"{error:.1e}" for name, error in worst.items()})
    assert max(worst.values()) <= TOLERANCE, worst


def _counted_off_the_mask(layout, mask, tile):
    """(kind, real, computed) of each kernel call of the rank, pair by pair off the dense `[2L, 2L]` mask: the
    block-diagonal call's whole blocks; the prefix call's key tiles up to each row's last visible key; a masked
    call's (query tile, key tile) pairs with a visible pair."""
    L = layout.seq_length
    seen = mask[global_rows(layout)]
    if layout.masked_attention:
        rows = seen.shape[0]
        computed = sum(seen[q:q + tile, k:k + tile].numel() for q in range(0, rows, tile) for k in range(0, 2 * L, tile)
                       if seen[q:q + tile, k:k + tile].any())
        return [("masked", int(seen.sum()), computed)]
    calls = [("dense", int(seen[:layout.num_noisy_rows, :L].sum()), layout.num_noisy_rows * layout.block_size)]
    clean, computed = seen[:, L:], 0
    for row in clean:
        visible = torch.nonzero(row).flatten()
        if visible.numel():
            computed += min((int(visible[-1]) // tile + 1) * tile, L)
    return calls + [("prefix", int(clean.sum()), computed)]


@pytest.mark.parametrize("tile", [8, 24])
def test_kernel_calls_and_flops_count_the_causal_clean_rows(tile):
    """The plans' counted calls equal a pair-by-pair count of the token-causal mask on every mode and rank, and so
    do the modes' analytic calls (the planner's) and the FLOP count's pairs; block-causal figures differ
    (control). The CPU prefix plan computes no key tile above a clean row's diagonal."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core import modes, ops
    from megatron_csbp.core.clean_attention import BLOCK_CAUSAL, TOKEN_CAUSAL as RULE
    from megatron_csbp.core.kernels import CPUKernels
    from megatron_csbp.core.layout import layout_for

    L, B = 64, 8
    mask = bdlm_mask(L, B, token_causal=True)
    assert flops.bdlm_attention_pairs(L, B, RULE) == int(mask.sum()) != flops.bdlm_attention_pairs(L, B, BLOCK_CAUSAL)
    checked = 0
    for mode, P, C in [("csbp", 1, 1), ("csbp", 2, 2), ("csbp", 4, 4), ("csbp", 4, 2), ("bp", 2, 1), ("cp", 2, 2),
                       ("cp", 4, 4), ("cp-traffic", 2, 2)]:
        for rank in range(P):
            layout = layout_for(mode, L, B, P, C, rank, clean_attention=RULE)
            plan = ops.ring_plan(layout, "cpu", CPUKernels(tile=tile, masked_tile=tile))
            counted = [(c.kind, c.real_pairs, c.computed_pairs) for c in plan.kernel_calls()]
            assert counted == _counted_off_the_mask(layout, mask, tile), (mode, P, C, rank)
            analytic = modes.parallel_mode(mode).kernel_calls(L, B, P, layout.clean_shards, rank, tile, RULE)
            assert [(c.kind, c.real_pairs, c.computed_pairs) for c in analytic] == counted, (mode, P, C, rank)
            block_causal = modes.parallel_mode(mode).kernel_calls(L, B, P, layout.clean_shards, rank, tile)
            assert block_causal != analytic, (mode, P, C, rank)
            checked += 1
    assert checked == 21


def test_the_planner_counts_the_causal_clean_rows():
    """One rank holding a whole sample: the planner's FLOPs per rank equal the trainer's count of a token-causal
    model's step (fewer clean pairs than block-causal's: the control)."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core.clean_attention import BLOCK_CAUSAL, TOKEN_CAUSAL as RULE
    from megatron_csbp.tools import plan

    model = plan.Model(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, block_size=16,
                       vocab_size=254, clean_attention=RULE.name)
    cluster = plan.Cluster(1, 8, plan.GPU_PRESETS["h200"])
    predicted = plan.predict(model, cluster, plan.Topology("csbp", 1, 1, 1, 1, 1)).flops_per_rank
    step = dict(padded_vocab_size=256, seq_length=64, block_size=16)
    assert predicted == flops.bdlm_step_flops(model.shape, clean_attention=RULE, **step)
    assert predicted < flops.bdlm_step_flops(model.shape, clean_attention=BLOCK_CAUSAL, **step)


TRAINING = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--data-path", "unused/prefix",
            "--bdlm-block-size", "8"]


@pytest.mark.parametrize("extra, line", [
    (["--bdlm-ar-loss-weight", "1"],
     "--bdlm-ar-loss-weight 1.0 needs --bdlm-clean-attention token-causal: with block-causal clean attention a clean "
     "row sees the tokens after its own in its block, so its next-token loss would read the answer"),
    (["--bdlm-ar-loss-weight", "1", "--bdlm-clean-attention", "token-causal", "--bdlm-objective", "fast-dllm-v2"],
     "--bdlm-ar-loss-weight 1.0 does not go with --bdlm-objective fast-dllm-v2: its rows predict the next token "
     "already and its complementary views would carry the clean stream twice; drop --bdlm-ar-loss-weight or use "
     "--bdlm-objective bd3lm"),
    (["--bdlm-ar-loss-weight", "-1", "--bdlm-clean-attention", "token-causal"],
     "--bdlm-ar-loss-weight -1.0 must be >= 0 (0: that part is off)"),
    (["--bdlm-diffusion-loss-weight", "nan"], "--bdlm-diffusion-loss-weight nan must be >= 0 (0: that part is off)"),
    (["--bdlm-diffusion-loss-weight", "0"],
     "--bdlm-diffusion-loss-weight and --bdlm-ar-loss-weight are both 0: nothing would be trained; give one a "
     "weight > 0"),
])
def test_the_loss_parts_refuse_what_cannot_train_in_one_line(extra, line):
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.training.arguments import validate
    from megatron_csbp.training.flags import build_parser

    with pytest.raises(ConfigError) as refused:
        validate(build_parser().parse_args(TRAINING + extra), 1, on_accelerator=False, check_paths=False)
    assert str(refused.value) == line


def test_the_recipes_flags_make_the_run():
    """Nemotron-Labs-Diffusion's flags: a token-causal run whose model runs its head over the clean rows too."""
    from megatron_csbp.core.clean_attention import TOKEN_CAUSAL as RULE
    from megatron_csbp.training.arguments import validate
    from megatron_csbp.training.flags import build_parser

    settings = validate(build_parser().parse_args(TRAINING + [
        "--bdlm-clean-attention", "token-causal", "--bdlm-ar-loss-weight", "1", "--bdlm-diffusion-loss-weight",
        "0.3"]), 1, on_accelerator=False, check_paths=False)
    assert settings.clean_attention is RULE and settings.clean_logits and settings.layout(0).clean_attention is RULE
    assert (settings.diffusion_loss_weight, settings.ar_loss_weight) == (0.3, 1.0)


def test_the_ar_heads_flops_are_counted_by_the_trainer_and_the_planner():
    """With the AR co-loss the LM head runs over the clean rows too: twice the head's FLOPs, in the trainer's
    count and in the planner's (one rank holding a whole sample)."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core.clean_attention import TOKEN_CAUSAL as RULE
    from megatron_csbp.tools import plan

    model = plan.Model(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, block_size=16,
                       vocab_size=254, clean_attention=RULE.name, clean_logits=True)
    step = dict(padded_vocab_size=256, seq_length=64, block_size=16, clean_attention=RULE)
    with_head = flops.bdlm_step_flops(model.shape, clean_logits=True, **step)
    assert with_head - flops.bdlm_step_flops(model.shape, **step) == 3 * 64 * flops.lm_head_flops_per_row(64, 256)
    cluster = plan.Cluster(1, 8, plan.GPU_PRESETS["h200"])
    assert plan.predict(model, cluster, plan.Topology("csbp", 1, 1, 1, 1, 1)).flops_per_rank == with_head
