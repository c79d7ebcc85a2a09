"""The collective transport: one all-gather of the transported K/V, overlapped with the local noisy attention;
the backward reduce-scatters their gradients, overlapped with the local noisy backward."""

from megatron_csbp.core import comm
from megatron_csbp.core.transports.ring import (local_grads, noisy_backward, noisy_forward, repack, transported,
                                                unpack, with_noisy)


def forward(q, k, v, ring, plan, scale):
    """All-gathers the ring's transported K/V while the local noisy attention runs, then attends to all its keys
    at once (the clean keys; every key under the field's CP, in its one masked call).
    `q [b, kv_heads, group, s, d]`, `k, v [b, kv_heads, s, d]` -> `(out, lse, (gathered,))`: the gathered
    buffer is what the backward needs besides the inputs."""
    sent = transported(k, v, plan.layout)
    gathered, work = comm.all_gather_start(sent, ring) if ring is not None else (sent, None)
    noisy_part = noisy_forward(plan, q, k, v, scale)
    comm.wait_all(work or [], "forward: clean K/V all-gather", ring)
    keys_k, keys_v = unpack(gathered, plan.gathered_key_rows)
    remote = plan.remote_forward(q, keys_k, keys_v, plan.gathered, scale)
    return (*with_noisy(noisy_part, remote, plan.layout), (gathered,))


def backward(dout, q, k, v, out, lse, saved, ring, plan, scale):
    """The remote part's backward against the gathered keys, whose dK/dV are reduce-scattered to their owners
    while the local noisy backward runs -> `(dq, dk, dv)`."""
    gathered, = saved
    keys_k, keys_v = unpack(gathered, plan.gathered_key_rows)
    dq, dk_keys, dv_keys = plan.remote_backward(dout, q, keys_k, keys_v, out, lse, plan.gathered, scale)
    d_gathered = repack(dk_keys, dv_keys, plan.gathered_key_rows, gathered.shape[0])
    d_sent, work = comm.reduce_scatter_start(d_gathered, ring) if ring is not None else (d_gathered, None)
    noisy_grads = noisy_backward(plan, dout, q, k, v, out, lse, scale)
    comm.wait_all(work or [], "backward: clean dK/dV reduce-scatter", ring)
    return local_grads(dq, noisy_grads, d_sent, k, v, plan.layout)
