"""Properties of the row layouts: ownership, balance, the documented examples and the refusals."""

import pytest
import torch

from megatron_csbp.core.layout import CPLayout, CSBPLayout, layout_for
from megatron_csbp.core.schedule import block_cost

TOPOLOGIES = [(L, B, P, C) for L, B, P, C in [
    (64, 4, 4, 4), (64, 4, 4, 2), (64, 4, 4, 1), (72, 8, 2, 2), (48, 8, 4, 4), (56, 8, 4, 4), (32, 8, 4, 4),
    (1024, 16, 8, 8), (1024, 16, 8, 4), (4096, 64, 16, 8), (96, 8, 3, 3), (120, 8, 5, 5), (264, 8, 6, 3)]]


def test_documented_examples():
    assert CSBPLayout(16 * 8, 8, 4, 4).schedule_table == [[0, 15, 1, 14], [2, 13, 3, 12], [4, 11, 5, 10], [6, 9, 7, 8]]
    chunks = {0: [(0, 8), (56, 64)], 1: [(8, 16), (48, 56)], 2: [(16, 24), (40, 48)], 3: [(24, 32), (32, 40)]}
    for rank, spans in chunks.items():
        expected = torch.cat([torch.arange(a, b) for a, b in spans])
        assert torch.equal(CSBPLayout(64, 4, 4, 4, rank).clean_positions, expected)


@pytest.mark.parametrize("schedule", ["dual_end", "contiguous"])
@pytest.mark.parametrize("clean_layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("L,B,P,C", TOPOLOGIES)
def test_every_block_and_clean_position_has_one_owner(L, B, P, C, schedule, clean_layout):
    layouts = [CSBPLayout(L, B, P, C, r, schedule, clean_layout) for r in range(P)]
    blocks = sorted(b for layout in layouts for b in layout.owned_blocks)
    assert blocks == list(range(L // B))
    noisy = torch.cat([layout.noisy_positions for layout in layouts])
    assert torch.equal(noisy.sort().values, torch.arange(L))
    for ring in range(P // C):
        members = layouts[ring * C:(ring + 1) * C]
        assert all(m.ring_index == ring for m in members)
        clean = torch.cat([m.clean_positions for m in members])
        assert torch.equal(clean.sort().values, torch.arange(L))
    for layout in layouts:
        assert layout.num_rows == layout.num_noisy_rows + L // C
        assert torch.equal(layout.row_positions[layout.num_noisy_rows:], layout.clean_positions)
        assert layout.row_is_clean.sum() == L // C
        assert layout.rank in layout.clean_replica_ranks and layout.rank in layout.ring_ranks


@pytest.mark.parametrize("L,B,P,C", TOPOLOGIES)
def test_dual_end_prefix_costs_are_balanced(L, B, P, C):
    loads = [sum(block_cost(b) for b in CSBPLayout(L, B, P, C, r).owned_blocks) for r in range(P)]
    heaviest_block = block_cost(L // B - 1)
    assert max(loads) - min(loads) <= heaviest_block, loads
    if (L // B) % (2 * P) == 0:
        assert len(set(loads)) == 1, loads


def test_dual_end_beats_contiguous_balance():
    dual = [sum(map(block_cost, CSBPLayout(1024, 16, 8, 8, r).owned_blocks)) for r in range(8)]
    contiguous = [sum(map(block_cost, CSBPLayout(1024, 16, 8, 8, r, "contiguous").owned_blocks)) for r in range(8)]
    assert max(dual) - min(dual) == 0 < max(contiguous) - min(contiguous)


def test_conventional_cp_layout_is_zigzag_over_both_copies():
    L, B, C = 64, 4, 4
    rows = [CPLayout(L, B, C, r) for r in range(C)]
    chunk = 2 * L // (2 * C)
    for r, layout in enumerate(rows):
        # zigzag chunks r and 2C-1-r of the 2L rows [x_t ; x_0]
        global_rows = torch.cat([layout.noisy_positions, L + layout.clean_positions])
        expected = torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                              torch.arange((2 * C - 1 - r) * chunk, (2 * C - r) * chunk)])
        assert torch.equal(global_rows, expected)
    assert torch.equal(torch.cat([r.noisy_positions for r in rows]).sort().values, torch.arange(L))
    assert layout_for("cp", L, B, C, rank=1) == rows[1]
    assert layout_for("bp", L, B, 4, rank=2) == CSBPLayout(L, B, 4, 1, 2)


@pytest.mark.parametrize("kwargs, message", [  # the trainer's messages (megatron_csbp.core.rules): flag and fix
    (dict(seq_length=60, block_size=8, block_parallel_size=2, clean_shards=2),
     "--seq-length 60 is not a multiple of --bdlm-block-size 8; use --seq-length 56"),
    (dict(seq_length=64, block_size=32, block_parallel_size=4, clean_shards=4),
     "too few for --context-block-parallel 4 .* use --seq-length >= 128"),
    (dict(seq_length=64, block_size=8, block_parallel_size=4, clean_shards=3),
     "--context-block-parallel 4 is not a multiple of --context-block-parallel-clean-shards 3; use a divisor of 4"),
    (dict(seq_length=64, block_size=16, block_parallel_size=8, clean_shards=8), "has 4 blocks of 16, too few"),
    (dict(seq_length=40, block_size=4, block_parallel_size=3, clean_shards=3), "cannot be cut into 6 equal clean chunks"),
    (dict(seq_length=64, block_size=8, block_parallel_size=2, clean_shards=2, schedule="random"), "dual_end"),
    (dict(seq_length=64, block_size=8, block_parallel_size=2, clean_shards=2, clean_layout="x"), "zigzag"),
    (dict(seq_length=64, block_size=8, block_parallel_size=2, clean_shards=0), "clean-shards 0"),
])
def test_invalid_layouts_are_refused_with_a_valid_alternative(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CSBPLayout(**kwargs)


def test_invalid_cp_layout_and_mode_are_refused():
    with pytest.raises(ValueError, match="must be a multiple of 32"):
        CPLayout(48, 8, 4)
    with pytest.raises(ValueError, match="csbp"):
        layout_for("ring", 64, 8, 2)
