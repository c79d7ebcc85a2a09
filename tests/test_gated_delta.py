"""The Gated DeltaNet core under block diffusion (`core/gated_delta.py`), against references that share no code.

* The torch chunked rule equals transformers' token-by-token recurrence, with an initial state.
* On one rank, every row equals a per-token reference: the clean stream is transformers' recurrence (and a
  causal convolution) over `x0`; noisy block `b` is the same run over `x0[:bB] ; xt[block b]`, last `B` outputs.
* On 2 and 4 gloo ranks (CSBP P=C=2, zigzag and contiguous; CP2; BP2; P=4 C=2; CSBP4) every row and every input
  gradient equals one rank's, <= 1e-5; the bytes each rank sends equal the plan's count and the formula.
  Controls: noisy blocks started from a zero state, and chunk states taken from the wrong chunk, miss.
"""

import dataclasses

import torch
import torch.nn.functional as F

from spawn import run_ranks

L, B, KEY_HEADS, VALUE_HEADS, DK, DV, WIDTH, BATCH = 32, 4, 2, 4, 8, 6, 4, 2
CHANNELS = 2 * KEY_HEADS * DK + VALUE_HEADS * DV
TOLERANCE = 1e-5


def _inputs(seed=0):
    """Both copies' pre-convolution rows, log decays and write strengths `[b, L, ...]`, and a convolution."""
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    return dict(x0=torch.randn(BATCH, L, CHANNELS, generator=generator, dtype=torch.float64),
                xt=torch.randn(BATCH, L, CHANNELS, generator=generator, dtype=torch.float64),
                g0=-rand(BATCH, L, VALUE_HEADS), gt=-rand(BATCH, L, VALUE_HEADS),
                b0=rand(BATCH, L, VALUE_HEADS), bt=rand(BATCH, L, VALUE_HEADS),
                weight=0.5 * torch.randn(CHANNELS, WIDTH, generator=generator, dtype=torch.float64),
                probe=torch.randn(2, BATCH, L, VALUE_HEADS, DV, generator=generator, dtype=torch.float64))


