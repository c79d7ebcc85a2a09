"""The collective transport: one all-gather of the transported K/V, overlapped with the local noisy attention;
the backward reduce-scatters their gradients, overlapped with the local noisy backward. In a sliding layer under
CSBP (`plan.exchange`) the all-gather is one all-to-all that gives each rank only the clean rows its rows see,
and the backward's reverse all-to-all returns only their gradients."""

from megatron_csbp.core import comm
from megatron_csbp.core.transports.ring import (local_grads, noisy_backward, noisy_forward, repack, returned_grads,
                                                transported, unpack, with_noisy)


def forward(q, k, v, ring, plan, scale):
    """All-gathers the ring's transported K/V (or exchanges what each rank sees: `plan.exchange`) while the local
    noisy attention runs, then attends to all its keys at once (the clean keys; every key under the field's CP,
    in its one masked call). `q [b, kv_heads, group, s, d]`, `k, v [b, kv_heads, s, d]` -> `(out, lse, (gathered,))`:
    the gathered buffer is what the backward needs besides the inputs."""
    sent, exchange = transported(k, v, plan.layout), plan.exchange
    if ring is None:
        gathered, work = sent, None
    elif exchange is None:
        gathered, work = comm.all_gather_start(sent, ring)
    else:
        gathered, work = comm.all_to_all_start(sent.index_select(0, exchange.outgoing), exchange.send_counts,
                                               exchange.receive_counts, ring)
    noisy_part = noisy_forward(plan, q, k, v, scale)
    comm.wait_all(work or [], "forward: clean K/V all-gather", ring)
    keys_k, keys_v = unpack(gathered, plan.gathered_key_rows)
    remote = plan.remote_forward(q, keys_k, keys_v, plan.gathered, scale)
    return (*with_noisy(noisy_part, remote, plan.layout), (gathered,))


def backward(dout, q, k, v, out, lse, saved, ring, plan, scale):
    """The remote part's backward against the gathered keys, whose dK/dV are reduce-scattered to their owners (or
    returned to them by the reverse exchange) while the local noisy backward runs -> `(dq, dk, dv)`."""
    gathered, = saved
    exchange = plan.exchange
    keys_k, keys_v = unpack(gathered, plan.gathered_key_rows)
    dq, dk_keys, dv_keys = plan.remote_backward(dout, q, keys_k, keys_v, out, lse, plan.gathered, scale)
    d_gathered = repack(dk_keys, dv_keys, plan.gathered_key_rows, gathered.shape[0])
    if ring is None:
        d_sent, work = d_gathered, None
    elif exchange is None:
        d_sent, work = comm.reduce_scatter_start(d_gathered, ring)
    else:
        d_sent, work = comm.all_to_all_start(d_gathered, exchange.receive_counts, exchange.send_counts, ring)
    noisy_grads = noisy_backward(plan, dout, q, k, v, out, lse, scale)
    comm.wait_all(work or [], "backward: clean dK/dV reduce-scatter", ring)
    if exchange is not None:
        d_sent = returned_grads(d_sent, exchange.outgoing, plan.layout.num_rows - plan.layout.first_transported_row)
    return local_grads(dq, noisy_grads, d_sent, k, v, plan.layout)
