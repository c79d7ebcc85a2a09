"""A Gated DeltaNet layer under block diffusion, on one rank's `[noisy ; clean]` rows, in any layout.

The semantics (docs/algorithm.md, "Gated DeltaNet layers"), as Turbo-dLLM's Qwen3.8 defines them: the clean
stream runs the causal convolution and the recurrence over `x_0` causally, token after token; noisy block `b`
runs its own tokens causally from the clean stream's state at its start, `S(bB)` (the state after the clean
tokens `[0, bB)`), its convolution reading the clean pre-convolution inputs of the `W - 1` positions before
`bB` (zeros before position 0). Nothing of a noisy block reaches another block or the clean stream.

How a rank computes it (`gated_delta_block_diffusion`), whatever rows it holds:

* Its clean rows are whole blocks, in chunks of consecutive blocks (`layout.clean_spans`). Every clean block is
  run from a zero state with its value widened by an identity (`[v | 0]` from `[0 | I]`): the run gives the
  block's outputs from a zero state, each token's read-out of the state it entered with, and the block's affine
  map `S -> M S + U` (its final state `[U | M]`). Composing them along a chunk gives the chunk's map.
* The ring all-gathers the chunks' maps (`dk x (dk + dv)` per value head) and every member scans them in
  position order, so each knows the state entering each of its chunks, exactly; from it, the state entering
  every clean block it holds, which corrects that block's outputs.
* The convolution's `W - 1` inputs before each chunk and before each noisy block, and the state `S(bB)` entering
  each noisy block, come from the ring member holding clean block `b - 1` (an all-to-all inside the ring; a
  member asks itself for its own). The state of block 0 is zero.

All three exchanges are differentiable (their backward sends the gradients back), so the backward is exact by
construction. `GatedDeltaPlan` fixes, once per layout, what each member sends to each; it also counts the bytes.
"""

import dataclasses
import functools

import torch
import torch.nn.functional as F

from megatron_csbp.core import comm, rules
from megatron_csbp.core.kernels.gated_delta import chunk_rule, l2norm

STATE_BYTES = 4  # states, and the chunks' maps, travel in fp32


@dataclasses.dataclass(frozen=True)
class GatedDeltaPlan:
    """What one rank of a layout computes and exchanges in a Gated DeltaNet layer (block indices, all ints).

    `clean_chunks`: (first block, block count) of each of this rank's clean chunks, in row order; `scan`: the
    all-gathered chunks (member-major) in position order; `mine`: this rank's chunks among the gathered.
    `tail_send` / `state_send`: for each row this rank sends, the local clean block whose convolution tail (last
    `W - 1` pre-convolution rows) or final state it is, grouped by receiving member; `*_counts`: rows per member.
    `noisy_tails`, `chunk_tails`, `noisy_states`: for each owned noisy block and each clean chunk, its row in
    `[zero ; received]` (0: nothing before it, position 0)."""

    block_size: int
    conv_width: int
    members: int
    clean_chunks: tuple
    scan: tuple
    mine: tuple
    noisy_blocks: tuple
    tail_send: tuple
    tail_send_counts: tuple
    tail_receive_counts: tuple
    noisy_tails: tuple
    chunk_tails: tuple
    state_send: tuple
    state_send_counts: tuple
    state_receive_counts: tuple
    noisy_states: tuple

    @property
    def chunks_per_member(self) -> int:
        return len(self.clean_chunks)

    def bytes_sent(self, member: int, batch: int, heads: int, key_dim: int, value_dim: int, conv_channels: int,
                   element_bytes: int) -> tuple[int, int]:
        """(forward, backward) bytes this rank (ring member `member`) sends in one layer for `batch` samples and
        `heads` value heads: the convolution tails, the chunks' maps, the noisy blocks' states."""
        others = lambda counts: sum(counts) - counts[member]  # noqa: E731 - rows to other members
        tail = batch * (self.conv_width - 1) * conv_channels * element_bytes
        state = batch * heads * key_dim * value_dim * STATE_BYTES
        maps = (self.members - 1) * self.chunks_per_member * batch * heads * key_dim * (key_dim + value_dim) \
            * STATE_BYTES
        forward = others(self.tail_send_counts) * tail + maps + others(self.state_send_counts) * state
        backward = others(self.tail_receive_counts) * tail + maps + others(self.state_receive_counts) * state
        return forward, backward


