"""CSBP attention as a differentiable op, and the two baselines through the same function.

`context_sharded_block_attention` takes this rank's rows `[noisy ; clean]` of `[x_t ; x_0]` in the
layout's order and returns their attention output. What travels is what the layout transports
(`layout.first_transported_row`):
* `CSBPLayout` (C > 1): only the clean K/V of the ring, `L` tokens; noisy K/V never leave the rank.
* `CSBPLayout` with C = 1 (pure block parallelism): nothing; every rank holds the clean sequence.
* `CPLayout` (conventional CP baseline): all `2L` tokens' K/V, as ring-CP would move them.

Two transports, each a forward and a backward function over heads-first tensors:
* "collective" (`collective_forward/backward`): an all-gather of the transported K/V, overlapped with the
  local noisy attention; backward reduce-scatters their gradients, overlapped with the local noisy backward.
* "streaming" (`streaming_forward/backward`): shards passed around the ring point to point; the forward
  folds each step's partial result into one running output (online softmax, fp32), so it holds the
  shard it attends to, the one being received and the running output; backward circulates K/V with
  dK/dV accumulators so each owner ends with the full sum.
The backward is exact: each part is differentiated against the final merged output and LSE.

What a (layout, device) fixes once — which rows of each ring member are clean keys, in position order,
and the kernels' plans over them — is a `RingPlan` (`ring_plan(layout, device)`), built once by the
caller and shared by every layer and the backward; calls without one use a small cache.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch

from megatron_csbp.core import comm, rules
from megatron_csbp.core.kernels import default_kernels, default_scale, merge_into, merge_partials, running_merge
from megatron_csbp.core.process_groups import ring_group_of

PLAN_CACHE_SIZE = 8  # (layout, device) plans kept for callers that do not hold their own


@dataclass(frozen=True, eq=False)
class RingPlan:
    """Where the transported rows of each ring member sit, which of them are clean keys, and the kernels'
    plans of this rank's rows against them: for the all-gathered keys and for each member's shard."""

    layout: object
    device: torch.device
    kernels: object                    # the kernel family the plans were made for
    query_limits: torch.Tensor         # per local row: clean keys below this position are visible
    shard_clean_rows: tuple            # per ring member: indices of its clean rows in its shard, by position
    gathered_clean_rows: torch.Tensor  # indices into the all-gathered buffer of all clean rows, by position
    # (either is None where its rows are all the buffer's, in order: the buffer is then read in place)
    gathered: object                   # the kernels' plan against all clean keys (collective)
    members: tuple                     # the kernels' plan against each member's clean keys (streaming)


def ring_plan(layout, device, kernels=None) -> RingPlan:
    """The plan of `layout` on `device` for `kernels` (the device's default): build it once, pass it as `plan=`."""
    device = torch.device(device)
    kernels = default_kernels(device) if kernels is None else kernels
    block = layout.block_size
    limits = (torch.div(layout.row_positions, block, rounding_mode="floor") + layout.row_is_clean.long()) * block
    limits = limits.to(device)
    shard_rows, shard_positions, gathered_rows, gathered_positions = [], [], [], []
    offset = 0
    for ring_rank in range(layout.clean_shards):
        member = layout.for_rank(layout.ring_index * layout.clean_shards + ring_rank)
        first = member.first_transported_row
        positions, clean = member.row_positions[first:], member.row_is_clean[first:]
        clean_rows = torch.nonzero(clean).flatten()
        order = torch.argsort(positions[clean_rows], stable=True)
        shard_rows.append(_indices_or_all(clean_rows[order], positions.numel(), device))
        shard_positions.append(positions[clean_rows][order].to(device))
        gathered_rows.append(clean_rows + offset)
        gathered_positions.append(positions[clean_rows])
        offset += positions.numel()
    gathered_rows, gathered_positions = torch.cat(gathered_rows), torch.cat(gathered_positions)
    order = torch.argsort(gathered_positions, stable=True)
    return RingPlan(layout, device, kernels, limits, tuple(shard_rows),
                    _indices_or_all(gathered_rows[order], offset, device),
                    kernels.plan(limits, gathered_positions[order].to(device)),
                    tuple(kernels.plan(limits, positions) for positions in shard_positions))


def _indices_or_all(rows, total, device):
    """`rows` on `device`, or None where they are `0..total-1` in order (a CSBP shard: clean rows only, sorted)."""
    return None if torch.equal(rows, torch.arange(total)) else rows.to(device)


_plans: "OrderedDict[tuple, RingPlan]" = OrderedDict()


def _cached_plan(layout, device) -> RingPlan:
    """The last `PLAN_CACHE_SIZE` plans by (layout, device); one is rebuilt when the device's kernels were
    replaced since it was made (tests and scripts/gpu_check.py swap them)."""
    kernels = default_kernels(device)
    plan = _plans.pop((layout, device), None)
    if plan is None or plan.kernels is not kernels:
        plan = ring_plan(layout, device, kernels)
    _plans[layout, device] = plan
    while len(_plans) > PLAN_CACHE_SIZE:
        _plans.popitem(last=False)
    return plan


def _heads_first(x, kv_heads):
    """`[s, b, heads, d]` -> `[b, kv_heads, group, s, d]`."""
    s, b, heads, d = x.shape
    return x.permute(1, 2, 0, 3).reshape(b, kv_heads, heads // kv_heads, s, d)


def _rows_first(x):
    """`[b, kv_heads, group, s, d]` -> `[s, b, heads, d]`."""
    b, kv_heads, group, s, d = x.shape
    return x.reshape(b, kv_heads * group, s, d).permute(2, 0, 1, 3)


def _sent(k, v, layout):
    """This rank's transported rows of heads-first K and V as one `[s, 2, b, kv_heads, d]` tensor to send."""
    first = layout.first_transported_row
    return torch.stack([k.permute(2, 0, 1, 3)[first:], v.permute(2, 0, 1, 3)[first:]], dim=1)


def _unpack(packed, rows):
    """Rows `rows` (None: all, in order, read in place) of a packed buffer -> K and V as `[b, kv_heads, n, d]`."""
    picked = packed if rows is None else packed.index_select(0, rows)
    return picked[:, 0].permute(1, 2, 0, 3), picked[:, 1].permute(1, 2, 0, 3)


def _repack(dk, dv, rows, total):
    """Gradients of K and V for `rows` (None: all, in order) of a packed buffer of `total` rows, zero elsewhere."""
    stacked = torch.stack([dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)], dim=1)
    if rows is None:
        return stacked
    return stacked.new_zeros((total,) + stacked.shape[1:]).index_copy_(0, rows, stacked)


def _ring_order(layout):
    """Ring positions of the shards this rank holds at each streaming step: its own, then its predecessors'."""
    return [(layout.ring_rank - step) % layout.clean_shards for step in range(layout.clean_shards)]


def _noisy_forward(plan, q, k, v, scale):
    """The local block-diagonal part: noisy rows against the noisy rows of their own block."""
    n = plan.layout.num_noisy_rows
    return plan.kernels.block_diagonal_forward(q[:, :, :, :n], k[:, :, :n], v[:, :, :n], plan.layout.block_size,
                                               scale)


def _with_noisy(noisy_part, prefix, layout):
    """The prefix part of every row, with the noisy rows' block-diagonal part merged in."""
    n = layout.num_noisy_rows
    out, lse = prefix
    noisy_out, noisy_lse = merge_partials([noisy_part, (out[:, :, :, :n], lse[:, :, :, :n])])
    return torch.cat([noisy_out, out[:, :, :, n:]], dim=3), torch.cat([noisy_lse, lse[:, :, :, n:]], dim=3)


def _noisy_backward(plan, dout, q, k, v, out, lse, scale):
    n = plan.layout.num_noisy_rows
    return plan.kernels.block_diagonal_backward(dout[:, :, :, :n], q[:, :, :, :n], k[:, :, :n], v[:, :, :n],
                                                out[:, :, :, :n], lse[:, :, :, :n], plan.layout.block_size, scale)


def _local_grads(dq, noisy_grads, d_sent, k, v, layout):
    """This rank's dQ, dK, dV: the prefix dQ plus the noisy part's, the sent rows' dK/dV summed over the ring."""
    n, first = layout.num_noisy_rows, layout.first_transported_row
    dq_noisy, dk_noisy, dv_noisy = noisy_grads
    dq[:, :, :, :n] += dq_noisy
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk[:, :, :n] += dk_noisy
    dv[:, :, :n] += dv_noisy
    dk[:, :, first:] += d_sent[:, 0].permute(1, 2, 0, 3)
    dv[:, :, first:] += d_sent[:, 1].permute(1, 2, 0, 3)
    return dq, dk, dv


def collective_forward(q, k, v, ring, plan, scale):
    """All-gathers the ring's transported K/V while the local noisy attention runs, then attends to all clean
    keys at once. `q [b, kv_heads, group, s, d]`, `k, v [b, kv_heads, s, d]` -> `(out, lse, (gathered,))`:
    the gathered buffer is what the backward needs besides the inputs."""
    sent = _sent(k, v, plan.layout)
    gathered, work = comm.all_gather_start(sent, ring) if ring is not None else (sent, None)
    noisy_part = _noisy_forward(plan, q, k, v, scale)
    comm.wait_all(work or [], "forward: clean K/V all-gather", ring)
    clean_k, clean_v = _unpack(gathered, plan.gathered_clean_rows)
    prefix = plan.kernels.prefix_forward(q, clean_k, clean_v, plan.gathered, scale)
    return (*_with_noisy(noisy_part, prefix, plan.layout), (gathered,))


def collective_backward(dout, q, k, v, out, lse, saved, ring, plan, scale):
    """The prefix backward against the gathered keys, whose dK/dV are reduce-scattered to their owners while the
    local noisy backward runs -> `(dq, dk, dv)`."""
    gathered, = saved
    clean_k, clean_v = _unpack(gathered, plan.gathered_clean_rows)
    dq, dk_clean, dv_clean = plan.kernels.prefix_backward(dout, q, clean_k, clean_v, out, lse, plan.gathered, scale)
    d_gathered = _repack(dk_clean, dv_clean, plan.gathered_clean_rows, gathered.shape[0])
    d_sent, work = comm.reduce_scatter_start(d_gathered, ring) if ring is not None else (d_gathered, None)
    noisy_grads = _noisy_backward(plan, dout, q, k, v, out, lse, scale)
    comm.wait_all(work or [], "backward: clean dK/dV reduce-scatter", ring)
    return _local_grads(dq, noisy_grads, d_sent, k, v, plan.layout)


def streaming_forward(q, k, v, ring, plan, scale):
    """Passes the transported K/V around the ring: at each step this rank attends to the shard it holds while
    the next one arrives, and folds that partial result into one running `(out, lse)` in fp32 (or wider).
    It holds the shard, the one being received and the running output, besides the step's partial until it
    is folded in. Same shapes as `collective_forward`; keeps nothing for the backward: `(out, lse, ())`."""
    members = _ring_order(plan.layout)
    noisy_part = _noisy_forward(plan, q, k, v, scale)
    shard, running = _sent(k, v, plan.layout), None
    for step, member in enumerate(members):
        received, works = comm.ring_shift_start(shard, ring) if step < len(members) - 1 else (None, [])
        shard_k, shard_v = _unpack(shard, plan.shard_clean_rows[member])
        part = plan.kernels.prefix_forward(q, shard_k, shard_v, plan.members[member], scale)
        del shard_k, shard_v
        running = running_merge(part) if running is None else merge_into(running, part)
        del part
        comm.wait_all(works, "forward: clean K/V ring shift", ring)
        shard = received
    out, lse = running
    return (*_with_noisy(noisy_part, (out.to(q.dtype), lse), plan.layout), ())


def streaming_backward(dout, q, k, v, out, lse, saved, ring, plan, scale):
    """K/V go around the ring again; each step's dK/dV travel one step behind, accumulated, so that after the
    last shift every owner holds the full sum for its shard -> `(dq, dk, dv)`."""
    members = _ring_order(plan.layout)
    dq = d_sent = traveling = None  # each a fresh tensor of ours once set, so summed into in place
    shard = _sent(k, v, plan.layout)
    for step, member in enumerate(members):
        last = step == len(members) - 1
        received, kv_works = comm.ring_shift_start(shard, ring) if not last else (None, [])
        shard_rows = plan.shard_clean_rows[member]
        shard_k, shard_v = _unpack(shard, shard_rows)
        part_dq, part_dk, part_dv = plan.kernels.prefix_backward(dout, q, shard_k, shard_v, out, lse,
                                                                 plan.members[member], scale)
        del shard_k, shard_v
        dq = part_dq if dq is None else dq.add_(part_dq)
        contribution = _repack(part_dk, part_dv, shard_rows, shard.shape[0])
        del part_dq, part_dk, part_dv
        if step == 0:
            d_sent = contribution
        else:
            traveling = contribution if traveling is None else traveling.add_(contribution)
            del contribution
            traveling, acc_works = comm.ring_shift_start(traveling, ring)
            comm.wait_all(acc_works, "backward: clean dK/dV ring shift", ring)
        comm.wait_all(kv_works, "backward: clean K/V ring shift", ring)
        shard = received
    if traveling is not None:
        d_sent.add_(traveling)
    noisy_grads = _noisy_backward(plan, dout, q, k, v, out, lse, scale)
    return _local_grads(dq, noisy_grads, d_sent, k, v, plan.layout)


_TRANSPORTS = {"collective": (collective_forward, collective_backward),
               "streaming": (streaming_forward, streaming_backward)}
assert tuple(_TRANSPORTS) == rules.TRANSPORTS, "every transport rules.py offers has its functions here"


class _ContextShardedBlockAttention(torch.autograd.Function):
    """Turns the rows-first tensors heads-first, saves what the transport's backward needs and calls it."""

    @staticmethod
    def forward(ctx, query, key, value, ring, scale, transport, plan):
        q, k, v = _heads_first(query, key.shape[2]), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        out, lse, saved = _TRANSPORTS[transport][0](q, k, v, ring, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse, *saved)
        ctx.ring, ctx.scale, ctx.transport, ctx.plan = ring, scale, transport, plan
        return _rows_first(out).flatten(2)

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        dout = _heads_first(grad_output.view(grad_output.shape[:2] + (-1, q.shape[-1])), q.shape[1])
        dq, dk, dv = _TRANSPORTS[ctx.transport][1](dout, q, k, v, out, lse, saved, ctx.ring, ctx.plan, ctx.scale)
        return _rows_first(dq), dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3), None, None, None, None


