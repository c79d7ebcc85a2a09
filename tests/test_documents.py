"""Packed documents: the op with `documents=` equals dense fp64 attention under the block mask intersected with
the document mask, forward and backward, on 1, 2 and 4 ranks (CSBP, both transports, CP and BP), for documents
on block boundaries and across them; the kernels' plans skip other documents' tiles."""

from dataclasses import dataclass

import pytest
import torch

from attention_reference import bdlm_mask, global_rows
from op_cases import OpCase, compare, run_cases, run_single
from spawn import run_ranks

TOLERANCE = 1e-5
TILE = 8


@dataclass(frozen=True)
class Case(OpCase):
    """An op case of a packed sample (`op_cases.OpCase`): its documents' starts; `broken`: "documents", the op
    runs without them (negative control)."""

    starts: tuple = (0,)


def document_mask(seq_length, block_size, starts):
    """`[2L, 2L]` bool: the BDLM mask AND same document (row i and L+i both belong to token i's document)."""
    from megatron_csbp.core.documents import Documents

    ids = Documents(seq_length, starts).ids().repeat(2)
    return bdlm_mask(seq_length, block_size) & (ids.view(-1, 1) == ids.view(1, -1))


def _attend(case, layout, group, query, key, value):
    from megatron_csbp.core import ops
    from megatron_csbp.core.documents import Documents

    documents = None if case.broken == "documents" else Documents(case.seq_length, case.starts)
    return ops.context_sharded_block_attention(query, key, value, layout, group, transport=case.transport,
                                               documents=documents)


def _kernels():
    from megatron_csbp.core.kernels import CPUKernels

    return CPUKernels(tile=TILE)


