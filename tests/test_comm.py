"""The collectives' timing layer: wait time counted, the simulated link's delay taken in `wait()` on one
serial link per rank, and `serialised()` waiting at issue. A fake clock drives it, so nothing is timed."""

import pytest

from megatron_csbp.core import comm


class FakeClock:
    def __init__(self):
        self.now, self.slept = 100.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        assert seconds > 0
        self.slept.append(seconds)
        self.now += seconds


class FakeWork:
    """A backend handle that completes after `backend_s` of (fake) time, counting its waits."""

    def __init__(self, clock, backend_s=0.0):
        self.clock, self.backend_s, self.waits = clock, backend_s, 0

    def wait(self):
        self.waits += 1
        self.clock.now += self.backend_s


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(comm, "_clock", fake)
    monkeypatch.setattr(comm, "_sleep", fake.sleep)
    return fake


def test_link_delay_is_taken_in_wait_and_hidden_by_compute_in_between(clock):
    link_s = 1_000_000 * 8 / 1e9 + 50e-6  # 1 MB at 1 Gb/s + 50 us
    with comm.simulated_link(1.0, latency_us=50), comm.count_bytes() as counter:
        handle = comm._issued(FakeWork(clock), 1_000_000)
        assert clock.slept == []  # issuing never sleeps
        clock.now += 0.003  # compute overlapping the transfer
        handle.wait()
        assert clock.slept == [pytest.approx(link_s - 0.003)]
        assert counter.wait_s == pytest.approx(link_s - 0.003) and counter.bytes_sent == 1_000_000
        clock.now += 1.0  # compute longer than the transfer: the link costs nothing more
        comm._issued(FakeWork(clock), 1_000_000).wait()
        clock.now += 1.0
        assert len(clock.slept) == 2  # the second handle had to wait its own transfer...
        late = comm._issued(FakeWork(clock), 1_000_000)
        clock.now += 1.0
        late.wait()
        assert len(clock.slept) == 2  # ...this one was done before its wait
    assert comm._settings.link is None


def test_transfers_share_one_serial_link(clock):
    with comm.simulated_link(8.0):  # 1 GB/s: 1 ms per MB
        first, second = comm._issued(FakeWork(clock), 1_000_000), comm._issued(FakeWork(clock), 1_000_000)
        second.wait()
        assert clock.now == pytest.approx(100.002)  # the second waited for the first to clear the link
        first.wait()
        assert len(clock.slept) == 1


def test_backend_time_counts_and_a_handle_waits_once(clock):
    work = FakeWork(clock, backend_s=0.25)
    with comm.count_bytes() as counter:
        handle = comm._issued(work, 10)
        handle.wait()
        handle.wait()
    assert work.waits == 1 and counter.wait_s == pytest.approx(0.25) and clock.slept == []


def test_serialised_waits_at_issue(clock):
    work = FakeWork(clock, backend_s=0.5)
    with comm.serialised(), comm.count_bytes() as counter:
        comm._issued(work, 10)
        assert work.waits == 1 and counter.wait_s == pytest.approx(0.5)
    assert comm._settings.overlap


def test_bad_link_is_refused():
    with pytest.raises(ValueError, match="--link-gbps"):
        comm.SimulatedLink(0.0)
