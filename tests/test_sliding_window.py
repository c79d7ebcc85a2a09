"""Sliding-window attention (`--window-size LEFT,0`, `core.windows`) in the op, and its windowed clean exchange.

* The op in every mode (CSBP, the field's CP, cp-traffic, BP), both transports, 1, 2 and 4 ranks, C = 2 and 4,
  block-causal and token-causal clean rows, with and without packed documents, with windows shorter than a block,
  one short of it, equal to it, and spanning several blocks and chunk boundaries, equals dense fp64 attention under
  the windowed mask (`attention_reference.windowed_bdlm_mask`, written from the definition), forward and backward;
  a window one position longer or shorter misses (negative control).
* A sliding layer under CSBP sends exactly the rows another rank's rows see (counted off the dense mask), and with
  `P = C`, aligned blocks and a window within a chunk exactly `2·LEFT·β` (streaming `3·LEFT·β`) per neighbour
  chunk; bytes fall as the window shrinks. The field's CP and cp-traffic keep the full all-gather.
* What the kernels compute is counted off the plans, and equals the modes' analytic counts and a count off the mask.
* The per-layer pattern is megatron-core's (`is_layer_window_attention`); what the kernels cannot do is refused.
"""

from dataclasses import dataclass

import pytest
import torch

from attention_reference import global_rows, windowed_bdlm_mask
from op_cases import OpCase, compare, run_cases, run_single
from spawn import run_ranks

TOLERANCE = 1e-5
MISS = 1e-3  # a window off by one position moves outputs by far more than this
TILE = 8
UNALIGNED = (0, 5, 19, 20, 47)  # documents with boundaries inside blocks, a one-token document


@dataclass(frozen=True)
class Case(OpCase):
    """An op case in a layer of window `left` (None: global), with token-causal clean rows where asked, of a packed
    sample where `starts` has several documents."""

    left: int | None = 3
    token_causal: bool = False
    starts: tuple = (0,)

    def layout(self, world_size, rank):
        from megatron_csbp.core.layout import layout_for
        from megatron_csbp.core.windows import GLOBAL, Sliding

        return layout_for(self.mode, self.seq_length, self.block_size, world_size, self.clean_shards, rank,
                          clean_attention="token-causal" if self.token_causal else "block-causal",
                          window=GLOBAL if self.left is None else Sliding(self.left), **self.options)

    def mask(self, left=None):
        """The dense mask of the case (window `left`, default its own), cut to its documents."""
        from megatron_csbp.core.documents import Documents

        left = self.left if left is None else left
        mask = windowed_bdlm_mask(self.seq_length, self.block_size, self.seq_length if left is None else left,
                                  self.token_causal)
        ids = Documents(self.seq_length, self.starts).ids().repeat(2)
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


def _csbp(world, C, lefts, transports=("collective", "streaming"), L=64, B=8, **more):
    suffix = "".join(f"_{key}" for key, value in more.items() if value not in ((0,), False))
    return [Case(f"csbp_p{world}_c{C}_{transport}_w{left}{suffix}", "csbp", L, B, C, transport, left=left, **more)
            for left in lefts for transport in transports]


