"""The streaming transport, for bounded memory: shards passed around the ring point to point. The forward folds
each step's partial result into one running output (online softmax, fp32), so it holds the shard it attends
to, the one being received and the running output; the backward circulates K/V with dK/dV accumulators so
each owner ends with the full sum."""

from megatron_csbp.core import comm
from megatron_csbp.core.kernels import merge_into, running_merge
from megatron_csbp.core.transports.ring import (local_grads, noisy_backward, noisy_forward, repack, ring_order,
                                                transported, unpack, with_noisy)


def forward(q, k, v, ring, plan, scale):
    """Passes the transported K/V around the ring: at each step this rank attends to the shard it holds while
    the next one arrives, and folds that partial result into one running `(out, lse)` in fp32 (or wider).
    It holds the shard, the one being received and the running output, besides the step's partial until it
    is folded in. Same shapes as the collective forward; keeps nothing for the backward: `(out, lse, ())`."""
    members = ring_order(plan.layout)
    noisy_part = noisy_forward(plan, q, k, v, scale)
    shard, running = transported(k, v, plan.layout), None
    for step, member in enumerate(members):
        received, works = comm.ring_shift_start(shard, ring) if step < len(members) - 1 else (None, [])
        shard_k, shard_v = unpack(shard, plan.shard_key_rows[member])
        part = plan.remote_forward(q, shard_k, shard_v, plan.members[member], scale)
        del shard_k, shard_v
        running = running_merge(part) if running is None else merge_into(running, part)
        del part
        comm.wait_all(works, "forward: clean K/V ring shift", ring)
        shard = received
    out, lse = running
    return (*with_noisy(noisy_part, (out.to(q.dtype), lse), plan.layout), ())


def backward(dout, q, k, v, out, lse, saved, ring, plan, scale):
    """K/V go around the ring again; each step's dK/dV travel one step behind, accumulated, so that after the
    last shift every owner holds the full sum for its shard -> `(dq, dk, dv)`."""
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