def plan_problem(layout, conv_width: int) -> str | None:
    """Why `layout` cannot run a Gated DeltaNet layer of convolution width `conv_width` (one line), or None."""
    B = layout.block_size
    problem = rules.conv_history_problem(B, conv_width)
    if problem:
        return problem
    start, stop = layout.clean_spans[0]
    if (stop - start) % B:
        return (f"a clean chunk of {stop - start} tokens does not hold whole --bdlm-block-size {B} blocks, which "
                f"Gated DeltaNet layers need (each chunk's state is the one entering a block): make --seq-length a "
                f"multiple of {B} times the chunk count")
    return None


@functools.lru_cache(maxsize=64)
def gated_delta_plan(layout, conv_width: int) -> GatedDeltaPlan:
    """The plan of `layout`'s rank (see `GatedDeltaPlan`); refuses a layout `plan_problem` names."""
    problem = plan_problem(layout, conv_width)
    if problem:
        raise ValueError(problem)
    B = layout.block_size
    ring = [layout.for_rank(rank) for rank in layout.ring_ranks]
    me = layout.ring_ranks.index(layout.rank)
    holder = {}  # clean block -> (member, local block index)
    chunks = []  # member-major: (member, first block, blocks)
    for member, other in enumerate(ring):
        local = 0
        for start, stop in other.clean_spans:
            chunks.append((member, start // B, (stop - start) // B))
            for block in range(start // B, stop // B):
                holder[block] = (member, local)
                local += 1
    scan = tuple(sorted(range(len(chunks)), key=lambda index: chunks[index][1]))
    per_member = len(ring[0].clean_spans)
    mine = tuple(me * per_member + i for i in range(per_member))

    def requests(other, with_chunks: bool):
        boundaries = {b for b in other.owned_blocks if b > 0}
        if with_chunks:
            boundaries |= {start // B for start, _ in other.clean_spans if start > 0}
        return sorted(boundaries)

    def exchange(with_chunks: bool):
        """(rows sent: my local block per row, grouped by member; send counts; receive counts; where each of my
        requests lands in what I receive)."""
        send, send_counts = [], []
        for other in ring:
            asked = [holder[b - 1][1] for b in requests(other, with_chunks) if holder[b - 1][0] == me]
            send += asked
            send_counts.append(len(asked))
        mine_asked = requests(layout, with_chunks)
        receive_counts = [sum(1 for b in mine_asked if holder[b - 1][0] == m) for m in range(len(ring))]
        landing, offsets = {}, [sum(receive_counts[:m]) for m in range(len(ring))]
        for b in mine_asked:  # in order per member: the order the member sends them
            member = holder[b - 1][0]
            landing[b] = 1 + offsets[member]
            offsets[member] += 1
        return tuple(send), tuple(send_counts), tuple(receive_counts), landing

    tail_send, tail_send_counts, tail_receive_counts, tail_landing = exchange(True)
    state_send, state_send_counts, state_receive_counts, state_landing = exchange(False)
    clean_chunks = tuple((start // B, (stop - start) // B) for start, stop in layout.clean_spans)
    return GatedDeltaPlan(
        block_size=B, conv_width=conv_width, members=len(ring), clean_chunks=clean_chunks, scan=scan, mine=mine,
        noisy_blocks=tuple(layout.owned_blocks), tail_send=tail_send, tail_send_counts=tail_send_counts,
        tail_receive_counts=tail_receive_counts,
        noisy_tails=tuple(tail_landing.get(b, 0) for b in layout.owned_blocks),
        chunk_tails=tuple(tail_landing.get(first, 0) for first, _ in clean_chunks),
        state_send=state_send, state_send_counts=state_send_counts, state_receive_counts=state_receive_counts,
        noisy_states=tuple(state_landing.get(b, 0) for b in layout.owned_blocks))


class _Exchange(torch.autograd.Function):
    """Rows to ring members (all-to-all); the backward returns their gradients the same way back."""

    @staticmethod
    def forward(ctx, rows, send_counts, receive_counts, group, what):
        ctx.exchange = (send_counts, receive_counts, group, what)
        received, work = comm.all_to_all_start(rows, list(send_counts), list(receive_counts), group)
        comm.wait_all(work, what, group)
        return received

    @staticmethod
    def backward(ctx, grad):
        send_counts, receive_counts, group, what = ctx.exchange
        returned, work = comm.all_to_all_start(grad, list(receive_counts), list(send_counts), group)
        comm.wait_all(work, f"backward: {what}", group)
        return returned, None, None, None, None


class _Gather(torch.autograd.Function):
    """Every member's rows, member-major (all-gather); the backward sums their gradients to the owners."""

    @staticmethod
    def forward(ctx, rows, group, what):
        ctx.gather = (group, what)
        gathered, work = comm.all_gather_start(rows, group)
        comm.wait_all(work, what, group)
        return gathered

    @staticmethod
    def backward(ctx, grad):
        group, what = ctx.gather
        shard, work = comm.reduce_scatter_start(grad, group)
        comm.wait_all(work, f"backward: {what}", group)
        return shard, None, None


def _exchange(rows, send_counts, receive_counts, group, what):
    return rows if group is None else _Exchange.apply(rows, send_counts, receive_counts, group, what)


def _with_zero_row(received):
    return torch.cat([received.new_zeros((1,) + tuple(received.shape[1:])), received])


def _convolve(history, rows, weight, bias, activation):
    """The causal depthwise convolution of `rows [n, T, D]` after `history [n, W - 1, D]`: `[n, T, D]`."""
    x = torch.cat([history, rows], dim=1).transpose(1, 2)
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return activation(out).transpose(1, 2)


def _split(mixed, key_heads: int, key_dim: int, value_heads: int):
    """Convolved `[n, T, 2·Hk·dk + Hv·dv]` -> L2-normalised q, k (repeated to the value heads) and v, fp32."""
    n, tokens, _ = mixed.shape
    q, k, v = mixed.float().split([key_heads * key_dim, key_heads * key_dim, mixed.shape[-1] - 2 * key_heads
                                   * key_dim], dim=-1)
    q, k = (l2norm(x.reshape(n, tokens, key_heads, key_dim)).repeat_interleave(value_heads // key_heads, dim=2)
            for x in (q, k))
    return q, k, v.reshape(n, tokens, value_heads, -1)


def _blocks(x, count: int, block: int):
    """`[b, count·block, ...]` -> `[b·count, block, ...]`."""
    return x.reshape(x.shape[0] * count, block, *x.shape[2:])


def gated_delta_block_diffusion(pre_conv, g, beta, conv_weight, conv_bias, activation, key_heads: int,
                                key_dim: int, layout, group=None, plan: GatedDeltaPlan | None = None):
    """The core of a Gated DeltaNet layer over this rank's rows (`[b, rows, ...]`, noisy rows then clean rows, in
    the layout's order): `pre_conv` the in-projection's q/k/v part before the convolution, `g` the log decay and
    `beta` the write strength per value head, `conv_weight [channels, W]`. `group`: the ring (None: one member).
    Returns `[b, rows, value heads, dv]` fp32, before the output norm and gate."""
    W = conv_weight.shape[-1]
    plan = plan or gated_delta_plan(layout, W)
    B, batch, channels = layout.block_size, pre_conv.shape[0], pre_conv.shape[-1]
    heads = g.shape[-1]
    noisy_rows = layout.num_noisy_rows
    owned, clean = len(plan.noisy_blocks), layout.num_clean_rows // B
    convolve = functools.partial(_convolve, weight=conv_weight, bias=conv_bias, activation=activation)
    split = functools.partial(_split, key_heads=key_heads, key_dim=key_dim, value_heads=heads)

    # 1. the convolution's history before each chunk and each noisy block, from the holder of the block before
    clean_pre = pre_conv[:, noisy_rows:].reshape(batch, clean, B, channels)
    tails = clean_pre[:, :, B - (W - 1):].transpose(0, 1)  # [clean blocks, b, W - 1, channels]
    tails = _with_zero_row(_exchange(tails[list(plan.tail_send)], plan.tail_send_counts, plan.tail_receive_counts,
                                     group, "Gated DeltaNet: convolution history"))

    # 2. every clean block from a zero state, widened by the identity: outputs, read-outs and its map [U | M]
    chunk_blocks = plan.clean_chunks[0][1]
    chunk_pre = pre_conv[:, noisy_rows:].reshape(batch * len(plan.clean_chunks), chunk_blocks * B, channels)
    history = tails[list(plan.chunk_tails)].transpose(0, 1).reshape(batch * len(plan.clean_chunks), W - 1, channels)
    q, k, v = split(convolve(history, chunk_pre).reshape(batch, clean * B, channels))
    dv = v.shape[-1]
    q, k, v = (_blocks(x, clean, B) for x in (q, k, v))
    widened = torch.cat([v, v.new_zeros(*v.shape[:-1], key_dim)], dim=-1)
    start = torch.cat([q.new_zeros(key_dim, dv), torch.eye(key_dim, device=q.device)], dim=-1)
    gc, bc = (_blocks(x[:, noisy_rows:], clean, B) for x in (g, beta))
    out, maps = chunk_rule(q, k, widened, gc, bc, start.expand(batch * clean, heads, key_dim, key_dim + dv))
    out = out.float().reshape(batch, clean, B, heads, dv + key_dim)
    maps = maps.reshape(batch, clean, heads, key_dim, dv + key_dim)

    # 3. along each chunk: the map from the chunk's entry state to each block's entry and end, [U | M] composed
    entries, ends, summaries = [], [], []
    block = 0
    for _, count in plan.clean_chunks:
        prefix = start.expand(batch, heads, key_dim, key_dim + dv)
        for _ in range(count):
            entries.append(prefix)
            step = maps[:, block]
            prefix = step[..., dv:] @ prefix + F.pad(step[..., :dv], (0, key_dim))
            ends.append(prefix)
            block += 1
        summaries.append(prefix)

    # 4. the ring's chunks in position order: the state entering each of them
    gathered = _Gather.apply(torch.stack(summaries), group, "Gated DeltaNet: chunk maps") \
        if group is not None else torch.stack(summaries)
    # The zero entering chunk 0, as a function of what was gathered: every rank's states then depend on the
    # gather, so every rank's backward runs the three exchanges in one order (states, maps, history).
    state = gathered[0][..., :dv] * 0
    chunk_entry = {}
    for index in plan.scan:
        chunk_entry[index] = state
        state = gathered[index][..., dv:] @ state + gathered[index][..., :dv]
    apply = lambda affine, entry: affine[..., dv:] @ entry + affine[..., :dv]  # noqa: E731
    block_entries, block_ends = [], []
    block = 0
    for slot, (_, count) in zip(plan.mine, plan.clean_chunks):
        for _ in range(count):
            block_entries.append(apply(entries[block], chunk_entry[slot]))
            block_ends.append(apply(ends[block], chunk_entry[slot]))
            block += 1
    entry_states = torch.stack(block_entries, 1)  # [b, clean, H, dk, dv]
    clean_out = out[..., :dv] + torch.einsum("bctHk,bcHkv->bctHv", out[..., dv:], entry_states)

    # 5. each noisy block from the clean state at its start, its convolution after the clean history
    states = torch.stack(block_ends)  # [clean blocks, b, H, dk, dv]
    states = _with_zero_row(_exchange(states[list(plan.state_send)], plan.state_send_counts,
                                      plan.state_receive_counts, group, "Gated DeltaNet: block states"))
    noisy_history = tails[list(plan.noisy_tails)].transpose(0, 1).reshape(batch * owned, W - 1, channels)
    noisy_pre = _blocks(pre_conv[:, :noisy_rows], owned, B)
    q, k, v = split(convolve(noisy_history, noisy_pre))
    initial = states[list(plan.noisy_states)].transpose(0, 1).reshape(batch * owned, heads, key_dim, dv)
    gn, bn = (_blocks(x[:, :noisy_rows], owned, B) for x in (g, beta))
    noisy_out, _ = chunk_rule(q, k, v, gn, bn, initial)
    return torch.cat([noisy_out.float().reshape(batch, noisy_rows, heads, dv),
                      clean_out.reshape(batch, clean * B, heads, dv)], dim=1)