CASES = {
    1: (_csbp(1, 1, (3, 8, 21)) + _csbp(1, 1, (5,), ("collective",), token_causal=True)
        + _csbp(1, 1, (5,), ("streaming",), starts=UNALIGNED)
        + [Case(f"cp_{t}_w{left}", "cp", 64, 8, 1, t, left=left)
           for t in ("collective", "streaming") for left in (3, 21)]),
    2: (_csbp(2, 2, (3, 7, 8, 21, None)) + _csbp(2, 2, (5,), token_causal=True)
        + _csbp(2, 2, (5,), starts=UNALIGNED) + _csbp(2, 2, (0, 63), ("collective",))
        + [Case(f"cp_{t}_w{left}", "cp", 64, 8, 2, t, left=left)
           for t in ("collective", "streaming") for left in (3, 21)]
        + [Case("cp_traffic_w8", "cp-traffic", 64, 8, 2, left=8), Case("bp_w8", "bp", 64, 8, 1, left=8),
           Case("cp_token_causal_w5", "cp", 64, 8, 2, left=5, token_causal=True),
           Case("cp_packed_w5", "cp", 64, 8, 2, "streaming", left=5, starts=UNALIGNED),
           Case("bp_packed_w5", "bp", 64, 8, 1, left=5, starts=UNALIGNED)]),
    4: (_csbp(4, 4, (2, 4, 11, None), B=4) + _csbp(4, 2, (2, 11), B=4)
        + _csbp(4, 4, (3,), ("collective",), B=4, token_causal=True)
        + _csbp(4, 2, (6,), ("streaming",), B=4, starts=(0, 8, 21, 40))
        + [Case(f"cp_p4_{t}_w4", "cp", 64, 4, 4, t, left=4) for t in ("collective", "streaming")]
        + [Case("bp_p4_w4", "bp", 64, 4, 1, left=4)]),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def topology(request):
    cases = CASES[request.param]
    if request.param == 1:
        return cases, [run_single(cases, _kernels(), _attend)]
    return cases, run_ranks(run_cases, request.param, cases, _kernels(), _attend, timeout=900)


def test_the_op_equals_the_dense_windowed_mask_and_a_window_off_by_one_misses(topology):
    cases, per_rank = topology
    worst = {}
    for case in cases:
        worst[case.name] = max(compare(case, per_rank, case.mask()).values())
        if case.left is None or case.left >= case.seq_length - 1:
            continue
        for other in (case.left - 1, case.left + 1):
            if other >= 0:
                missed = max(compare(case, per_rank, case.mask(other)).values())
                assert missed > MISS, f"{case.name}: a window of {other} matches too ({missed:.1e})"
    print({name: f"{error:.1e}" for name, error in worst.items()})
    assert max(worst.values()) <= TOLERANCE, worst


def _beta(case):
    return 2 * case.kv_heads * case.head_dim * 4 * case.batch  # K+V, fp32, per token of every sample


def _expected_bytes(case, world_size, rank):
    """Bytes a rank sends in one layer, forward + backward, worked out from the dense mask: in a sliding layer under
    CSBP it sends each ring member the rows of its shard that member's rows see, and returns the gradients of the
    rows it got (collective: once each way; streaming: its rows twice, forward and backward, and the gradients);
    every other layer and mode moves the whole transported copy (docs/algorithm.md §9)."""
    layout = case.layout(world_size, rank)
    C, L = layout.clean_shards, case.seq_length
    if C == 1:
        return 0
    if case.left is None or layout.transports_noisy_rows:
        copies = 2 if layout.transports_noisy_rows else 1
        hops = 2 if case.transport == "collective" else 3
        return hops * copies * L * (C - 1) // C * _beta(case)
    mask = case.mask()
    ring = [layout.for_rank(layout.ring_index * C + j) for j in range(C)]
    seen = [mask[global_rows(member)][:, L:].any(0) for member in ring]
    own = layout.clean_positions
    sent = sum(int(seen[j][own].sum()) for j in range(C) if j != layout.ring_rank)
    received = sum(int(seen[layout.ring_rank][member.clean_positions].sum())
                   for j, member in enumerate(ring) if j != layout.ring_rank)
    return ((1 if case.transport == "collective" else 2) * sent + received) * _beta(case)


def test_bytes_sent_are_the_rows_other_ranks_see(topology):
    """The op's counters equal the count off the dense mask, and (one document) the analytic per-rank count the
    bench and the planner use (`flops.rank_traffic_bytes`, from `ParallelMode.exchanged_rows`)."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core.clean_attention import BLOCK_CAUSAL, TOKEN_CAUSAL
    from megatron_csbp.core.windows import GLOBAL, Sliding

    cases, per_rank = topology
    world = len(per_rank)
    for case in cases:
        sent = [result[case.name][-1] for result in per_rank]
        expected = [_expected_bytes(case, world, rank) for rank in range(world)]
        assert sent == expected, f"{case.name}: {sent} != {expected}"
        if case.starts == (0,):
            window = GLOBAL if case.left is None else Sliding(case.left)
            analytic = [case.batch * flops.rank_traffic_bytes(
                case.mode, case.seq_length, case.block_size, world, case.layout(world, rank).clean_shards, rank,
                case.kv_heads, case.head_dim, 4, case.transport,
                clean_attention=TOKEN_CAUSAL if case.token_causal else BLOCK_CAUSAL, window=window)
                for rank in range(world)]
            assert analytic == sent, f"{case.name}: {sent} != {analytic}"


def test_bytes_fall_with_the_window_and_equal_the_halo_formula(topology):
    """`P = C`, zigzag clean chunks of `c = L/2C` holding whole blocks, dual-end blocks (which then lie in the rank's
    own chunks), `LEFT <= c`: each chunk but the first needs the `LEFT` clean rows before it, from the neighbour
    chunk's owner, so rank `r` sends (and gets) `LEFT` rows for each of its `n_r = [r > 0] + [r < C-1]` neighbour
    chunks: `2·LEFT·β·n_r` per layer collective (`3·LEFT·β·n_r` streaming), against `2L(C-1)/C·β` (`3L(C-1)/C·β`)
    in a global layer."""
    cases, per_rank = topology
    world = len(per_rank)
    if world == 1:
        pytest.skip("nothing travels on one rank")
    by_name = {case.name: case for case in cases}
    sent = {case.name: [result[case.name][-1] for result in per_rank] for case in cases}
    checked = 0
    for case in cases:
        if case.mode != "csbp" or case.clean_shards != world or case.left is None or case.starts != (0,) \
                or case.token_causal:
            continue
        chunk = case.seq_length // (2 * world)
        if case.left <= chunk and chunk % case.block_size == 0:
            hops = 2 if case.transport == "collective" else 3
            formula = [hops * case.left * _beta(case) * ((r > 0) + (r < world - 1)) for r in range(world)]
            assert sent[case.name] == formula, (case.name, sent[case.name], formula)
            checked += 1
        whole = by_name[case.name.replace(f"_w{case.left}", "_wNone")]
        assert max(sent[case.name]) < min(sent[whole.name]), (case.name, sent[case.name], sent[whole.name])
    assert checked >= 4
    for transport in ("collective", "streaming"):  # bytes fall as the window shrinks
        series = [sum(sent[case.name]) for case in sorted(
            (c for c in cases if c.mode == "csbp" and c.transport == transport and c.clean_shards == world
             and c.starts == (0,) and not c.token_causal and c.left is not None), key=lambda c: c.left)]
        assert series == sorted(series) and len(set(series)) == len(series) > 1, (transport, series)


def _counted_off_the_mask(layout, mask, tile):
    """(kind, real, computed) of each kernel call, pair by pair off the dense mask: the block-diagonal call's whole
    blocks; the prefix call against the clean keys the rank holds after the exchange (the positions its rows see,
    or the whole clean copy where the ring moves it whole), each row from the key tile of its first visible key to
    that of its last; a masked call's (query tile, key tile) pairs with a visible pair."""
    L = layout.seq_length
    seen = mask[global_rows(layout)]
    if layout.masked_attention:
        rows = seen.shape[0]
        computed = sum(seen[q:q + tile, k:k + tile].numel() for q in range(0, rows, tile) for k in range(0, 2 * L, tile)
                       if seen[q:q + tile, k:k + tile].any())
        return [("masked", int(seen.sum()), computed)]
    calls = [("dense", int(seen[:layout.num_noisy_rows, :L].sum()), layout.num_noisy_rows * layout.block_size)]
    clean = seen[:, L:]
    if layout.exchanges_windows and layout.clean_shards > 1:
        clean = clean[:, clean.any(0)]  # the keys it holds: what its rows see
    computed = 0
    for row in clean:
        visible = torch.nonzero(row).flatten()
        if visible.numel():
            computed += min((int(visible[-1]) // tile + 1) * tile, clean.shape[1]) - int(visible[0]) // tile * tile
    return calls + [("prefix", int(clean.sum()), computed)]


@pytest.mark.parametrize("tile", [8, 24])
def test_kernel_calls_are_what_the_windowed_kernels_compute(tile):
    """The plans' counted calls equal a count off the windowed mask on every mode and rank, and so do the modes'
    analytic calls (the planner's); a global layer's differ (control)."""
    from megatron_csbp.core import modes, ops
    from megatron_csbp.core.clean_attention import BLOCK_CAUSAL, TOKEN_CAUSAL
    from megatron_csbp.core.kernels import CPUKernels
    from megatron_csbp.core.layout import layout_for
    from megatron_csbp.core.windows import Sliding

    L, B = 64, 8
    checked = 0
    for rule in (BLOCK_CAUSAL, TOKEN_CAUSAL):
        for left in (0, 3, 8, 21):
            mask = windowed_bdlm_mask(L, B, left, token_causal=rule is TOKEN_CAUSAL)
            for mode, P, C in [("csbp", 1, 1), ("csbp", 2, 2), ("csbp", 4, 4), ("csbp", 4, 2), ("bp", 2, 1),
                               ("cp", 2, 2), ("cp", 4, 4), ("cp-traffic", 2, 2)]:
                for rank in range(P):
                    layout = layout_for(mode, L, B, P, C, rank, clean_attention=rule, window=Sliding(left))
                    plan = ops.ring_plan(layout, "cpu", CPUKernels(tile=tile, masked_tile=tile))
                    counted = [(c.kind, c.real_pairs, c.computed_pairs) for c in plan.kernel_calls()]
                    assert counted == _counted_off_the_mask(layout, mask, tile), (rule, left, mode, P, C, rank)
                    analytic = modes.parallel_mode(mode).kernel_calls(L, B, P, layout.clean_shards, rank, tile, rule,
                                                                      Sliding(left))
                    assert [(c.kind, c.real_pairs, c.computed_pairs) for c in analytic] == counted
                    whole = modes.parallel_mode(mode).kernel_calls(L, B, P, layout.clean_shards, rank, tile, rule)
                    assert left == 21 and rule is BLOCK_CAUSAL and mode != "cp" or whole != analytic, (
                        rule, left, mode, P, C, rank)
                    checked += 1
    assert checked == 8 * 21


def test_the_flop_count_counts_the_windowed_pairs():
    """The FLOP count's pairs of a sliding layer equal the windowed mask's, and a run's step counts each layer's own
    (a 1-global-in-3 pattern: between all-sliding and all-global)."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core.clean_attention import BLOCK_CAUSAL, TOKEN_CAUSAL
    from megatron_csbp.core.model_shape import ModelShape
    from megatron_csbp.core.run_config import RunConfig
    from megatron_csbp.core.windows import Sliding

    for rule in (BLOCK_CAUSAL, TOKEN_CAUSAL):
        for left in (0, 3, 8, 21, 64):
            mask = windowed_bdlm_mask(64, 8, left, token_causal=rule is TOKEN_CAUSAL)
            assert flops.bdlm_attention_pairs(64, 8, rule, Sliding(left)) == int(mask.sum()), (rule, left)
    shape = ModelShape(6, 64, 4)
    step = [flops.run_step_flops(RunConfig(shape, 64, 8, window_size=size, window_attn_skip_freq=skip), 256)
            for size, skip in (((7, 0), None), ((7, 0), 3), (None, None))]
    assert step[0] < step[1] < step[2], step
    assert step[2] - step[1] == 4 * (step[2] - step[0]) // 6, step  # layers 1, 2, 4, 5 of 6 slide


def test_the_layer_pattern_is_megatron_cores():
    """`RunConfig.layer_windows` and the core attention's `spec.layer_window` pick exactly the layers megatron-core's
    `is_layer_window_attention` makes sliding, for an int N, a list and no pattern; LEFT -1 is global."""
    from megatron.core.transformer.utils import is_layer_window_attention

    from megatron_csbp.core.model_shape import ModelShape
    from megatron_csbp.core.run_config import RunConfig
    from megatron_csbp.core.windows import GLOBAL, Sliding
    from megatron_csbp.mcore.spec import layer_window
    from types import SimpleNamespace

    layers = 6
    for skip in (None, 1, 2, 3, 6, 7, (1, 1, 0, 1, 0, 0), (0,) * 6):
        settings = RunConfig(ModelShape(layers, 64, 4), 64, 8, window_size=(7, 0), window_attn_skip_freq=skip)
        megatron = [is_layer_window_attention((7, 0), list(skip) if isinstance(skip, tuple) else skip, n)
                    for n in range(1, layers + 1)]
        assert [w.sliding for w in settings.layer_windows] == megatron, skip
        assert all(w in (GLOBAL, Sliding(7)) for w in settings.layer_windows)
        config = SimpleNamespace(window_size=(7, 0), window_attn_skip_freq=skip, num_layers=layers)
        assert [layer_window(config, n) for n in range(1, layers + 1)] == list(settings.layer_windows)
    assert RunConfig(ModelShape(layers, 64, 4), 64, 8, window_size=(-1, 0)).layer_windows == (GLOBAL,) * layers
    assert RunConfig(ModelShape(layers, 64, 4), 64, 8).layer_windows == (GLOBAL,) * layers
    assert Sliding(511).window_size == (511, 0) and Sliding(511).hf_sliding_window == 512


TRAINING = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--data-path", "unused/prefix",
            "--bdlm-block-size", "8"]


@pytest.mark.parametrize("extra, line", [
    (["--window-size", "7,2"],
     "--window-size 7,2: a right window (RIGHT != 0) would let a clean row see clean tokens after its own, whose "
     "noisy copies later blocks must predict; the kernels take a left window only: give --window-size 7,0"),
    (["--window-size=-1,-1"],
     "--window-size -1,-1: a right window (RIGHT != 0) would let a clean row see clean tokens after its own, whose "
     "noisy copies later blocks must predict; the kernels take a left window only: give --window-size -1,0"),
    (["--window-size=-2,0"], "--window-size -2,0: LEFT is the positions a token sees before itself, >= 0 (or -1: no "
                             "window)"),
    (["--window-size", "7,0,0"], "--window-size 7,0,0: give two integers LEFT,RIGHT, e.g. 511,0"),
    (["--window-attn-skip-freq", "2"],
     "--window-attn-skip-freq 2 picks the sliding-window layers, but there is no --window-size; give --window-size "
     "LEFT,0 or drop --window-attn-skip-freq"),
    (["--window-size", "7,0", "--window-attn-skip-freq", "0"],
     "--window-attn-skip-freq 0: give N >= 1 (every N-th layer global) or one 0 (global) or 1 (sliding) per layer"),
    (["--window-size", "7,0", "--window-attn-skip-freq", "[1,0]"],
     "--window-attn-skip-freq [1,0] names 2 layers, but --num-layers is 4: give one 0 (global) or 1 (sliding) per "
     "layer, or an int N (every N-th layer global)"),
])
def test_windows_the_kernels_cannot_do_are_refused_in_one_line(extra, line):
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.training.arguments import validate
    from megatron_csbp.training.flags import build_parser

    with pytest.raises(ConfigError) as refused:
        validate(build_parser().parse_args(TRAINING + extra), 1, on_accelerator=False, check_paths=False)
    assert str(refused.value) == line


def test_a_pattern_that_is_not_one_is_refused_by_the_parser(capsys):
    from megatron_csbp.training.flags import build_parser

    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(TRAINING + ["--window-size", "7,0", "--window-attn-skip-freq", "[1,2,1,1]"])
    assert stopped.value.code == 2
    assert "layer 1 is 2; each layer is 0 (global) or 1 (sliding)" in capsys.readouterr().err


def test_continuing_a_checkpoint_under_other_windows_is_refused():
    """A run that continues a checkpoint keeps its layers' windows (one line naming the flag); the same windows, in
    either loop's spelling (a tuple and a list, a YAML's list), pass."""
    import argparse

    from megatron_csbp.training.checkpointing import CheckpointError, check_same_windows

    saved = {"window_size": (20, 0), "window_attn_skip_freq": [1, 0, 1, 0]}
    check_same_windows(saved, argparse.Namespace(window_size=[20, 0], window_attn_skip_freq=(1, 0, 1, 0)), "ckpt")
    check_same_windows({}, argparse.Namespace(window_size=None, window_attn_skip_freq=None), "ckpt")
    for ours, line in [
        (dict(window_size=None, window_attn_skip_freq=None),
         "checkpoint ckpt was trained with --window-size 20,0, this run has no --window-size: a run that continues "
         "it keeps its layers' windows; give its window flags, or --finetune to train it on under new ones"),
        (dict(window_size=(20, 0), window_attn_skip_freq=2),
         "checkpoint ckpt was trained with --window-attn-skip-freq [1, 0, 1, 0], this run has "
         "--window-attn-skip-freq 2: a run that continues it keeps its layers' windows; give its window flags, or "
         "--finetune to train it on under new ones")]:
        with pytest.raises(CheckpointError) as refused:
            check_same_windows(saved, argparse.Namespace(**ours), "ckpt")
        assert str(refused.value) == line


def test_flex_forward_with_a_window_matches_the_cpu_kernels():
    """Flex attention (eager on the CPU, forward; its backward runs on GPUs: scripts/gpu_check.sh) in a sliding
    layer: the range plan of a rank's rows against the clean keys its exchange gives it, and the field's CP's masked
    call, equal the CPU kernels' (which equal the dense windowed mask: above)."""
    from megatron_csbp.core import ops
    from megatron_csbp.core.kernels import CPUKernels, FlexKernels
    from megatron_csbp.core.layout import layout_for
    from megatron_csbp.core.windows import Sliding

    scale = 8 ** -0.5
    for mode, left in (("csbp", 5), ("cp", 5), ("csbp", 11)):
        layout = layout_for(mode, 64, 8, 2, 2, 1, window=Sliding(left))
        flex, cpu = FlexKernels(compile=False, masked_tile=16), CPUKernels(tile=16, masked_tile=16)
        plans = [ops.ring_plan(layout, "cpu", kernels) for kernels in (flex, cpu)]
        gen = torch.Generator().manual_seed(3)
        q = torch.randn(1, 2, 2, layout.num_rows, 8, generator=gen)
        keys = plans[1].num_keys
        k, v = (torch.randn(1, 2, keys, 8, generator=gen) for _ in range(2))
        (flex_out, flex_lse), (cpu_out, cpu_lse) = (plan.remote_forward(q, k, v, plan.gathered, scale)
                                                    for plan in plans)
        finite = ~torch.isinf(cpu_lse)
        assert torch.allclose(flex_out, cpu_out, atol=1e-5), mode
        assert torch.equal(torch.isinf(flex_lse), ~finite) and torch.allclose(flex_lse[finite], cpu_lse[finite],
                                                                               atol=1e-5), mode
