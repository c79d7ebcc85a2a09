"""The CSBP op and its baselines equal dense fp64 attention, forward and backward, and send exactly the bytes
of the algorithm doc's table. One spawn per world size runs every topology of that size."""

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from op_cases import OpCase, compare, run_cases, run_single
from spawn import run_ranks

TOLERANCE = 1e-5
TILE = 16  # small key tiles (prefix and masked kernels), so every case runs several tiles, masked and unmasked


@dataclass(frozen=True)
class Case(OpCase):
    """An op case (`op_cases.OpCase`; `broken`: "reduce_scatter", a reduction that does not sum), and the bytes
    it sends."""

    @property
    def transported_tokens(self):
        """Tokens whose K/V one traversal of the ring moves: clean only for CSBP, both copies for CP."""
        copies = {"csbp": 1, "cp": 2, "cp-traffic": 2, "bp": 0}[self.mode]
        return copies * self.seq_length

    def expected_bytes(self):
        """Bytes one rank sends per layer, forward + backward (docs/algorithm.md §9)."""
        c = self.clean_shards
        beta = 2 * self.kv_heads * self.head_dim * 4 * self.batch  # K+V, fp32, per token of every sample
        hops = 2 if self.transport == "collective" else 3  # all-gather + reduce-scatter | K/V twice + dK/dV
        return hops * self.transported_tokens * (c - 1) // c * beta if c > 1 else 0


def _copy_instead_of_reduce_scatter(full, group):
    """Negative control: hand each rank its own slice of the gradient without summing the other ranks'."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    return full.chunk(size)[me].clone(), None


@contextlib.contextmanager
def _broken(case):
    """The case's deliberately broken reduction, if any, for its forward and backward."""
    from megatron_csbp.core import comm

    reduce_scatter = comm.reduce_scatter_start
    if case.broken == "reduce_scatter":
        comm.reduce_scatter_start = _copy_instead_of_reduce_scatter
    try:
        yield
    finally:
        comm.reduce_scatter_start = reduce_scatter


def _attend(case, layout, group, query, key, value):
    from megatron_csbp.core import ops

    return ops.context_sharded_block_attention(query, key, value, layout, group, transport=case.transport)


def _kernels():
    from megatron_csbp.core.kernels import CPUKernels

    return CPUKernels(tile=TILE, masked_tile=TILE)


