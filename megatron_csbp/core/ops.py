"""CSBP attention as a differentiable op, and the two baselines through the same function.

`context_sharded_block_attention` takes this rank's rows `[noisy ; clean]` of `[x_t ; x_0]` in the
layout's order and returns their attention output. What travels is what the layout transports
(`layout.first_transported_row`):
* `CSBPLayout` (C > 1): only the clean K/V of the ring, `L` tokens; noisy K/V never leave the rank.
* `CSBPLayout` with C = 1 (pure block parallelism): nothing; every rank holds the clean sequence.
* `CPLayout` (conventional CP, modes `cp` and `cp-traffic`): all `2L` tokens' K/V, as ring-CP would move
  them. Under `cp` (`layout.masked_attention`) each rank makes one masked kernel call over its rows against
  all of them (one per ring step when streamed), as the field runs CP; `cp-traffic` computes the same rows
  with CSBP's two parts (an ablation: only the bytes differ from CSBP).

Two transports (`core.transports`, a file each), each a forward and a backward over heads-first tensors:
* "collective" (`transports/collective.py`): an all-gather of the transported K/V, overlapped with the
  local noisy attention; backward reduce-scatters their gradients, overlapped with the local noisy backward.
* "streaming" (`transports/streaming.py`): shards passed around the ring point to point; the forward
  folds each step's partial result into one running output (online softmax, fp32), so it holds the
  shard it attends to, the one being received and the running output; backward circulates K/V with
  dK/dV accumulators so each owner ends with the full sum.
The backward is exact: each part is differentiated against the final merged output and LSE.

What a (layout, device) fixes once — which rows of each ring member are clean keys, in position order,
and the kernels' plans over them — is a `RingPlan` (`ring_plan(layout, device)`), built once by the
caller and shared by every layer and the backward; calls without one use a small cache. The layout carries the
layer's window (`core.windows`): in a sliding layer every row's keys start at its window's start, and under CSBP
the plan's `exchange` (`core.exchange`) has the ring move only the clean rows each rank's rows see.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch

from megatron_csbp.core import transports
from megatron_csbp.core.documents import NoisyDocuments, clean_key_ranges, noisy_document_ids
from megatron_csbp.core.exchange import window_exchange
from megatron_csbp.core.kernel_work import DENSE, MASKED, PREFIX
from megatron_csbp.core.kernels import default_kernels, default_scale
from megatron_csbp.core.process_groups import ring_group_of

PLAN_CACHE_SIZE = 8  # (layout, device) plans kept for callers that do not hold their own


@dataclass(frozen=True, eq=False)
class RingPlan:
    """Where the transported rows of each ring member sit, which of them are this rank's keys, and the kernels'
    plans of this rank's rows against them: for the all-gathered keys and for each member's shard.

    CSBP, BP and `cp-traffic` split each row's attention into the local block-diagonal part (`block_diagonal`)
    and a "prefix" part against the clean keys sorted by position; the field's CP (`layout.masked_attention`)
    makes one "masked" call against all transported keys, noisy then clean copy, each sorted by position."""

    layout: object
    device: torch.device
    kernels: object                    # the kernel family the plans were made for
    shard_key_rows: tuple              # per ring member: indices of its keys in its shard, in key order
    gathered_key_rows: torch.Tensor    # indices into the all-gathered buffer of all keys, in key order
    # (either is None where its rows are all the buffer's, in order: the buffer is then read in place)
    gathered: object                   # the kernels' plan against all keys (collective)
    members: tuple                     # the kernels' plan against each member's keys (streaming)
    block_diagonal: bool               # the noisy rows' own blocks are a separate local call (not masked)
    kind: str                          # the remote part's kernel: core.kernel_work.PREFIX or MASKED
    num_keys: int                      # keys of the gathered plan: the clean copy's L, or both copies' 2L
    # The remote part (prefix or masked) of this rank's rows against keys `k, v` under a kernel plan, bound once:
    # remote_forward(q, k, v, kernel_plan, scale), remote_backward(dout, q, k, v, out, lse, kernel_plan, scale)
    remote_forward: object
    remote_backward: object
    documents: object = None           # core.documents.Documents of a packed sample (None: one document)
    noisy_documents: object = None     # NoisyDocuments where an owned block straddles documents, else None
    # A sliding layer's exchange (core.exchange.WindowExchange) where the ring moves only what each rank sees: a
    # member's shard is then the piece it gives this rank (its own piece: its own keys), and the gathered buffer
    # the pieces in ring order. None: every transported row travels.
    exchange: object = None

    def kernel_calls(self, per_member: bool = False) -> tuple:
        """The kernel calls of one layer's forward, per head and sample, counted from the plans' own masks and
        tiles (`core.kernel_work.KernelCall`): the collective transport's one remote call against all keys
        (`ParallelMode.kernel_calls` states these figures analytically), or with `per_member` (the streaming
        transport, `Transport.call_per_member`) one remote call per ring member's shard, in ring order."""
        from megatron_csbp.core.kernel_work import KernelCall

        calls = []
        if self.block_diagonal and self.layout.num_noisy_rows:
            # every owned block is computed whole; one straddling documents is masked to each row's document
            # (packed samples: the kernel's `NoisyDocuments`), which leaves fewer real pairs
            block = self.layout.block_size
            computed = self.layout.num_noisy_rows * block
            real = computed if self.noisy_documents is None else self.noisy_documents.visible_pairs(block)
            calls.append(KernelCall(DENSE, real, computed))
        plans = self.members if per_member else (self.gathered,)
        return tuple(calls + [KernelCall(self.kind, *plan.work()) for plan in plans])