ALIGNED = (0, 8, 24, 40)         # L = 64, B = 8: documents of 8, 16, 16, 24 tokens, starts on blocks
UNALIGNED = (0, 5, 19, 20, 47)   # boundaries inside blocks, a one-token document
CASES = {
    1: [Case("one_rank_aligned", "csbp", 64, 8, 1, starts=ALIGNED),
        Case("one_rank_unaligned", "csbp", 64, 8, 1, starts=UNALIGNED),
        Case("one_rank_unaligned_streaming", "csbp", 64, 8, 1, "streaming", starts=UNALIGNED),
        Case("negative_control", "csbp", 64, 8, 1, starts=UNALIGNED, broken="documents")],
    2: [Case(f"{mode}_{name}_{transport}", mode, 64, 8, 2 if mode != "bp" else 1, transport, starts=starts)
        for mode in ("csbp", "cp", "bp") for name, starts in (("aligned", ALIGNED), ("unaligned", UNALIGNED))
        for transport in ("collective", "streaming")],
    4: [Case(f"csbp_p4_c2_{name}_{transport}", "csbp", 64, 4, 2, transport, starts=starts)
        for name, starts in (("aligned", (0, 8, 24, 40)), ("unaligned", UNALIGNED))
        for transport in ("collective", "streaming")],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def topology(request):
    cases = CASES[request.param]
    if request.param == 1:
        return cases, [run_single(cases, _kernels(), _attend)]
    return cases, run_ranks(run_cases, request.param, cases, _kernels(), _attend, timeout=600)


def test_packed_attention_matches_dense_document_mask(topology):
    cases, per_rank = topology
    for case in cases:
        errors = compare(case, per_rank, document_mask(case.seq_length, case.block_size, case.starts))
        if case.broken:
            assert max(errors.values()) > 1e-2, f"{case.name}: documents ignored, yet matches: {errors}"
        else:
            assert max(errors.values()) <= TOLERANCE, f"{case.name}: {errors}"


def test_range_plan_skips_other_documents_tiles():
    """Keys of other documents are never computed: with 4 documents of 64 keys and 16-key tiles, each row's
    pairs stay within its own document."""
    from megatron_csbp.core.kernels.cpu_tiles import RangePlan

    positions = torch.arange(256)
    starts = (positions // 64) * 64
    limits = positions + 1
    plan = RangePlan(starts, limits, positions, 16)
    assert plan.pairs <= sum(int(lim - st + 15) // 16 * 16 for st, lim in zip(starts, limits))
    one_document = RangePlan(torch.zeros(256, dtype=torch.long), limits, positions, 16)
    assert plan.pairs < one_document.pairs / 3


def test_documents_from_eod_and_positions():
    from megatron_csbp.core.documents import Documents, document_ids

    tokens = torch.tensor([5, 6, 0, 7, 0, 8, 9, 9])  # EOD = 0 ends documents 0 and 1
    documents = Documents.from_eod(tokens, eod=0)
    assert documents.starts == (0, 3, 5)
    assert document_ids(tokens.view(1, -1), 0).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert documents.local_positions(torch.arange(8)).tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert not documents.block_aligned(4) and Documents(8, (0, 4)).block_aligned(4)
    with pytest.raises(ValueError):
        Documents(8, (0, 9))


def test_flex_forward_with_documents_matches_cpu_kernels():
    """Flex's mask_mods with document ids (prefix ranges, block-diagonal cut at a document boundary) against the
    CPU kernels; forward only, eagerly (flex's backward runs on GPUs: scripts/gpu_check.sh)."""
    from megatron_csbp.core.documents import Documents, NoisyDocuments
    from megatron_csbp.core.kernels import CPUKernels, FlexKernels

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 2, 32, 8, generator=gen)
    k, v = torch.randn(1, 2, 32, 8, generator=gen), torch.randn(1, 2, 32, 8, generator=gen)
    documents = Documents(32, (0, 5, 19, 20))
    positions = torch.arange(32)
    starts, limits = documents.start_of(positions), torch.minimum((positions // 8) * 8, documents.end_of(positions))
    flex, cpu = FlexKernels(compile=False), CPUKernels(8)
    noisy = documents.index_of(positions)
    pairs = [(flex.block_diagonal_forward(q, k, v, 8, 0.3, documents=NoisyDocuments(noisy)),
              cpu.block_diagonal_forward(q, k, v, 8, 0.3, documents=NoisyDocuments(noisy))),
             (flex.prefix_forward(q, k, v, flex.plan(limits, positions, starts), 0.3),
              cpu.prefix_forward(q, k, v, cpu.plan(limits, positions, starts), 0.3))]
    for (flex_out, flex_lse), (cpu_out, cpu_lse) in pairs:
        finite = ~torch.isinf(cpu_lse)
        assert torch.allclose(flex_out, cpu_out, atol=1e-5)
        assert torch.equal(torch.isinf(flex_lse), ~finite) and torch.allclose(flex_lse[finite], cpu_lse[finite], atol=1e-5)
    assert bool(torch.isinf(pairs[1][1][1]).any())  # rows at a document's first block see no clean key


def test_packing_options_that_cannot_be_honoured_are_refused_in_one_line():
    from megatron_csbp.core.rules import ConfigError, packing_problem
    from megatron_csbp.core.model_shape import ModelShape
    from megatron_csbp.core.run_config import RunConfig

    assert packing_problem(True, True, 2) is None and packing_problem(False, False, 4) is None
    with pytest.raises(ConfigError) as refused:
        RunConfig(ModelShape(num_layers=4, hidden_size=32, num_attention_heads=4), seq_length=64, block_size=8,
                  pipeline_parallel_size=4, reset_attention_mask=True)
    assert str(refused.value).startswith("--reset-attention-mask with --pipeline-model-parallel-size=4: the middle "
                                         "stages never read the batch") and "\n" not in str(refused.value)
    line = packing_problem(True, False, 2, virtual_pipeline=True)
    assert line.startswith("--reset-position-ids with a virtual pipeline") and "\n" not in line


def test_document_balanced_deal_keeps_rows_and_balances_real_work():
    """Each rank keeps its block count and clean shard; the deal's max/mean real pairs beat the static schedule's
    on a packing whose documents make the global-position costs wrong (the packed tests train with such deals)."""
    from megatron_csbp.core.documents import Documents, balanced_layout, rank_pairs, row_pairs
    from megatron_csbp.core.layout import CSBPLayout

    documents = Documents(4096, (0, 256, 1024, 1280, 3072, 3584))
    for P, C in ((4, 4), (4, 2), (8, 1)):
        static = [CSBPLayout(4096, 64, P, C, r) for r in range(P)]
        dealt = [balanced_layout(layout, documents) for layout in static]
        assert sorted(b for layout in dealt for b in layout.owned_blocks) == list(range(64))
        for before, after in zip(static, dealt):
            assert after.num_rows == before.num_rows and torch.equal(after.clean_positions, before.clean_positions)
        before, after = rank_pairs(static, documents), rank_pairs(dealt, documents)
        assert sum(before) == sum(after) and max(after) < max(before), (P, C, before, after)
    # row_pairs counts what the dense document mask allows, pair by pair
    small, layout = Documents(32, (0, 5, 19, 20)), CSBPLayout(32, 4, 2, 2, 1)
    mask = document_mask(32, 4, small.starts)
    rows = torch.cat([layout.noisy_positions, 32 + layout.clean_positions])
    assert row_pairs(layout, small).tolist() == mask[rows].sum(1).tolist()
    with pytest.raises(ValueError):
        static[0].dealt(((0,),) * 8)


def _brute_force_calls(layout, mask, tile):
    """(kind, real, computed) of each kernel call of `layout`'s rank, counted pair by pair off the dense `[2L, 2L]`
    mask (block mask AND same document): the block-diagonal call computes its owned blocks whole; a range kernel
    computes, per row, the key tiles from the one holding its first visible key to the one holding its last; a
    masked kernel every (query tile, key tile) with a visible pair. Keys in position order (masked: noisy copy,
    then clean), `tile` wide."""
    L = layout.seq_length
    rows = global_rows(layout)
    seen = mask[rows]
    if layout.masked_attention:
        tiles = [(q, k) for q in range(0, len(rows), tile) for k in range(0, 2 * L, tile)]
        computed = sum(seen[q:q + tile, k:k + tile].numel() for q, k in tiles if seen[q:q + tile, k:k + tile].any())
        return [("masked", int(seen.sum()), computed)]
    calls = []
    if layout.num_noisy_rows:
        noisy = seen[:layout.num_noisy_rows, :L]
        calls.append(("dense", int(noisy.sum()), layout.num_noisy_rows * layout.block_size))
    clean_keys, computed = seen[:, L:], 0
    for row in clean_keys:
        visible = torch.nonzero(row).flatten()
        if visible.numel():
            computed += min((int(visible[-1]) // tile + 1) * tile, L) - int(visible[0]) // tile * tile
    return calls + [("prefix", int(clean_keys.sum()), computed)]


PACKINGS = {"on blocks": (0, 8, 24, 40), "inside blocks": (0, 5, 19, 20, 47), "on and inside": (0, 16, 21, 48, 50)}


@pytest.mark.parametrize("tile", [8, 24])
def test_kernel_calls_of_a_packed_sample_are_what_its_kernels_compute(tile):
    """`RingPlan.kernel_calls` of a packed sample equals a pair-by-pair count off the dense document mask, for
    every mode's plan on 1, 2 and 4 ranks (static and document-dealt blocks), with documents on and inside
    blocks: real pairs are the block mask AND same document, computed pairs the kernels' whole blocks and tiles.
    The streamed calls (one per ring member) add up to the same real pairs. Negative control: where a block
    straddles documents, its real pairs fall short of the whole blocks the count once reported."""
    from megatron_csbp.core import ops
    from megatron_csbp.core.documents import Documents, balanced_layout
    from megatron_csbp.core.kernels import CPUKernels
    from megatron_csbp.core.layout import layout_for

    L, B = 64, 8
    geometries = [("csbp", 1, 1), ("csbp", 2, 2), ("csbp", 4, 4), ("csbp", 4, 2), ("bp", 2, 1), ("bp", 4, 1),
                  ("cp", 1, 1), ("cp", 2, 2), ("cp", 4, 4), ("cp-traffic", 2, 2), ("cp-traffic", 4, 4)]
    checked, short = 0, set()
    for name, starts in PACKINGS.items():
        documents, mask = Documents(L, starts), document_mask(L, B, starts)
        for mode, P, C in geometries:
            for rank in range(P):
                static = layout_for(mode, L, B, P, C, rank)
                for layout in {static, balanced_layout(static, documents)}:
                    plan = ops.ring_plan(layout, "cpu", CPUKernels(tile=tile, masked_tile=tile), documents=documents)
                    counted = [(c.kind, c.real_pairs, c.computed_pairs) for c in plan.kernel_calls()]
                    assert counted == _brute_force_calls(layout, mask, tile), (name, mode, P, C, rank, layout)
                    streamed = plan.kernel_calls(per_member=True)
                    assert sum(c.real_pairs for c in streamed) == sum(real for _, real, _ in counted)
                    if counted[0][0] == "dense" and counted[0][1] < counted[0][2]:
                        short.add(name)
                    checked += 1
    assert checked > 100 and short == {"inside blocks", "on and inside"}, (checked, short)
