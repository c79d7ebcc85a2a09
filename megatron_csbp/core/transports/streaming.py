"""The streaming transport, for bounded memory: shards passed around the ring point to point. The forward folds
each step's partial result into one running output (online softmax, fp32), so it holds the shard it attends
to, the one being received and the running output; the backward circulates K/V with dK/dV accumulators so
each owner ends with the full sum.

In a sliding layer under CSBP (`plan.exchange`) nothing is passed on: at step `s` a rank sends the member `s`
places after it the rows of its shard that member sees and gets from the member `s` places before it the rows
it sees of that one's (`C - 1` steps, point to point); the backward sends them again and returns each piece's
dK/dV straight to its owner."""

from megatron_csbp.core import comm
from megatron_csbp.core.kernels import merge_into, running_merge
from megatron_csbp.core.transports.ring import (local_grads, noisy_backward, noisy_forward, repack, ring_order,
                                                transported, unpack, with_noisy)


def forward(q, k, v, ring, plan, scale):
    """Passes the transported K/V around the ring: at each step this rank attends to the shard it holds while
    the next one arrives, and folds that partial result into one running `(out, lse)` in fp32 (or wider).
    It holds the shard, the one being received and the running output, besides the step's partial until it
    is folded in. Same shapes as the collective forward; keeps nothing for the backward: `(out, lse, ())`."""
    noisy_part = noisy_forward(plan, q, k, v, scale)
    running = None
    for member, shard in _shards(transported(k, v, plan.layout), ring, plan, "forward"):
        shard_k, shard_v = unpack(shard, plan.shard_key_rows[member])
        part = plan.remote_forward(q, shard_k, shard_v, plan.members[member], scale)
        del shard_k, shard_v
        running = running_merge(part) if running is None else merge_into(running, part)
        del part
    out, lse = running
    return (*with_noisy(noisy_part, (out.to(q.dtype), lse), plan.layout), ())


def _shards(sent, ring, plan, what):
    """`(member, shard)` for each step: the shard of each ring member in `ring_order` as it arrives around the ring,
    the next one on its way while the caller computes with this one."""
    if plan.exchange is not None:
        yield from _pieces(sent, ring, plan.exchange, what)
        return
    members, shard = ring_order(plan.layout), sent
    for step, member in enumerate(members):
        received, works = comm.ring_shift_start(shard, ring) if step < len(members) - 1 else (None, [])
        yield member, shard
        comm.wait_all(works, f"{what}: clean K/V ring shift", ring)
        shard = received


def _pieces(sent, ring, exchange, what):
    """`(member, piece)` of a sliding layer: its own keys, then at step `s` what the member `s` places before it
    gives it, while it gives the member `s` places after it what that one sees; the next step's transfer is on
    its way while the caller computes."""
    me, size = exchange.ring_rank, len(exchange.send_rows)

    def start(step):
        to, source = (me + step) % size, (me - step) % size
        return comm.pair_exchange_start(sent.index_select(0, exchange.send_rows[to]), to,
                                        exchange.receive_counts[source], source, ring)

    pending = start(1) if size > 1 else None
    yield me, sent.index_select(0, exchange.send_rows[me])
    for step in range(1, size):
        received, works = pending
        comm.wait_all(works, f"{what}: clean K/V window exchange", ring)
        pending = start(step + 1) if step + 1 < size else None
        yield (me - step) % size, received


def backward(dout, q, k, v, out, lse, saved, ring, plan, scale):
    """K/V go around the ring again; each step's dK/dV travel one step behind, accumulated, so that after the
    last shift every owner holds the full sum for its shard -> `(dq, dk, dv)`. In a sliding layer each piece's
    dK/dV go straight back to its owner instead."""
    if plan.exchange is not None:
        return _window_backward(dout, q, k, v, out, lse, ring, plan, scale)
    members = ring_order(plan.layout)
    dq = d_sent = traveling = None  # each a fresh tensor of ours once set, so summed into in place
    shard = transported(k, v, plan.layout)
    for step, member in enumerate(members):
        last = step == len(members) - 1
        received, kv_works = comm.ring_shift_start(shard, ring) if not last else (None, [])
        shard_rows = plan.shard_key_rows[member]
        shard_k, shard_v = unpack(shard, shard_rows)
        part_dq, part_dk, part_dv = plan.remote_backward(dout, q, shard_k, shard_v, out, lse,
                                                                 plan.members[member], scale)
        del shard_k, shard_v
        dq = part_dq if dq is None else dq.add_(part_dq)
        contribution = repack(part_dk, part_dv, shard_rows, shard.shape[0])
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
    noisy_grads = noisy_backward(plan, dout, q, k, v, out, lse, scale)
    return local_grads(dq, noisy_grads, d_sent, k, v, plan.layout)


def _window_backward(dout, q, k, v, out, lse, ring, plan, scale):
    """The pieces come again as in the forward; each piece's dK/dV go back to the member that gave it (the own
    piece's stay), summed into the rows it gave, one step behind the compute."""
    exchange = plan.exchange
    me, size = exchange.ring_rank, len(exchange.send_rows)
    sent = transported(k, v, plan.layout)
    d_sent = sent.new_zeros(sent.shape)
    dq, returning = None, None
    for step, (member, piece) in enumerate(_pieces(sent, ring, exchange, "backward")):
        part_dq, part_dk, part_dv = plan.remote_backward(dout, q, *unpack(piece, None), out, lse,
                                                         plan.members[member], scale)
        dq = part_dq if dq is None else dq.add_(part_dq)
        contribution = repack(part_dk, part_dv, None, piece.shape[0])
        del part_dq, part_dk, part_dv, piece
        if returning is not None:
            _add_returned(d_sent, returning, exchange, ring)
        if step == 0:
            d_sent.index_add_(0, exchange.send_rows[me], contribution)
            returning = None
        else:  # back to `member`; from the member this rank gave a piece at this step, its gradients
            given = (me + step) % size
            returned, works = comm.pair_exchange_start(contribution, member, exchange.send_counts[given], given,
                                                       ring)
            returning = (returned, works, given)
        del contribution
    if returning is not None:
        _add_returned(d_sent, returning, exchange, ring)
    noisy_grads = noisy_backward(plan, dout, q, k, v, out, lse, scale)
    return local_grads(dq, noisy_grads, d_sent, k, v, plan.layout)


def _add_returned(d_sent, returning, exchange, ring):
    returned, works, given = returning
    comm.wait_all(works, "backward: clean dK/dV window return", ring)
    d_sent.index_add_(0, exchange.send_rows[given], returned)