def ring_plan(layout, device, kernels=None, documents=None) -> RingPlan:
    """The plan of `layout` on `device` for `kernels` (the device's default): build it once, pass it as `plan=`.

    `documents` (`core.documents.Documents`, packed samples): every row's clean keys are cut to its own
    document, `[doc_start, min(limit, doc_end))`, and so are the noisy keys of a block straddling documents;
    the field's CP's masked call intersects the BDLM mask with "same document"."""
    device = torch.device(device)
    kernels = default_kernels(device) if kernels is None else kernels
    if documents is not None and documents.is_single:
        documents = None
    block, masked = layout.block_size, layout.masked_attention
    if masked:  # keys of both copies, noisy first: 2L keys in position order when gathered
        kind, remote_forward, remote_backward = MASKED, kernels.masked_forward, kernels.masked_backward

        def key_order(positions, clean):
            return positions + clean.long() * layout.seq_length

        def plan_for(positions, clean):
            rows = (layout.row_positions.to(device), layout.row_is_clean.to(device), positions.to(device),
                    clean.to(device), block)
            if documents is None:
                return kernels.masked_plan(*rows, clean_attention=layout.clean_attention, window=layout.window)
            # packed: a token's two copies share its position, hence its document
            return kernels.masked_plan(*rows, query_documents=documents.index_of(layout.row_positions).to(device),
                                       key_documents=documents.index_of(positions).to(device),
                                       clean_attention=layout.clean_attention, window=layout.window)
    else:  # clean keys only, in position order; each row's keys `[start, limit)`: its window's, cut to its document
        kind, remote_forward, remote_backward = PREFIX, kernels.prefix_forward, kernels.prefix_backward
        if documents is None and not layout.window.sliding:
            starts, limits = None, layout.row_limits
        else:
            starts, limits = clean_key_ranges(layout, documents)
            starts = starts.to(device)
        limits = limits.to(device)

        def key_order(positions, clean):
            return positions

        def plan_for(positions, clean):
            if starts is None:
                return kernels.plan(limits, positions.to(device))
            return kernels.plan(limits, positions.to(device), query_starts=starts)
    member_keys = []  # per ring member: its transported rows that are keys, in key order, and their positions
    for ring_rank in range(layout.clean_shards):
        member = layout.for_rank(layout.ring_index * layout.clean_shards + ring_rank)
        first = member.first_transported_row
        positions, clean = member.row_positions[first:], member.row_is_clean[first:]
        rows = torch.arange(positions.numel()) if masked else torch.nonzero(clean).flatten()
        rows = rows[torch.argsort(key_order(positions[rows], clean[rows]), stable=True)]
        member_keys.append((rows, positions[rows], clean[rows], positions.numel()))
    exchange = None
    if layout.exchanges_windows and layout.clean_shards > 1:
        exchange = window_exchange(layout, documents, [(rows, positions) for rows, positions, *_ in member_keys],
                                   device)
    shard_rows, shard_plans, gathered_rows, gathered_positions, gathered_clean = [], [], [], [], []
    offset = 0
    for ring_rank, (rows, positions, clean, shard_size) in enumerate(member_keys):
        if exchange is not None:  # the member's piece: what it gives this rank (clean rows), whole
            positions = exchange.receive_positions[ring_rank]
            shard_size = positions.numel()
            rows, clean = torch.arange(shard_size), torch.ones(shard_size, dtype=torch.bool)
        shard_rows.append(_indices_or_all(rows, shard_size, device))
        shard_plans.append(plan_for(positions, clean))
        gathered_rows.append(rows + offset)
        gathered_positions.append(positions)
        gathered_clean.append(clean)
        offset += shard_size
    gathered_rows, gathered_positions = torch.cat(gathered_rows), torch.cat(gathered_positions)
    gathered_clean = torch.cat(gathered_clean)
    order = torch.argsort(key_order(gathered_positions, gathered_clean), stable=True)
    return RingPlan(layout, device, kernels, tuple(shard_rows), _indices_or_all(gathered_rows[order], offset, device),
                    plan_for(gathered_positions[order], gathered_clean[order]), tuple(shard_plans),
                    block_diagonal=not masked, kind=kind, num_keys=int(order.numel()), remote_forward=remote_forward,
                    remote_backward=remote_backward, documents=documents,
                    noisy_documents=_noisy_documents(layout, documents, masked, device), exchange=exchange)


