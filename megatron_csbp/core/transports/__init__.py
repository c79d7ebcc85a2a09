"""The transports that carry the ring's K/V — collective and streaming — as objects that state their facts.

Each transport is one algorithm in its own file (`collective.py`, `streaming.py`: a `forward` and a
`backward` over heads-first tensors), sharing the ring helpers of `ring.py`; what the FLOP/byte counter
and the planner need to know of it (its backward's bytes relative to its forward's, how many messages a
layer's pass sends, which attention work hides the link) is stated here, so no caller tests its name
(docs/algorithm.md §7).

This module is standard library only (the planner runs without torch): each transport's `functions()`
imports its file (torch) when the op first binds it.
"""

import dataclasses

from megatron_csbp.core.variants import Registry, named


@named
@dataclasses.dataclass(frozen=True)
class Transport:
    """A way to move the transported K/V around a ring of `C` ranks (base: one collective per pass)."""

    name: str
    summary: str
    backward_bytes_per_forward: int = 1  # the backward's bytes over the forward's (dK/dV; K/V again when streamed)
    hides_behind_all_pairs: bool = False  # the link overlaps all attention (each step's), not only the local part
    call_per_member: bool = False  # the remote kernel is called once per ring member's shard, not once in all

    def forward_messages(self, clean_shards: int) -> int:
        """Messages (each paying the link's latency) in one layer's forward."""
        return 1

    def backward_messages(self, clean_shards: int) -> int:
        """Messages in one layer's backward."""
        return 1

    def functions(self):
        """`(forward, backward)` of this transport (see `collective.py` for their signatures)."""
        from megatron_csbp.core.transports import collective
        return collective.forward, collective.backward


class _Ring(Transport):
    """Shards passed to the next rank `C-1` times; the backward sends K/V and the dK/dV accumulators each step."""

    def forward_messages(self, clean_shards):
        return clean_shards - 1

    def backward_messages(self, clean_shards):
        return 2 * (clean_shards - 1)

    def functions(self):
        from megatron_csbp.core.transports import streaming
        return streaming.forward, streaming.backward


COLLECTIVE = Transport("collective", "all-gather the transported K/V, reduce-scatter their gradients")
STREAMING = _Ring("streaming", "pass shards around the ring, folding each into a running output (bounded memory)",
                  backward_bytes_per_forward=2, hides_behind_all_pairs=True, call_per_member=True)

TRANSPORTS = Registry("--csbp-transport", COLLECTIVE, STREAMING)  # the flag's choices, in order
transport = TRANSPORTS  # transport(name or transport) -> the transport; ValueError naming the choices
