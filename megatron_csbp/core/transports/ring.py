"""What both transports share: packing the transported K/V rows, the local noisy part, and the final gradients.

A rank's rows are `[noisy ; clean]` (heads-first `[b, kv_heads, s, d]` for K and V); the rows from
`layout.first_transported_row` on are those that travel (CSBP: its clean rows; conventional CP: all; in a
sliding layer under CSBP only those another rank sees: `core.exchange`). The
local part is the noisy rows' block-diagonal attention, except under the field's CP, whose one masked call
(the plan's remote part) covers it.
"""

import torch

from megatron_csbp.core.kernels import merge_partials


def transported(k, v, layout):
    """This rank's transported rows of heads-first K and V as one `[s, 2, b, kv_heads, d]` tensor to send."""
    first = layout.first_transported_row
    return torch.stack([k.permute(2, 0, 1, 3)[first:], v.permute(2, 0, 1, 3)[first:]], dim=1)


def unpack(packed, rows):
    """Rows `rows` (None: all, in order, read in place) of a packed buffer -> K and V as `[b, kv_heads, n, d]`."""
    picked = packed if rows is None else packed.index_select(0, rows)
    return picked[:, 0].permute(1, 2, 0, 3), picked[:, 1].permute(1, 2, 0, 3)


def repack(dk, dv, rows, total):
    """Gradients of K and V for `rows` (None: all, in order) of a packed buffer of `total` rows, zero elsewhere."""
    stacked = torch.stack([dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)], dim=1)
    if rows is None:
        return stacked
    return stacked.new_zeros((total,) + stacked.shape[1:]).index_copy_(0, rows, stacked)


def returned_grads(returned, rows, total):
    """The gradients of this rank's `total` transported rows from what the members returned for the rows it gave
    them (`rows`, the exchange's `outgoing`: a row given to several members sums their gradients)."""
    return returned.new_zeros((total,) + returned.shape[1:]).index_add_(0, rows, returned)


def ring_order(layout):
    """Ring positions of the shards this rank holds at each streaming step: its own, then its predecessors'."""
    return [(layout.ring_rank - step) % layout.clean_shards for step in range(layout.clean_shards)]


def noisy_forward(plan, q, k, v, scale):
    """The local block-diagonal part: noisy rows against the noisy rows of their own block (None where the plan
    has none: the field's CP computes them in its one masked call)."""
    if not plan.block_diagonal:
        return None
    n = plan.layout.num_noisy_rows
    if plan.noisy_documents is not None:  # packed documents straddling a block: cut to each row's document
        return plan.kernels.block_diagonal_forward(q[:, :, :, :n], k[:, :, :n], v[:, :, :n], plan.layout.block_size,
                                                   scale, documents=plan.noisy_documents)
    return plan.kernels.block_diagonal_forward(q[:, :, :, :n], k[:, :, :n], v[:, :, :n], plan.layout.block_size,
                                               scale)


def with_noisy(noisy_part, prefix, layout):
    """The remote part of every row, with the noisy rows' block-diagonal part merged in (where there is one)."""
    if noisy_part is None:
        return prefix
    n = layout.num_noisy_rows
    out, lse = prefix
    noisy_out, noisy_lse = merge_partials([noisy_part, (out[:, :, :, :n], lse[:, :, :, :n])])
    return torch.cat([noisy_out, out[:, :, :, n:]], dim=3), torch.cat([noisy_lse, lse[:, :, :, n:]], dim=3)


def noisy_backward(plan, dout, q, k, v, out, lse, scale):
    if not plan.block_diagonal:
        return None
    n = plan.layout.num_noisy_rows
    if plan.noisy_documents is not None:
        return plan.kernels.block_diagonal_backward(dout[:, :, :, :n], q[:, :, :, :n], k[:, :, :n], v[:, :, :n],
                                                    out[:, :, :, :n], lse[:, :, :, :n], plan.layout.block_size, scale,
                                                    documents=plan.noisy_documents)
    return plan.kernels.block_diagonal_backward(dout[:, :, :, :n], q[:, :, :, :n], k[:, :, :n], v[:, :, :n],
                                                out[:, :, :, :n], lse[:, :, :, :n], plan.layout.block_size, scale)


def local_grads(dq, noisy_grads, d_sent, k, v, layout):
    """This rank's dQ, dK, dV: the prefix dQ plus the noisy part's, the sent rows' dK/dV summed over the ring."""
    n, first = layout.num_noisy_rows, layout.first_transported_row
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    if noisy_grads is not None:
        dq_noisy, dk_noisy, dv_noisy = noisy_grads
        dq[:, :, :, :n] += dq_noisy
        dk[:, :, :n] += dk_noisy
        dv[:, :, :n] += dv_noisy
    dk[:, :, first:] += d_sent[:, 0].permute(1, 2, 0, 3)
    dv[:, :, first:] += d_sent[:, 1].permute(1, 2, 0, 3)
    return dq, dk, dv
