"""Drain and yield requests read off the executor's event path (job/requests.py): a reading never waits."""

from __future__ import annotations

import threading
import time

from rallypoint.basics.clock import SYSTEM_CLOCK, FakeClock
from rallypoint.basics.errors import StoreError
from rallypoint.basics.logs import get_logger
from rallypoint.etcd.drains import DrainRequest
from rallypoint.orchestrator.job.requests import RequestReader, Requests
from tests.conftest import wait_until

LOG = get_logger("test")


def test_a_slow_etcd_never_holds_up_the_executor_and_its_reading_arrives_later() -> None:
    release = threading.Event()
    reads: list[bool] = []

    def read(with_cluster: bool, started: float) -> Requests:
        reads.append(with_cluster)
        release.wait(5)  # etcd answers slowly
        return Requests(drains={"w1": DrainRequest("w1", "operator", "me", 0.0, 0.0, revision=7)}, started=started)

    reader = RequestReader(read, clock=SYSTEM_CLOCK, log=LOG, period_s=0.01)
    t0 = time.monotonic()
    assert reader.take() is None  # the read is under way on the reader's thread: nothing yet, and no wait
    assert time.monotonic() - t0 < 0.5
    release.set()
    got: list[Requests] = []
    wait_until(lambda: bool(got.append(r) if (r := reader.take()) is not None else None) or bool(got), 5, "a reading")
    assert set(got[0].drains) == {"w1"}
    reader.with_cluster = True  # a shrunk slice looks for room: the next readings read the cluster too
    wait_until(lambda: reads[-1], 5, "a reading with the cluster")


def test_a_reading_from_before_the_drains_changed_etcd_is_dropped() -> None:
    gate, entered = threading.Event(), threading.Event()

    def read(with_cluster: bool, started: float) -> Requests:
        entered.set()
        gate.wait(5)
        return Requests(started=started)

    reader = RequestReader(read, clock=SYSTEM_CLOCK, log=LOG, period_s=0.01)
    reader.take()  # a read starts, and waits at the gate
    assert entered.wait(5)
    reader.invalidate()  # a drain started meanwhile: that read is stale
    gate.set()
    wait_until(lambda: reader.take() is not None, 5, "a reading started after the drain")


def test_a_read_that_fails_is_retried_and_the_reading_thread_lives_on() -> None:
    calls: list[int] = []

    def read(with_cluster: bool, started: float) -> Requests:
        calls.append(1)
        if len(calls) == 1:
            raise StoreError("etcd away")
        if len(calls) == 2:
            raise KeyError("a bug")  # logged; the reads go on
        return Requests(started=started)

    reader = RequestReader(read, clock=SYSTEM_CLOCK, log=LOG, period_s=0.01)
    wait_until(lambda: reader.take() is not None, 5, "a reading after two failures")


def test_under_an_injected_clock_the_reads_are_made_by_the_caller_at_the_period() -> None:
    clock = FakeClock()
    reads: list[float] = []
    reader = RequestReader(lambda c, started: reads.append(started) or Requests(started=started), clock=clock, log=LOG,
                           period_s=0.5)
    assert reader.take() is not None and reader.take() is None  # once per period
    clock.sleep(0.5)
    assert reader.take() is not None and len(reads) == 2