CASES = {
    1: [Case("single_rank", "csbp", 32, 8, 1), Case("single_rank_streaming", "csbp", 32, 8, 1, "streaming"),
        Case("single_rank_cp", "cp", 32, 8, 1), Case("single_rank_cp_streaming", "cp", 32, 8, 1, "streaming")],
    2: [
        Case("csbp_gqa", "csbp", 64, 8, 2),
        Case("csbp_gqa_streaming", "csbp", 64, 8, 2, "streaming"),
        Case("csbp_mha", "csbp", 64, 8, 2, heads=2, kv_heads=2),
        Case("csbp_mha_streaming", "csbp", 64, 8, 2, "streaming", heads=2, kv_heads=2),
        Case("csbp_contiguous_clean", "csbp", 64, 8, 2, options={"clean_layout": "contiguous"}),
        Case("csbp_contiguous_clean_streaming", "csbp", 64, 8, 2, "streaming", options={"clean_layout": "contiguous"}),
        Case("csbp_contiguous_schedule", "csbp", 64, 8, 2, options={"schedule": "contiguous"}),
        Case("csbp_odd_blocks", "csbp", 72, 8, 2),
        Case("csbp_odd_blocks_streaming", "csbp", 72, 8, 2, "streaming"),
        Case("csbp_blocks_equal_ranks", "csbp", 16, 8, 2),
        Case("cp", "cp", 64, 8, 2),
        Case("cp_streaming", "cp", 64, 8, 2, "streaming"),
        Case("cp_mha", "cp", 64, 8, 2, heads=2, kv_heads=2),
        Case("cp_traffic", "cp-traffic", 64, 8, 2),
        Case("cp_traffic_streaming", "cp-traffic", 64, 8, 2, "streaming"),
        Case("bp", "bp", 64, 8, 1),
        Case("negative_control", "csbp", 64, 8, 2, broken="reduce_scatter"),
        Case("negative_control_cp", "cp", 64, 8, 2, broken="reduce_scatter"),
    ],
    4: [
        Case("csbp_p4", "csbp", 64, 4, 4),
        Case("csbp_p4_streaming", "csbp", 64, 4, 4, "streaming"),
        Case("csbp_p4_c2", "csbp", 64, 4, 2),
        Case("csbp_p4_c2_streaming", "csbp", 64, 4, 2, "streaming"),
        Case("csbp_p4_c2_mha", "csbp", 64, 4, 2, heads=2, kv_heads=2),
        Case("csbp_p4_greedy_blocks", "csbp", 48, 8, 4),  # NB = 6 < 2P-1
        Case("csbp_p4_odd_blocks", "csbp", 56, 8, 4),  # NB = 7
        Case("csbp_p4_blocks_equal_ranks", "csbp", 32, 8, 4),
        Case("csbp_p4_contiguous_clean_c2", "csbp", 64, 4, 2, "streaming", options={"clean_layout": "contiguous"}),
        Case("cp_p4", "cp", 64, 4, 4),
        Case("cp_p4_streaming", "cp", 64, 4, 4, "streaming"),
        Case("cp_traffic_p4", "cp-traffic", 64, 4, 4),
        Case("cp_traffic_p4_streaming", "cp-traffic", 64, 4, 4, "streaming"),
        Case("bp_p4", "bp", 64, 4, 1),
        Case("negative_control_p4_c2", "csbp", 64, 4, 2, broken="reduce_scatter"),
    ],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def topology(request):
    world_size = request.param
    cases = CASES[world_size]
    if world_size == 1:
        return cases, [run_single(cases, _kernels(), _attend, _broken)]
    return cases, run_ranks(run_cases, world_size, cases, _kernels(), _attend, _broken, timeout=600)


def test_outputs_and_gradients_match_dense_reference(topology):
    cases, per_rank = topology
    failures = []
    for case in cases:
        errors = compare(case, per_rank)
        worst = max(errors.values())
        if case.broken:
            assert worst > 1e-2, f"{case.name}: a broken {case.broken} went unnoticed ({errors})"
        elif worst > TOLERANCE:
            failures.append(f"{case.name}: {errors}")
    assert not failures, "\n".join(failures)


def test_bytes_sent_equal_the_formulas(topology):
    cases, per_rank = topology
    for case in cases:
        if case.broken:
            continue
        sent = [result[case.name][-1] for result in per_rank]
        assert sent == [case.expected_bytes()] * len(per_rank), f"{case.name}: {sent} != {case.expected_bytes()}"


# Bytes per rank, measured by the op's counters, against figures worked out by hand from the table of
# docs/algorithm.md §9: beta = K+V of one token = 2 x 2 kv heads x 8 dims x 4 bytes x 2 samples = 256 bytes;
# L = 64.
# P = C = 2: CSBP 2L(C-1)/C beta = 64 beta, CP 4L(C-1)/C beta = 128 beta (streaming: 96 and 192 beta);
# P = C = 4: CSBP 96 beta, CP 192 beta (streaming: 144 and 288 beta).
HAND_COUNTED = {2: {"csbp_gqa": 16384, "cp": 32768, "csbp_gqa_streaming": 24576, "cp_streaming": 49152,
                    "cp_traffic": 32768, "cp_traffic_streaming": 49152},
                4: {"csbp_p4": 24576, "cp_p4": 49152, "csbp_p4_streaming": 36864, "cp_p4_streaming": 73728,
                    "cp_traffic_p4": 49152, "cp_traffic_p4_streaming": 73728}}


def test_csbp_sends_half_of_conventional_cp(topology):
    cases, per_rank = topology
    if len(per_rank) not in HAND_COUNTED:
        pytest.skip("no CP baseline on one rank")
    measured = {name: {result[name][-1] for result in per_rank} for name in HAND_COUNTED[len(per_rank)]}
    assert measured == {name: {count} for name, count in HAND_COUNTED[len(per_rank)].items()}, measured
    suffix = "" if len(per_rank) == 2 else "_p4"
    for transport in ("", "_streaming"):
        (csbp,), (cp,) = measured[f"csbp{'_gqa' if not suffix else suffix}{transport}"], measured[f"cp{suffix}{transport}"]
        assert 2 * csbp == cp, (transport, csbp, cp)


def test_bad_calls_are_refused():
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.core.ops import context_sharded_block_attention

    layout = CSBPLayout(32, 8, 1, 1)
    q, k = torch.zeros(64, 1, 4, 8), torch.zeros(64, 1, 3, 8)
    with pytest.raises(ValueError, match="transport"):
        context_sharded_block_attention(q, q, q, layout, transport="carrier-pigeon")
    with pytest.raises(ValueError, match="K/V heads"):
        context_sharded_block_attention(q, k, k, layout)
    with pytest.raises(ValueError, match="64 rows"):
        context_sharded_block_attention(q[:32], q[:32], q[:32], layout)


def test_a_plan_is_built_once_and_must_match_the_layout():
    from megatron_csbp.core import ops
    from megatron_csbp.core.layout import CSBPLayout

    layout = CSBPLayout(32, 8, 1, 1)
    q = torch.randn(64, 1, 4, 8)
    plan = ops.ring_plan(layout, q.device)
    assert torch.equal(ops.context_sharded_block_attention(q, q, q, layout, plan=plan),
                       ops.context_sharded_block_attention(q, q, q, layout))
    with pytest.raises(ValueError, match="plan was built for"):
        ops.context_sharded_block_attention(q, q, q, layout, plan=ops.ring_plan(CSBPLayout(32, 4, 1, 1), q.device))
    layouts = [CSBPLayout(32, block, 1, 1, schedule=schedule) for block in (1, 2, 4, 8, 16, 32)
               for schedule in ("dual_end", "contiguous")]
    assert len(layouts) > ops.PLAN_CACHE_SIZE
    for other in layouts:  # without a plan the op caches plans, but only the last few
        ops.context_sharded_block_attention(q, q, q, other)
    assert len(ops._plans) == ops.PLAN_CACHE_SIZE and (layouts[-1], q.device) in ops._plans
