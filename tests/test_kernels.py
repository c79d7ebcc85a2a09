"""The two local attention shapes against plain masked softmax, on the CPU kernels and (forward) flex attention."""

import pytest
import torch

from megatron_csbp.core.kernels import CPUKernels, FlexKernels, merge_partials

SCALE = 0.3


def dense(q, k, v, visible):
    """Masked softmax attention in fp64 with grouped heads: q `[b,h,g,n,d]`, k/v `[b,h,m,d]`, visible `[n,m]`."""
    scores = torch.einsum("bhgnd,bhmd->bhgnm", q.double(), k.double()) * SCALE
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0, lse).unsqueeze(-1))
    return torch.einsum("bhgnm,bhmd->bhgnd", probs, v.double()), lse


def case(n=48, m=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, 3, n, 8, generator=gen)
    k, v = torch.randn(2, 2, m, 8, generator=gen), torch.randn(2, 2, m, 8, generator=gen)
    limits = torch.randint(0, 100, (n,), generator=gen)
    key_positions = torch.randperm(100, generator=gen)[:m].sort().values
    return q, k, v, limits, key_positions


@pytest.mark.parametrize("tile", [4, 7, 16, 512])
def test_prefix_forward_and_backward_match_masked_softmax(tile):
    q, k, v, limits, key_positions = case()
    visible = key_positions.unsqueeze(0) < limits.unsqueeze(1)
    kernels = CPUKernels(tile)
    plan = kernels.plan(limits, key_positions)
    out, lse = kernels.prefix_forward(q, k, v, plan, SCALE)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = dense(*ref_in, visible)
    assert torch.allclose(out.double(), ref_out, atol=1e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.allclose(lse[~torch.isinf(lse)].double(), ref_lse[~torch.isinf(ref_lse)], atol=1e-5)
    dout = torch.randn_like(out)
    (ref_out * dout.double()).sum().backward()
    grads = kernels.prefix_backward(dout, q, k, v, out, lse, plan, SCALE)
    for grad, ref in zip(grads, ref_in):
        assert torch.allclose(grad.double(), ref.grad, atol=1e-5)
    # only what the mask shows is computed: no tile entirely hidden, padding under one tile per row
    assert plan.pairs <= visible.sum().item() + tile * int(visible.any(1).sum())


def test_block_diagonal_matches_masked_softmax():
    q, k, v, _, _ = case(n=32, m=32)
    block = torch.arange(32) // 8
    out, lse = CPUKernels().block_diagonal_forward(q, k, v, 8, SCALE)
    ref_out, ref_lse = dense(q, k, v, block.unsqueeze(1) == block.unsqueeze(0))
    assert torch.allclose(out.double(), ref_out, atol=1e-6) and torch.allclose(lse.double(), ref_lse, atol=1e-5)


def test_merge_of_split_keys_equals_whole_and_ignores_empty_parts():
    q, k, v, _, _ = case(n=16, m=32)
    everything = torch.ones(16, 32, dtype=torch.bool)
    first, second = everything.clone(), everything.clone()
    first[:, 20:], second[:, :20] = False, False
    nothing = torch.zeros_like(everything)
    merged_out, merged_lse = merge_partials([dense(q, k, v, first), dense(q, k, v, second), dense(q, k, v, nothing)])
    whole_out, whole_lse = dense(q, k, v, everything)
    assert torch.allclose(merged_out, whole_out) and torch.allclose(merged_lse, whole_lse)


def test_flex_forward_matches_cpu_kernels():
    """Flex attention's backward runs only on GPUs (scripts/gpu_check.sh); its forward runs eagerly here."""
    q, k, v, _, _ = case(n=32, m=32)
    flex, cpu = FlexKernels(compile=False), CPUKernels(8)
    limits, key_positions = (torch.arange(32) // 8) * 8, torch.arange(32)
    for name, args in [("block_diagonal_forward", (q, k, v, 8, SCALE)), ("prefix_forward", (q, k, v, None, SCALE))]:
        flex_args, cpu_args = list(args), list(args)
        if name == "prefix_forward":
            flex_args[3], cpu_args[3] = flex.plan(limits, key_positions), cpu.plan(limits, key_positions)
        (flex_out, flex_lse), (cpu_out, cpu_lse) = getattr(flex, name)(*flex_args), getattr(cpu, name)(*cpu_args)
        finite = ~torch.isinf(cpu_lse)
        assert torch.allclose(flex_out, cpu_out, atol=1e-5), name
        assert torch.equal(torch.isinf(flex_lse), ~finite) and torch.allclose(flex_lse[finite], cpu_lse[finite], atol=1e-5)


def bdlm_case(seq_length=40, block=8, rows=None, keys=None, seed=1):
    """Rows and keys of `[x_t ; x_0]` in any order (position, clean copy?), with the reference's visibility."""
    from attention_reference import bdlm_mask

    gen = torch.Generator().manual_seed(seed)
    everything = torch.arange(2 * seq_length)
    rows = everything[torch.randperm(2 * seq_length, generator=gen)[:30]] if rows is None else rows
    keys = everything if keys is None else keys
    position, clean = (lambda i: i % seq_length), (lambda i: i >= seq_length)
    visible = bdlm_mask(seq_length, block)[rows][:, keys]
    return (position(rows), clean(rows), position(keys), clean(keys)), visible


@pytest.mark.parametrize("tile", [4, 7, 16, 128])
def test_masked_forward_and_backward_match_masked_softmax(tile):
    """The masked kernel on scattered rows against all keys, and against a part of the keys (a streamed ring step,
    where some rows see nothing): exact output, LSE and gradients; its work counts the mask's pairs exactly."""
    for keys in (None, torch.arange(20, 60)):
        (qp, qc, kp, kc), visible = bdlm_case(keys=keys)
        gen = torch.Generator().manual_seed(2)
        q = torch.randn(2, 2, 3, qp.numel(), 8, generator=gen)
        k, v = (torch.randn(2, 2, kp.numel(), 8, generator=gen) for _ in range(2))
        kernels = CPUKernels(masked_tile=tile)
        plan = kernels.masked_plan(qp, qc, kp, kc, 8)
        out, lse = kernels.masked_forward(q, k, v, plan, SCALE)
        ref_in = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = dense(*ref_in, visible)
        assert torch.allclose(out.double(), ref_out, atol=1e-6)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        assert torch.allclose(lse[~torch.isinf(lse)].double(), ref_lse[~torch.isinf(ref_lse)], atol=1e-5)
        dout = torch.randn_like(out)
        (ref_out * dout.double()).sum().backward()
        for grad, ref in zip(kernels.masked_backward(dout, q, k, v, out, lse, plan, SCALE), ref_in):
            assert torch.allclose(grad.double(), ref.grad, atol=1e-5)
        real, computed = plan.work()
        assert real == int(visible.sum())
        whole_rows, whole_keys = visible.shape[0] // tile, visible.shape[1] // tile
        tiles = visible[:whole_rows * tile, :whole_keys * tile].reshape(whole_rows, tile, whole_keys, tile)
        hidden_tiles = int((~tiles.any(3).any(1)).sum())
        assert computed <= visible.numel() - hidden_tiles * tile * tile  # hidden whole tiles are never computed
        assert computed >= real


def test_flex_masked_forward_matches_cpu_masked_kernel():
    """Flex with the BDLM block mask (eager on the CPU, forward) equals the CPU masked kernel."""
    (qp, qc, kp, kc), visible = bdlm_case(rows=torch.arange(16, 48), keys=torch.arange(80))
    q = torch.randn(1, 2, 2, 32, 8)
    k, v = torch.randn(1, 2, 80, 8), torch.randn(1, 2, 80, 8)
    flex, cpu = FlexKernels(compile=False, masked_tile=16), CPUKernels(masked_tile=16)
    flex_out, flex_lse = flex.masked_forward(q, k, v, flex.masked_plan(qp, qc, kp, kc, 8), SCALE)
    cpu_out, cpu_lse = cpu.masked_forward(q, k, v, cpu.masked_plan(qp, qc, kp, kc, 8), SCALE)
    ref_out, _ = dense(q, k, v, visible)
    assert torch.allclose(flex_out.double(), ref_out, atol=1e-5) and torch.allclose(cpu_out, flex_out, atol=1e-5)
    assert torch.allclose(flex_lse, cpu_lse.to(flex_lse.dtype), atol=1e-5)


# (L, B, P, C) of every mode's layouts: chunks and tiles that do and do not align, replicated rings, odd blocks.
GEOMETRIES = [(64, 8, 2, 2), (256, 16, 4, 4), (256, 16, 4, 2), (72, 8, 2, 2), (1024, 32, 2, 2), (192, 16, 4, 1)]


@pytest.mark.parametrize("tile", [16, 24, 128])
def test_modes_kernel_calls_equal_what_the_plans_count(tile):
    """Each mode's analytic `kernel_calls` (stdlib) equals the figures counted off the kernels' own plans (masks
    and tiles) of every rank; the figures at another tile differ from the plans' (negative control: somewhere for
    every mode, so the equality is not blind to the tile)."""
    from megatron_csbp.core import modes, ops
    from megatron_csbp.core.layout import layout_for
    from megatron_csbp.core.schedule import ZIGZAG

    checked, differs = set(), set()
    for L, B, P, C in GEOMETRIES:
        for name, mode in modes.PARALLEL_MODES.items():
            c = mode.clean_shards(P, C if name == "csbp" else None)
            if mode.geometry_problem(L, B, P, c, ZIGZAG, modes_flags()) or (name == "bp" and C != 1) \
                    or (name != "bp" and C == 1):
                continue
            for rank in range(P):
                layout = layout_for(mode, L, B, P, c, rank)
                counted = ops.ring_plan(layout, "cpu", CPUKernels(tile=tile, masked_tile=tile)).kernel_calls()
                assert mode.kernel_calls(L, B, P, c, rank, tile) == counted, (name, L, B, P, C, rank)
                if mode.kernel_calls(L, B, P, c, rank, tile + 8) != counted:
                    differs.add(name)
                streamed = ops.ring_plan(layout, "cpu", CPUKernels(tile=tile, masked_tile=tile)).kernel_calls(
                    per_member=True)  # one remote call per ring member: the same real pairs in all
                assert len(streamed) == len(counted) - 1 + c
                assert sum(call.real_pairs for call in streamed) == sum(call.real_pairs for call in counted)
                checked.add(name)
    assert checked == differs == set(modes.PARALLEL_MODES)


def modes_flags():
    from megatron_csbp.core import rules

    return rules.FLAGS


def test_field_cp_computes_more_pairs_than_csbp_at_equal_real_pairs():
    """At flex's tile (128) and B = 64, the masked call computes whole tiles around each block's diagonal, CSBP's
    dense blocks none: the real pairs of a rank agree between cp and cp-traffic, the computed ones do not."""
    from megatron_csbp.core import modes

    assert [name for name, mode in modes.PARALLEL_MODES.items() if mode.is_baseline] == ["cp"]  # the field's CP
    assert modes.parallel_mode("cp").masked_attention and not modes.parallel_mode("cp-traffic").masked_attention
    cp = modes.parallel_mode("cp").kernel_calls(4096, 64, 2, 2, 0, 128)
    traffic = modes.parallel_mode("cp-traffic").kernel_calls(4096, 64, 2, 2, 0, 128)
    assert sum(c.real_pairs for c in cp) == sum(c.real_pairs for c in traffic)
    assert [c.kind for c in cp] == ["masked"] and [c.kind for c in traffic] == ["dense", "prefix"]
    assert cp[0].computed_pairs > cp[0].real_pairs


def test_flex_masked_backward_around_a_dense_stand_in_matches_the_reference():
    """Flex has no CPU backward: FlexKernels' own masked backward (recompute under autograd, the LSE-merge
    gradient) runs here around gpu_check's dense stand-in for the fused kernel, on a streamed ring step's keys
    (some rows see none of them), against the fp64 reference."""
    from megatron_csbp.tools.gpu_check import DenseFlexStandIn

    (qp, qc, kp, kc), visible = bdlm_case(keys=torch.arange(20, 60))
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 2, qp.numel(), 8, generator=gen)
    k, v = (torch.randn(1, 2, kp.numel(), 8, generator=gen) for _ in range(2))
    flex = FlexKernels(compile=False, masked_tile=16)
    flex._flex = DenseFlexStandIn()
    plan = flex.masked_plan(qp, qc, kp, kc, 8)
    out, lse = flex.masked_forward(q, k, v, plan, SCALE)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = dense(*ref_in, visible)
    assert torch.allclose(out.double(), ref_out, atol=1e-6)
    dout = torch.randn_like(out)
    (ref_out * dout.double()).sum().backward()
    for grad, ref in zip(flex.masked_backward(dout, q, k, v, out, lse, plan, SCALE), ref_in):
        assert torch.allclose(grad.double(), ref.grad, atol=1e-5)