def _noisy_documents(layout, documents, masked, device):
    """The documents of the noisy rows, where the block-diagonal part is a separate call and an owned block
    straddles documents (None otherwise: the part is then unchanged)."""
    ids = None if documents is None or masked else noisy_document_ids(layout, documents)
    return None if ids is None else NoisyDocuments(ids.to(device))


def _indices_or_all(rows, total, device):
    """`rows` on `device`, or None where they are `0..total-1` in order (a CSBP shard: clean rows only, sorted)."""
    return None if torch.equal(rows, torch.arange(total)) else rows.to(device)


_plans: "OrderedDict[tuple, RingPlan]" = OrderedDict()


def _cached_plan(layout, device, documents=None) -> RingPlan:
    """The last `PLAN_CACHE_SIZE` plans by (layout, device, documents); one is rebuilt when the device's kernels
    were replaced since it was made (tests and scripts/gpu_check.py swap them)."""
    kernels = default_kernels(device)
    key = (layout, device) if documents is None else (layout, device, documents)
    plan = _plans.pop(key, None)
    if plan is None or plan.kernels is not kernels:
        plan = ring_plan(layout, device, kernels, documents)
    _plans[key] = plan
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


class _ContextShardedBlockAttention(torch.autograd.Function):
    """Turns the rows-first tensors heads-first, saves what the transport's backward needs and calls it."""

    @staticmethod
    def forward(ctx, query, key, value, ring, scale, transport_functions, plan):
        q, k, v = _heads_first(query, key.shape[2]), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        forward, backward = transport_functions
        out, lse, saved = forward(q, k, v, ring, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse, *saved)
        ctx.ring, ctx.scale, ctx.backward, ctx.plan = ring, scale, backward, plan
        return _rows_first(out).flatten(2)

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        dout = _heads_first(grad_output.view(grad_output.shape[:2] + (-1, q.shape[-1])), q.shape[1])
        dq, dk, dv = ctx.backward(dout, q, k, v, out, lse, saved, ctx.ring, ctx.plan, ctx.scale)
        return _rows_first(dq), dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3), None, None, None, None


def context_sharded_block_attention(query, key, value, layout, group=None, softmax_scale=None,
                                    transport=transports.COLLECTIVE, plan=None, documents=None):
    """BDLM attention of this rank's rows; `[s, b, heads, d]` queries, `[s, b, kv_heads, d]` K/V -> `[s, b, heads·d]`.

    `group` is the block-parallel group (ranks in layout order), or a `BlockParallelGroups` when the
    layout has several rings. The same call runs the conventional-CP baseline for a `CPLayout` and pure
    block parallelism for a layout with `clean_shards == 1`. `plan`: `ring_plan(layout, query.device)`,
    built once by the caller (default: a small cache by layout and device). `documents`: the packed
    sample's `core.documents.Documents`, shared by the samples of the call (None: one document); a
    `plan` given must have been built for them. `transport`: a `transports.Transport` (or its name).
    """
    transport = transports.transport(transport)
    if query.shape[0] != layout.num_rows or key.shape[0] != layout.num_rows or value.shape != key.shape:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} must "
                         f"hold this rank's {layout.num_rows} rows ([s, b, heads, d]) of the layout")
    if query.shape[2] % key.shape[2] or query.shape[3] != key.shape[3]:
        raise ValueError(f"{query.shape[2]} query heads cannot share {key.shape[2]} K/V heads of the same size")
    if documents is not None and documents.is_single:
        documents = None
    if plan is None:
        plan = _cached_plan(layout, query.device, documents)
    elif plan.layout != layout or plan.device != query.device:
        raise ValueError(f"plan was built for {plan.layout} on {plan.device}, not for this call's {layout} on "
                         f"{query.device}: pass plan=ring_plan(layout, device) of the layout and device it runs")
    elif plan.documents != documents:
        raise ValueError(f"plan was built for documents {plan.documents}, not this call's {documents}: pass "
                         f"plan=ring_plan(layout, device, documents=documents)")
    ring = ring_group_of(group, layout)
    scale = default_scale(query.shape[-1]) if softmax_scale is None else softmax_scale
    return _ContextShardedBlockAttention.apply(query, key, value, ring, scale, transport.functions(), plan)