def context_sharded_block_attention(query, key, value, layout, group=None, softmax_scale=None,
                                    transport="collective", plan=None):
    """BDLM attention of this rank's rows; `[s, b, heads, d]` queries, `[s, b, kv_heads, d]` K/V -> `[s, b, heads·d]`.

    `group` is the block-parallel group (ranks in layout order), or a `BlockParallelGroups` when the
    layout has several rings. The same call runs the conventional-CP baseline for a `CPLayout` and pure
    block parallelism for a layout with `clean_shards == 1`. `plan`: `ring_plan(layout, query.device)`,
    built once by the caller (default: a small cache by layout and device).
    """
    rules.refuse(rules.choice_problem("--csbp-transport", transport, rules.TRANSPORTS))
    if query.shape[0] != layout.num_rows or key.shape[0] != layout.num_rows or value.shape != key.shape:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} must "
                         f"hold this rank's {layout.num_rows} rows ([s, b, heads, d]) of the layout")
    if query.shape[2] % key.shape[2] or query.shape[3] != key.shape[3]:
        raise ValueError(f"{query.shape[2]} query heads cannot share {key.shape[2]} K/V heads of the same size")
    if plan is None:
        plan = _cached_plan(layout, query.device)
    elif plan.layout != layout or plan.device != query.device:
        raise ValueError(f"plan was built for {plan.layout} on {plan.device}, not for this call's {layout} on "
                         f"{query.device}: pass plan=ring_plan(layout, device) of the layout and device it runs")
    ring = ring_group_of(group, layout)
    scale = default_scale(query.shape[-1]) if softmax_scale is None else softmax_scale
    return _ContextShardedBlockAttention.apply(query, key, value, ring, scale, transport, plan)