def _transformers_run(x, g, beta, weight):
    """transformers' causal convolution and token-by-token recurrence over `x [b, T, channels]`."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, torch_recurrent_gated_delta_rule

    tokens = x.shape[1]
    mixed = causal_conv1d_fn(x.transpose(1, 2), weight, activation="silu").transpose(1, 2)
    q, k, v = mixed.split([KEY_HEADS * DK, KEY_HEADS * DK, VALUE_HEADS * DV], -1)
    q, k = (t.reshape(BATCH, tokens, KEY_HEADS, DK) for t in (q, k))
    out, _ = torch_recurrent_gated_delta_rule(q, k, v.reshape(BATCH, tokens, VALUE_HEADS, DV), g, beta,
                                              use_qk_l2norm_in_kernel=True)
    return out


def _per_block_reference(inputs):
    """(noisy rows, clean rows) by position, each noisy block run after the clean tokens before it."""
    x0, xt, g0, gt, b0, bt, weight = (inputs[name] for name in ("x0", "xt", "g0", "gt", "b0", "bt", "weight"))
    clean = _transformers_run(x0, g0, b0, weight)
    noisy = torch.zeros_like(clean)
    for start in range(0, L, B):
        stop = start + B
        run = _transformers_run(torch.cat([x0[:, :start], xt[:, start:stop]], 1),
                                torch.cat([g0[:, :start], gt[:, start:stop]], 1),
                                torch.cat([b0[:, :start], bt[:, start:stop]], 1), weight)
        noisy[:, start:stop] = run[:, start:stop]
    return noisy, clean


def _rows(layout, noisy, clean):
    return torch.cat([noisy[:, layout.noisy_positions], clean[:, layout.clean_positions]], 1)


def _run(layout, inputs, group=None, plan=None):
    """The op over `layout`'s rows (fp32) and its gradients: (rows out, {input: gradient rows}, weight grad,
    (bytes sent forward, backward))."""
    from megatron_csbp.core import comm
    from megatron_csbp.core.gated_delta import gated_delta_block_diffusion

    leaves = {name: _rows(layout, inputs[noisy], inputs[clean]).float().requires_grad_()
              for name, noisy, clean in (("x", "xt", "x0"), ("g", "gt", "g0"), ("beta", "bt", "b0"))}
    weight = inputs["weight"].float().requires_grad_()
    with comm.count_bytes() as forward:
        out = gated_delta_block_diffusion(leaves["x"], leaves["g"], leaves["beta"], weight, None, F.silu,
                                          KEY_HEADS, DK, layout, group=group, plan=plan)
    probe = _rows(layout, inputs["probe"][0], inputs["probe"][1]).float()
    if layout.ring_index:  # clean rows count once: on the first ring
        probe[:, layout.num_noisy_rows:] = 0
    with comm.count_bytes() as backward:
        (out * probe).sum().backward()
    return (out.detach(), {name: leaf.grad for name, leaf in leaves.items()}, weight.grad,
            (forward.bytes_sent, backward.bytes_sent))


def test_chunked_rule_equals_the_recurrence():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    from megatron_csbp.core.kernels.gated_delta import l2norm, torch_chunk_rule

    generator = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 37, 3, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 37, 3, 6, generator=generator, dtype=torch.float64)
    g, beta = -2 * torch.rand(2, 37, 3, generator=generator), torch.rand(2, 37, 3, generator=generator)
    state = torch.randn(2, 3, 8, 6, generator=generator)
    expected, expected_state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    for chunk in (4, 16, 64):
        out, final = torch_chunk_rule(l2norm(q), l2norm(k), v, g, beta, state, chunk=chunk)
        assert (out - expected).abs().max() < 1e-5 and (final - expected_state).abs().max() < 1e-5, chunk


def test_one_rank_equals_the_per_block_reference():
    from megatron_csbp.core.layout import CSBPLayout

    inputs = _inputs()
    noisy, clean = _per_block_reference(inputs)
    for layout in (CSBPLayout(L, B, 1, 1), CSBPLayout(L, B, 1, 1, clean_layout="contiguous"),
                   CSBPLayout(L, B, 2, 1, rank=1)):
        out = _run(layout, inputs)[0]
        error = (out - _rows(layout, noisy, clean)).abs().max().item()
        print(f"{layout.block_parallel_size} ranks, rank {layout.rank}: max error {error:.2e} vs transformers")
        assert error < TOLERANCE
    # control: the noisy blocks are not the clean stream (the reference tells them apart)
    assert (noisy - clean)[:, B:].abs().max() > 1e-2


CASES_2 = [("csbp", 2, 2, "zigzag"), ("csbp", 2, 2, "contiguous"), ("cp", 2, 2, None), ("bp", 2, 1, "zigzag")]
CASES_4 = [("csbp", 4, 2, "zigzag"), ("csbp", 4, 4, "zigzag"), ("cp", 4, 4, None)]
CONTROLS = ("zero noisy state", "state of the wrong chunk")


def _layout(mode, P, C, clean_layout, rank):
    from megatron_csbp.core.layout import layout_for

    return layout_for(mode, L, B, P, C, rank, **({"clean_layout": clean_layout} if clean_layout else {}))


def _control_plan(layout, control):
    from megatron_csbp.core.gated_delta import gated_delta_plan

    plan = gated_delta_plan(layout, WIDTH)
    if control == "zero noisy state":
        return dataclasses.replace(plan, noisy_states=(0,) * len(plan.noisy_states))
    return dataclasses.replace(plan, mine=tuple(reversed(plan.mine)) if len(plan.mine) > 1 else
                               ((plan.mine[0] + 1) % (plan.members * plan.chunks_per_member),))


def _distributed(rank, world_size, cases):
    from megatron_csbp.core.gated_delta import gated_delta_plan
    from megatron_csbp.core.process_groups import new_block_parallel_groups, ring_group_of

    inputs, results = _inputs(), []
    for mode, P, C, clean_layout in cases:
        layout = _layout(mode, P, C, clean_layout, rank)
        groups = new_block_parallel_groups([list(range(world_size))], layout.clean_shards)
        ring = ring_group_of(groups, layout)
        out, grads, weight_grad, sent = _run(layout, inputs, ring)
        torch.distributed.all_reduce(weight_grad)
        if groups.clean_replica is not None:  # a clean row's gradient: the sum over its replicas (one per ring)
            for grad in grads.values():
                clean = grad[:, layout.num_noisy_rows:].contiguous()
                torch.distributed.all_reduce(clean, group=groups.clean_replica)
                grad[:, layout.num_noisy_rows:] = clean
        plan = gated_delta_plan(layout, WIDTH)
        member = layout.ring_ranks.index(layout.rank)
        expected = plan.bytes_sent(member, BATCH, VALUE_HEADS, DK, DV, CHANNELS, 4)
        controls = {control: _run(layout, inputs, ring, _control_plan(layout, control))[0] for control in CONTROLS}
        results.append(dict(out=out, grads=grads, weight_grad=weight_grad, bytes=sent, expected_bytes=expected,
                            controls=controls,
                            noisy=layout.noisy_positions, clean=layout.clean_positions, ring_index=layout.ring_index))
    return results


def _check(world_size, cases):
    from megatron_csbp.core.layout import CSBPLayout

    inputs = _inputs()
    reference_layout = CSBPLayout(L, B, 1, 1)
    out_ref, grads_ref, weight_ref, _ = _run(reference_layout, inputs)
    by_position = lambda rows: (rows[:, :L][:, torch.argsort(reference_layout.noisy_positions)],  # noqa: E731
                                rows[:, L:][:, torch.argsort(reference_layout.clean_positions)])
    out_ref = by_position(out_ref)
    grads_ref = {name: by_position(grad) for name, grad in grads_ref.items()}
    results = run_ranks(_distributed, world_size, cases, timeout=600)
    for index, case in enumerate(cases):
        worst, misses = 0.0, {control: 0.0 for control in CONTROLS}
        for result in (per_rank[index] for per_rank in results):
            n = result["noisy"].numel()
            relative = lambda got, want: ((got - want).norm() / want.norm()).item()  # noqa: E731
            worst = max(worst, relative(result["out"][:, :n], out_ref[0][:, result["noisy"]]),
                        relative(result["out"][:, n:], out_ref[1][:, result["clean"]]),
                        relative(result["weight_grad"], weight_ref))
            for name, grad in result["grads"].items():
                worst = max(worst, relative(grad[:, :n], grads_ref[name][0][:, result["noisy"]]))
                if result["ring_index"] == 0:
                    worst = max(worst, relative(grad[:, n:], grads_ref[name][1][:, result["clean"]]))
            for control, out in result["controls"].items():
                misses[control] = max(misses[control], relative(out[:, :n], out_ref[0][:, result["noisy"]]),
                                      relative(out[:, n:], out_ref[1][:, result["clean"]]))
            assert result["bytes"] == result["expected_bytes"], (case, result["bytes"], result["expected_bytes"])
        sent = [per_rank[index]["bytes"] for per_rank in results]
        print(f"{case}: worst relative error {worst:.2e}; controls miss by "
              + ", ".join(f"{control} {miss:.2e}" for control, miss in misses.items())
              + f"; bytes sent per rank (forward, backward) {sent}")
        assert worst <= TOLERANCE, case
        for control, miss in misses.items():
            assert miss > 1e-2, (case, control, miss)


def test_two_ranks_equal_one():
    _check(2, CASES_2)


def test_four_ranks_equal_one():
    _check(4, CASES_4)


def test_bytes_per_rank_equal_the_hand_count_on_csbp2():
    """CSBP P=C=2, zigzag, L=32, B=4 (blocks 0..7): rank 0 holds clean blocks 0,1 and 6,7 and noisy blocks 0,1,6,7;
    rank 1 clean blocks 2..5 and noisy 2..5. Rank 0's noisy block 6 (and its chunk starting at block 6) needs clean
    block 5 (rank 1's): one state and one convolution history from rank 1; rank 1's noisy block 2 (and its chunk
    starting at 2) needs block 1 (rank 0's): one of each from rank 0. Each also sends its two chunks' maps. So each
    rank sends, forward and backward alike, one history `b (W-1) channels`, one state `b Hv dk dv` and two maps
    `b Hv dk (dk+dv)`, fp32; the op's counters equal the plan's count (`_check`), which equals this."""
    from megatron_csbp.core.gated_delta import gated_delta_plan

    history, state, chunk_map = BATCH * (WIDTH - 1) * CHANNELS * 4, BATCH * VALUE_HEADS * DK * DV * 4, \
        BATCH * VALUE_HEADS * DK * (DK + DV) * 4
    by_hand = history + state + 2 * chunk_map
    assert by_hand == 1344 + 1536 + 2 * 3584 == 10048
    for rank in range(2):
        layout = _layout("csbp", 2, 2, "zigzag", rank)
        assert gated_delta_plan(layout, WIDTH).bytes_sent(rank, BATCH, VALUE_HEADS, DK, DV, CHANNELS, 4) == (
            by_hand, by_hand)
