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
