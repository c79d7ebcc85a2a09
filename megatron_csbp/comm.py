"""The collectives the attention ops issue, each counting the bytes this rank sends.

Counts follow the bandwidth-optimal ring algorithms every backend uses for these collectives, so they
do not depend on the backend: an all-gather of `n` bytes per rank sends `(C-1)·n`, a reduce-scatter
of `n` bytes in total sends `(C-1)/C·n`, a point-to-point send sends its tensor. Benchmarks and tests
read them with `count_bytes()`.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TrafficCounter:
    """Bytes this rank sent through the ops' collectives while the counter was active."""

    bytes_sent: int = 0


_active: list[TrafficCounter] = []


@contextmanager
def count_bytes():
    """`with count_bytes() as counter: ...` then read `counter.bytes_sent`."""
    counter = TrafficCounter()
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)


def _record(nbytes: int) -> None:
    for counter in _active:
        counter.bytes_sent += nbytes


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_gather_start(shard: torch.Tensor, group) -> tuple[torch.Tensor, dist.Work]:
    """Starts gathering every rank's `shard` along dim 0, in group order; wait on the handle before use."""
    size = dist.get_world_size(group)
    gathered = shard.new_empty((size * shard.shape[0],) + tuple(shard.shape[1:]))
    work = dist.all_gather_single(gathered, shard.contiguous(), group=group, async_op=True)
    _record((size - 1) * _nbytes(shard))
    return gathered, work


def reduce_scatter_start(full: torch.Tensor, group) -> tuple[torch.Tensor, dist.Work]:
    """Starts summing `full` over the group and handing each rank its slice of dim 0, in group order."""
    size = dist.get_world_size(group)
    shard = full.new_empty((full.shape[0] // size,) + tuple(full.shape[1:]))
    work = dist.reduce_scatter_single(shard, full.contiguous(), op=dist.ReduceOp.SUM, group=group,
                                      async_op=True)
    _record((size - 1) * _nbytes(full) // size)
    return shard, work


def ring_shift_start(tensor: torch.Tensor, group) -> tuple[torch.Tensor, list[dist.Work]]:
    """Starts sending `tensor` to the next rank of the ring and receiving the previous rank's."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(tensor)
    operations = [dist.P2POp(dist.isend, tensor.contiguous(), dist.get_global_rank(group, (me + 1) % size), group),
                  dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (me - 1) % size), group)]
    works = dist.batch_isend_irecv(operations)
    _record(_nbytes(tensor))
    return received, works


def wait_all(works, what: str = "a CSBP collective", group=None) -> None:
    """Waits for `works`, watched by the rank's watchdog (`supervision`) as `what` over `group`."""
    from megatron_csbp import supervision

    with supervision.watch((what, group) if group is not None else what):
        for work in works if isinstance(works, (list, tuple)) else [works]:
            work.wait()
