"""The collectives the attention ops issue, each counting the bytes this rank sends and the time the
compute path waits for it.

Counts follow the bandwidth-optimal ring algorithms every backend uses for these collectives, so they
do not depend on the backend: an all-gather of `n` bytes per rank sends `(C-1)·n`, a reduce-scatter
of `n` bytes in total sends `(C-1)/C·n`, an all-to-all the rows it sends to other ranks, a point-to-point send
its tensor. Benchmarks and tests
read them with `count_bytes()`, beside `wait_s`: the seconds spent blocked in the handles' `wait()`,
i.e. the communication the compute did not hide (exposed communication).

`count_all_to_all()` counts, while active, the bytes this rank sends through `torch.distributed.all_to_all_single`
(megatron-core's MoE token dispatcher issues its exchanges there): every split but the rank's own.

`simulated_link(gbps, latency_us)` makes every collective last at least `latency + bytes / bandwidth`
from its start, on one link per rank that carries one transfer at a time: the delay is taken in the
handle's `wait()`, so compute issued between start and wait hides it as on a real link, and nothing
sleeps before a collective is issued. `serialised()` waits for each collective as soon as it starts
(no overlap), to measure what the overlap hides.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TrafficCounter:
    """Bytes this rank sent through the ops' collectives while the counter was active, and the seconds the
    caller spent waiting for them to complete."""

    bytes_sent: int = 0
    wait_s: float = 0.0


@dataclass(frozen=True)
class SimulatedLink:
    """A link of `gbps` gigabits per second each way with `latency_us` microseconds per transfer."""

    gbps: float
    latency_us: float = 0.0

    def __post_init__(self):
        if not self.gbps > 0 or self.latency_us < 0:
            raise ValueError(f"a simulated link needs gbps > 0 and latency_us >= 0; got {self.gbps}, "
                             f"{self.latency_us} (--link-gbps, --link-latency-us)")

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + nbytes * 8 / (self.gbps * 1e9)


@dataclass
class _Settings:
    link: SimulatedLink | None = None
    link_free_at: float = 0.0  # when this rank's simulated link finishes its last transfer
    overlap: bool = True


_settings = _Settings()
_clock, _sleep = time.perf_counter, time.sleep  # one place, so tests can drive a fake clock
# the function itself, held here: `count_all_to_all` wraps the module's attribute to count what megatron-core's
# MoE dispatcher sends, and the attention's exchanges (counted by `count_bytes`) are not that
_all_to_all_single = dist.all_to_all_single


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


@dataclass
class AllToAllCounter:
    """Bytes this rank sent to other ranks through `all_to_all_single` while counting, and the calls made."""

    bytes_sent: int = 0
    calls: int = 0


@contextmanager
def count_all_to_all():
    """`with count_all_to_all() as counter: ...`: every `torch.distributed.all_to_all_single` issued inside the block
    (by any caller: megatron-core's MoE dispatcher calls it by its module attribute, forward and backward) counts the
    rows of its input that go to other ranks, `sum(input_split_sizes) - input_split_sizes[own rank]` rows (an even
    split when none are given) of `input.numel() / rows` elements. The function is wrapped only inside the block."""
    counter, original = AllToAllCounter(), dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        size, me, rows = dist.get_world_size(group), dist.get_rank(group), input.shape[0]
        splits = [rows // size] * size if input_split_sizes is None else [int(n) for n in input_split_sizes]
        row_bytes = input.numel() // rows * input.element_size() if rows else 0
        counter.bytes_sent += (sum(splits) - splits[me]) * row_bytes
        counter.calls += 1
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counted
    try:
        yield counter
    finally:
        dist.all_to_all_single = original


@contextmanager
def simulated_link(gbps: float, latency_us: float = 0.0):
    """Within the block, collectives take at least `latency + bytes / bandwidth` (see the module docstring)."""
    previous = _settings.link
    set_link(SimulatedLink(gbps, latency_us))
    try:
        yield _settings.link
    finally:
        set_link(previous)


def set_link(link: SimulatedLink | None) -> None:
    """The simulated link of the rest of the run (None: the backend's own speed)."""
    _settings.link, _settings.link_free_at = link, 0.0


@contextmanager
def serialised():
    """Within the block every collective is waited for as soon as it starts: nothing overlaps it."""
    previous, _settings.overlap = _settings.overlap, False
    try:
        yield
    finally:
        _settings.overlap = previous


class _Work:
    """A collective's handle: `wait()` returns once the backend is done and the simulated link (if any) has
    carried the bytes, and adds the time it blocked to the active counters."""

    def __init__(self, works, done_at: float):
        self._works, self._done_at, self._waited = works, done_at, False

    def wait(self, timeout=None) -> bool:
        if self._waited:
            return True
        start = _clock()
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        now = _clock()
        if self._done_at > now:
            _sleep(self._done_at - now)
        self._waited = True
        for counter in _active:
            counter.wait_s += _clock() - start
        return True


def _issued(works, nbytes: int) -> _Work:
    """Counts a started collective of `nbytes` sent bytes and returns its handle."""
    for counter in _active:
        counter.bytes_sent += nbytes
    done_at = 0.0
    if _settings.link is not None:
        begin = max(_clock(), _settings.link_free_at)
        done_at = _settings.link_free_at = begin + _settings.link.transfer_s(nbytes)
    handle = _Work(works if isinstance(works, (list, tuple)) else [works], done_at)
    if not _settings.overlap:
        handle.wait()
    return handle


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_gather_start(shard: torch.Tensor, group) -> tuple[torch.Tensor, _Work]:
    """Starts gathering every rank's `shard` along dim 0, in group order; wait on the handle before use."""
    size = dist.get_world_size(group)
    gathered = shard.new_empty((size * shard.shape[0],) + tuple(shard.shape[1:]))
    work = dist.all_gather_single(gathered, shard.contiguous(), group=group, async_op=True)
    return gathered, _issued(work, (size - 1) * _nbytes(shard))


def reduce_scatter_start(full: torch.Tensor, group) -> tuple[torch.Tensor, _Work]:
    """Starts summing `full` over the group and handing each rank its slice of dim 0, in group order."""
    size = dist.get_world_size(group)
    shard = full.new_empty((full.shape[0] // size,) + tuple(full.shape[1:]))
    work = dist.reduce_scatter_single(shard, full.contiguous(), op=dist.ReduceOp.SUM, group=group,
                                      async_op=True)
    return shard, _issued(work, (size - 1) * _nbytes(full) // size)


def _row_bytes(tensor: torch.Tensor) -> int:
    return tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0


def all_to_all_start(pieces: torch.Tensor, send_counts, receive_counts, group) -> tuple[torch.Tensor, _Work]:
    """Starts sending rank `j` of the group the `send_counts[j]` rows of `pieces` (dim 0, member by member) and
    receiving `receive_counts[j]` rows from it, in group order; a rank's own rows are copied, not sent (uncounted)."""
    me = dist.get_rank(group)
    received = pieces.new_empty((sum(receive_counts),) + tuple(pieces.shape[1:]))
    work = _all_to_all_single(received, pieces.contiguous(), list(receive_counts), list(send_counts), group=group,
                              async_op=True)
    return received, _issued(work, (sum(send_counts) - send_counts[me]) * _row_bytes(pieces))


def pair_exchange_start(outgoing: torch.Tensor, to: int, incoming_rows: int, source: int,
                        group) -> tuple[torch.Tensor, list]:
    """Starts sending `outgoing` to group rank `to` and receiving `incoming_rows` rows (of `outgoing`'s row shape)
    from group rank `source`; an empty side is not posted."""
    received = outgoing.new_empty((incoming_rows,) + tuple(outgoing.shape[1:]))
    operations = []
    if outgoing.shape[0]:
        operations.append(dist.P2POp(dist.isend, outgoing.contiguous(), dist.get_global_rank(group, to), group))
    if incoming_rows:
        operations.append(dist.P2POp(dist.irecv, received, dist.get_global_rank(group, source), group))
    if not operations:
        return received, []
    return received, [_issued(dist.batch_isend_irecv(operations), _nbytes(outgoing))]


def ring_shift_start(tensor: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Starts sending `tensor` to the next rank of the ring and receiving the previous rank's."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(tensor)
    operations = [dist.P2POp(dist.isend, tensor.contiguous(), dist.get_global_rank(group, (me + 1) % size), group),
                  dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (me - 1) % size), group)]
    return received, [_issued(dist.batch_isend_irecv(operations), _nbytes(tensor))]


def wait_all(works, what: str = "a CSBP collective", group=None) -> None:
    """Waits for `works`, watched by the rank's watchdog (`supervision`) as `what` over `group`."""
    from megatron_csbp.core import supervision

    with supervision.watch((what, group) if group is not None else what):
        for work in works if isinstance(works, (list, tuple)) else [works]:
            work.wait()
