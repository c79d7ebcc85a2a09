"""CSBP attention as a differentiable op, and the two baselines through the same function.

`context_sharded_block_attention` takes this rank's rows `[noisy ; clean]` of `[x_t ; x_0]` in the
layout's order and returns their attention output. What travels depends on the layout:
* `CSBPLayout` (C > 1): only the clean K/V of the ring, `L` tokens; noisy K/V never leave the rank.
* `CSBPLayout` with C = 1 (pure block parallelism): nothing; every rank holds the clean sequence.
* `CPLayout` (conventional CP baseline): all `2L` tokens' K/V, as ring-CP would move them.

Two transports: "collective" (all-gather of the transported K/V, overlapped with the local noisy
attention; backward reduce-scatters their gradients, overlapped with the local noisy backward) and
"streaming" (shards passed around the ring point to point, at most three held at once; backward
circulates K/V with dK/dV accumulators so each owner ends with the full sum).
The backward is exact: each part is differentiated against the final merged output and LSE.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch

from megatron_csbp import comm, rules
from megatron_csbp.kernels import default_kernels, default_scale, merge_partials
from megatron_csbp.layout import CPLayout
from megatron_csbp.process_groups import ring_group_of



@dataclass(frozen=True)
class _RingRows:
    """Where the transported rows of each ring member sit, and which of them are clean keys."""

    query_limits: torch.Tensor        # per local row: clean keys below this position are visible
    transported_from: int             # local rows `[transported_from:]` are what this rank sends
    shard_clean_rows: tuple           # per ring member: indices of its clean rows, sorted by position
    shard_clean_positions: tuple      # per ring member: those rows' positions
    gathered_clean_rows: torch.Tensor  # indices into the all-gathered buffer of all clean rows, by position
    gathered_clean_positions: torch.Tensor


@lru_cache(maxsize=64)
def _ring_rows(layout, device) -> _RingRows:
    transports_noisy = isinstance(layout, CPLayout)
    block = layout.block_size
    limits = (torch.div(layout.row_positions, block, rounding_mode="floor") + layout.row_is_clean.long()) * block
    shard_rows, shard_positions, gathered_rows, gathered_positions = [], [], [], []
    offset = 0
    first = layout.ring_index * layout.clean_shards
    for member in range(layout.clean_shards):
        rows = layout.for_rank(first + member)
        positions = rows.row_positions if transports_noisy else rows.clean_positions
        clean = rows.row_is_clean if transports_noisy else torch.ones_like(positions, dtype=torch.bool)
        clean_rows = torch.nonzero(clean).flatten()
        order = torch.argsort(positions[clean_rows], stable=True)
        shard_rows.append(clean_rows[order].to(device))
        shard_positions.append(positions[clean_rows][order].to(device))
        gathered_rows.append(clean_rows + offset)
        gathered_positions.append(positions[clean_rows])
        offset += positions.numel()
    gathered_rows, gathered_positions = torch.cat(gathered_rows), torch.cat(gathered_positions)
    order = torch.argsort(gathered_positions, stable=True)
    return _RingRows(limits.to(device), 0 if transports_noisy else layout.num_noisy_rows, tuple(shard_rows),
                     tuple(shard_positions), gathered_rows[order].to(device), gathered_positions[order].to(device))


@lru_cache(maxsize=256)
def _plan(kernels, layout, device, member=None):
    """The kernels' plan for this rank's rows against all clean keys (`member=None`) or one ring member's
    shard; shared by every layer and by the backward."""
    rows = _ring_rows(layout, device)
    positions = rows.gathered_clean_positions if member is None else rows.shard_clean_positions[member]
    return kernels.plan(rows.query_limits, positions)


def _heads_first(x, kv_heads):
    """`[s, b, heads, d]` -> `[b, kv_heads, group, s, d]`."""
    s, b, heads, d = x.shape
    return x.permute(1, 2, 0, 3).reshape(b, kv_heads, heads // kv_heads, s, d)


def _rows_first(x):
    """`[b, kv_heads, group, s, d]` -> `[s, b, heads, d]`."""
    b, kv_heads, group, s, d = x.shape
    return x.reshape(b, kv_heads * group, s, d).permute(2, 0, 1, 3)


def _pack(key_rows, value_rows):
    """Local `[s, b, kv_heads, d]` K and V -> one `[s, 2, b, kv_heads, d]` tensor to send."""
    return torch.stack([key_rows, value_rows], dim=1)


def _unpack(packed, rows):
    """Rows `rows` of a packed buffer -> K and V as `[b, kv_heads, n, d]`."""
    picked = packed.index_select(0, rows)
    return picked[:, 0].permute(1, 2, 0, 3), picked[:, 1].permute(1, 2, 0, 3)


def _repack(dk, dv, rows, total):
    """Gradients of K and V for `rows` of a packed buffer, scattered into a zero buffer of `total` rows."""
    packed = dk.new_zeros((total, 2) + tuple(dk.permute(2, 0, 1, 3).shape[1:]))
    packed.index_copy_(0, rows, torch.stack([dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)], dim=1))
    return packed


class _ContextShardedBlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, layout, ring, scale, transport):
        kv_heads = key.shape[2]
        kernels = default_kernels(query.device)
        rows = _ring_rows(layout, query.device)
        q, k, v = _heads_first(query, kv_heads), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        noisy = layout.num_noisy_rows
        sent = _pack(key[rows.transported_from:], value[rows.transported_from:])

        collective = transport == "collective"
        gathered, work = sent, None
        if collective and ring is not None:  # lands while the local noisy attention runs
            gathered, work = comm.all_gather_start(sent, ring)
        noisy_part = kernels.block_diagonal_forward(q[:, :, :, :noisy], k[:, :, :noisy], v[:, :, :noisy],
                                                    layout.block_size, scale)
        if collective:
            comm.wait_all(work or [], "forward: clean K/V all-gather", ring)
            plan = _plan(kernels, layout, query.device)
            clean_k, clean_v = _unpack(gathered, rows.gathered_clean_rows)
            out, lse = kernels.prefix_forward(q, clean_k, clean_v, plan, scale)
            ctx.plans = plan
        else:
            ctx.plans, gathered = [], None
            shard, partials = sent, []
            for step, member in enumerate(_ring_order(layout)):
                received, works = comm.ring_shift_start(shard, ring) if step < layout.clean_shards - 1 else (None, [])
                plan = _plan(kernels, layout, query.device, member)
                ctx.plans.append(plan)
                shard_k, shard_v = _unpack(shard, rows.shard_clean_rows[member])
                partials.append(kernels.prefix_forward(q, shard_k, shard_v, plan, scale))
                comm.wait_all(works, "forward: clean K/V ring shift", ring)
                shard = received
            out, lse = merge_partials(partials)

        noisy_out, noisy_lse = merge_partials([noisy_part, (out[:, :, :, :noisy], lse[:, :, :, :noisy])])
        out = torch.cat([noisy_out, out[:, :, :, noisy:]], dim=3)
        lse = torch.cat([noisy_lse, lse[:, :, :, noisy:]], dim=3)
        ctx.save_for_backward(q, k, v, out, lse, gathered)
        ctx.layout, ctx.ring, ctx.scale, ctx.transport, ctx.rows = layout, ring, scale, transport, rows
        return _rows_first(out).flatten(2)

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, out, lse, gathered = ctx.saved_tensors
        layout, ring, scale, rows = ctx.layout, ctx.ring, ctx.scale, ctx.rows
        kernels = default_kernels(q.device)
        noisy, start = layout.num_noisy_rows, rows.transported_from
        dout = _heads_first(grad_output.view(grad_output.shape[:2] + (-1, q.shape[-1])), q.shape[1])

        def noisy_backward():
            return kernels.block_diagonal_backward(dout[:, :, :, :noisy], q[:, :, :, :noisy], k[:, :, :noisy],
                                                   v[:, :, :noisy], out[:, :, :, :noisy], lse[:, :, :, :noisy],
                                                   layout.block_size, scale)

        if ctx.transport == "collective":
            clean_k, clean_v = _unpack(gathered, rows.gathered_clean_rows)
            dq, dk_clean, dv_clean = kernels.prefix_backward(dout, q, clean_k, clean_v, out, lse, ctx.plans, scale)
            d_gathered = _repack(dk_clean, dv_clean, rows.gathered_clean_rows, gathered.shape[0])
            d_sent, work = comm.reduce_scatter_start(d_gathered, ring) if ring is not None else (d_gathered, None)
            dq_noisy, dk_noisy, dv_noisy = noisy_backward()
            comm.wait_all(work or [], "backward: clean dK/dV reduce-scatter", ring)
        else:
            dq, d_sent = torch.zeros_like(q), None
            shard = _pack(k.permute(2, 0, 1, 3)[start:], v.permute(2, 0, 1, 3)[start:])
            traveling = None
            members = _ring_order(layout)
            for step, member in enumerate(members):
                last = step == len(members) - 1
                received, kv_works = comm.ring_shift_start(shard, ring) if not last else (None, [])
                shard_rows = rows.shard_clean_rows[member]
                shard_k, shard_v = _unpack(shard, shard_rows)
                part_dq, part_dk, part_dv = kernels.prefix_backward(dout, q, shard_k, shard_v, out, lse,
                                                                    ctx.plans[step], scale)
                dq += part_dq
                contribution = _repack(part_dk, part_dv, shard_rows, shard.shape[0])
                if step == 0:
                    d_sent = contribution
                else:
                    traveling = contribution if traveling is None else traveling + contribution
                    traveling, acc_works = comm.ring_shift_start(traveling, ring)
                    comm.wait_all(acc_works, "backward: clean dK/dV ring shift", ring)
                comm.wait_all(kv_works, "backward: clean K/V ring shift", ring)
                shard = received
            if traveling is not None:
                d_sent = d_sent + traveling
            dq_noisy, dk_noisy, dv_noisy = noisy_backward()

        dq[:, :, :, :noisy] += dq_noisy
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dk[:, :, :noisy] += dk_noisy
        dv[:, :, :noisy] += dv_noisy
        dk[:, :, start:] += d_sent[:, 0].permute(1, 2, 0, 3)
        dv[:, :, start:] += d_sent[:, 1].permute(1, 2, 0, 3)
        return _rows_first(dq), dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3), None, None, None, None


def _ring_order(layout):
    """Ring positions of the shards this rank holds at each streaming step: its own, then its predecessors'."""
    return [(layout.ring_rank - step) % layout.clean_shards for step in range(layout.clean_shards)]


def context_sharded_block_attention(query, key, value, layout, group=None, softmax_scale=None,
                                    transport="collective"):
    """BDLM attention of this rank's rows; `[s, b, heads, d]` queries, `[s, b, kv_heads, d]` K/V -> `[s, b, heads·d]`.

    `group` is the block-parallel group (ranks in layout order), or a `BlockParallelGroups` when the
    layout has several rings. The same call runs the conventional-CP baseline for a `CPLayout` and pure
    block parallelism for a layout with `clean_shards == 1`.
    """
    rules.refuse(rules.choice_problem("--csbp-transport", transport, rules.TRANSPORTS))
    if query.shape[0] != layout.num_rows or key.shape[0] != layout.num_rows or value.shape != key.shape:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} must "
                         f"hold this rank's {layout.num_rows} rows ([s, b, heads, d]) of the layout")
    if query.shape[2] % key.shape[2] or query.shape[3] != key.shape[3]:
        raise ValueError(f"{query.shape[2]} query heads cannot share {key.shape[2]} K/V heads of the same size")
    ring = ring_group_of(group, layout)
    scale = default_scale(query.shape[-1]) if softmax_scale is None else softmax_scale
    return _ContextShardedBlockAttention.apply(query, key, value, layout, ring, scale, transport)
